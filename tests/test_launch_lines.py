"""What a user sees at the end of a failed launch through launch/torchrun.py (the launch scripts'
torchrun), with real processes: a stop after start-up, which rank 0's log says on the console,
said once (not again as the launcher's last line) unless torchrun keeps rank 0's output off the
console; and a rank that lost its peer pointing at what the launch shows, not at torchrun's
summary, which the launcher leaves out. Config errors before any process group are
tests/test_launch.py's."""

import socket
import subprocess
import sys

import pytest
from conftest import ROOT
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
