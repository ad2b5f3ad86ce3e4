"""What a user sees at the end of a failed launch through launch/torchrun.py (the launch scripts'
torchrun), with real processes: a stop after start-up, which rank 0's log says on the console,
said once (not again as the launcher's last line) unless torchrun keeps rank 0's output off the
console; a rank's hang report, which the hung rank's watchdog says and records, said once
too; a rank that lost its peer pointing at what the launch shows, not at torchrun's
summary, which the launcher leaves out; and a node that lost the node hosting the rendezvous
ending in one line, not in torch's tracebacks. Config errors before any process group are
tests/test_launch.py's."""

import re
import socket
import subprocess
import sys

import pytest
from conftest import ROOT, free_port
from test_hang_report import RUN as HANGS_AT_STEP_20
from test_launch import TINY, script_env

LAUNCH = ROOT / "launch" / "torchrun.py"
NO_MANIFEST = "missing manifest: the save never finished"


def launch(tmp_path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(LAUNCH), "--standalone", "--nproc-per-node=2", *args],
        cwd=tmp_path,
        env=script_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize("filtered", [False, True], ids=["all-ranks", "rank-1-shown"])
def test_a_stop_after_start_up_is_said_once(tmp_path, filtered):
    """A checkpoint to resume from that cannot be read: every rank stops once the process group
    is up (CheckpointError), rank 0's log saying why on the console. Where torchrun shows only
    rank 1's output (--local-ranks-filter=1, which quiets that line), the launcher says it."""
    step = tmp_path / "old" / "checkpoints" / "step-5"
    step.mkdir(parents=True)  # a save that never finished: no manifest
    shown = ["--local-ranks-filter=1"] if filtered else []
    proc = launch(
        tmp_path,
        *shown,
        str(ROOT / "train.py"),
        *TINY,
        f"ckpt.resume={step}",
        f"hydra.run.dir={tmp_path / 'run'}",
    )
    output = proc.stdout + proc.stderr
    said = [line for line in output.splitlines() if NO_MANIFEST in line]
    assert len(said) == 1 and str(step) in said[0], output[-3000:]
    assert proc.returncode == 1 and "Traceback" not in output, output[-3000:]
    if filtered:  # the launcher's own line, last
        assert output.strip().splitlines()[-1] == f"mgpu: {step}/manifest.json: {NO_MANIFEST}"


def test_a_hang_report_is_said_once(tmp_path):
    """Rank 1 stops for good in its forward (tests.faults.HangGPT); its watchdog's stall clock
    says why on its console and records the line for torchrun, marked as said, before it ends
    the process (os._exit, code 70): the launcher, which shows rank 1's output, does not say it
    again. (That the record holds the line: test_hang_report, torchrun's own table.)"""
    proc = launch(
        tmp_path,
        str(ROOT / "train.py"),
        *HANGS_AT_STEP_20,
        "dist.timeout_s=300",
        "trainer.stall_timeout_s=4",
        f"hydra.run.dir={tmp_path / 'run'}",
        timeout=300,
    )
    output = proc.stdout + proc.stderr
    report = re.compile(r"rank 1: no progress for \d+ s .*: the other ranks wait for this one")
    said = [line for line in output.splitlines() if report.search(line)]
    assert len(said) == 1, output[-3000:]
    assert proc.returncode == 70 and "Traceback" not in output, output[-3000:]


# Two ranks in a gloo group under mgpu's stopped(); rank 1's process is killed (SIGKILL) while
# rank 0 waits for it in a collective. Rank 0 holds torchrun's SIGTERM back as train.py's
# Preemption does during training, so that it lives to say its line.
LOSES_A_PEER = """
import os, signal
import torch
import torch.distributed as tdist
from mgpu.runtime.dist import distributed, exit_process, stopped

def main():
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    with distributed("gloo", timeout_s=60) as rt, stopped(rt):
        tdist.all_reduce(torch.ones(1))
        if rt.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        tdist.all_reduce(torch.ones(1))

exit_process(main)
"""


def test_a_rank_that_lost_its_peer_points_at_what_the_launch_shows(tmp_path):
    """Rank 0's one line sends the user to what they see: the killed rank's log and the end of
    the launch's output, which names that rank; torchrun's summary is not shown there."""
    worker = tmp_path / "loses_a_peer.py"
    worker.write_text(LOSES_A_PEER)
    proc = launch(tmp_path, str(worker))
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    stopped = [line for line in lines if "rank 0: stopped: another rank's process ended" in line]
    assert len(stopped) == 1 and "gone: rank 1 (pid " in stopped[0], lines
    assert "summary" not in stopped[0] and "Root Cause" not in stopped[0], stopped[0]
    assert stopped[0].endswith("the end of the launch's output on its node say why"), stopped[0]
    # what that end is: the launcher's line for the killed rank, last
    assert (
        lines[-1]
        == f"launch: rank 1 (local rank 1 on {socket.gethostname()}) was killed by SIGKILL"
    )
    assert proc.returncode == 128 + 9, lines


# Two nodes of one worker each, as tests/test_two_nodes.py launches them (one agent per node on
# loopback, c10d rendezvous). Node 0's worker, once both are in the process group, kills its
# agent, which hosts the rendezvous's store, and then itself (SIGKILL): node 0 is lost as a
# machine is. Node 1's worker meets the loss in its next collective, under mgpu's stopped(),
# holding its agent's SIGTERM back as train.py's Preemption does during training; or, with
# WORKER_WAITS, it sleeps outside any collective until its agent stops it.
LOSES_THE_HOST = """
import os, signal, time
import torch
import torch.distributed as tdist
from mgpu.runtime.dist import distributed, exit_process, stopped

def main():
    if not os.environ.get("WORKER_WAITS"):
        signal.signal(signal.SIGTERM, lambda signum, frame: None)
    with distributed("gloo", timeout_s=60) as rt, stopped(rt):
        tdist.all_reduce(torch.ones(1))
        if os.environ.get("LOSE_THIS_NODE"):
            agent = os.getppid()
            os.kill(agent, signal.SIGKILL)  # the agent, and the rendezvous store with it
            while os.getppid() == agent:  # gone, its sockets closed, as a lost machine's are
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGKILL)
        if os.environ.get("WORKER_WAITS"):
            time.sleep(120)  # in no collective: its agent is the first to meet the loss
        tdist.all_reduce(torch.ones(1))

exit_process(main)
"""
WORKER = "[default0]:"  # torchrun's prefix of its worker's lines under --tee (local rank 0)


@pytest.mark.parametrize("worker_waits", [False, True], ids=["in-a-collective", "between-them"])
def test_a_node_that_lost_the_rendezvous_host_ends_in_one_line(tmp_path, worker_waits):
    """Node 1, its rendezvous store gone with node 0. Its worker, in a collective when node 0
    goes, stops at once with its line naming node 0 as gone (the store does not answer), then
    the launch ends naming the worker: no stack trace of torch's client for each of its tries
    to reach the store. Its worker between collectives: the agent meets the loss first, stops
    the worker, and ends in one line that names the endpoint, says that its workers were
    stopped and what to run. Exit 1, no traceback, nor torch's warnings of each failed
    heartbeat. --tee keeps the worker's lines on the console, marked, to tell them from the
    agent's."""
    worker = tmp_path / "loses_the_host.py"
    worker.write_text(LOSES_THE_HOST)
    endpoint = f"127.0.0.1:{free_port()}"

    def node(index: int) -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, str(LAUNCH), "--nnodes=2", "--nproc-per-node=1"]
            + ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", "--rdzv-id=lost-host"]
            + [f"--rdzv-conf=is_host={int(index == 0)}", f"--local-addr=127.0.0.{index + 1}"]
            + ["--tee=3", f"--log-dir={tmp_path / f'logs{index}'}", str(worker)],
            cwd=tmp_path,
            env=script_env(
                **({"LOSE_THIS_NODE": "1"} if index == 0 else {}),
                **({"WORKER_WAITS": "1"} if index == 1 and worker_waits else {}),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    nodes = [node(0), node(1)]
    try:
        lost, _ = nodes[0].communicate(timeout=60)
        assert nodes[0].returncode == -9, lost[-3000:]  # its agent killed
        out, _ = nodes[1].communicate(timeout=60)
    finally:
        for n in nodes:
            n.kill()
    lines = out.strip().splitlines()
    agent = [line for line in lines if not line.startswith(WORKER)]
    assert "Traceback" not in out and len(agent) < 15, out[-3000:]
    assert nodes[1].returncode == 1, out[-3000:]
    if worker_waits:
        said = f"launch: the node that hosts the rendezvous at {endpoint} is gone or unreachable"
        assert [line for line in lines if said in line] == [lines[-1]], out[-3000:]
        assert "this node's workers were stopped" in lines[-1], lines[-1]
        assert "run the same command on every node again to resume" in lines[-1], lines[-1]
        return
    stopped = [line for line in lines if ": stopped: another rank's process ended" in line]
    assert len(stopped) == 1 and stopped[0].startswith(WORKER), out[-3000:]
    assert "rank 0's node (127.0.0.1, the launch's store) is gone" in stopped[0], stopped[0]
    # the waiting line, the worker's, and the launch's last: naming the worker, or the lost
    # rendezvous where the agent met the loss before the worker ended
    assert len(lines) == 3 and "frame #" not in out, out[-3000:]
    last = ("launch: rank 1 (local rank 0 on ", "launch: the node that hosts the rendezvous")
    assert lines[-1].startswith(last), lines[-1]
