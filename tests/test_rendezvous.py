"""Joining the process group (mgpu.runtime.dist.join_process_group): each torchrun attempt meets
under keys of its own in a store that outlives it, as torchrun's agent's store does; a rank that
never comes is named after a bounded wait; and a start-up collective that times out (the first one,
agreeing on the checkpoint to resume from) ends in one line naming the rank and what it waited
in. Real stores and gloo process groups; the end-to-end restarts are in test_resume.py."""

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as tdist
from conftest import free_port, gloo_runtime, spawn

from mgpu.ckpt.resume import resume_point
from mgpu.config.schema import CheckpointConfig
from mgpu.runtime.dist import PeerTimeout, check_same_config, join_process_group
from mgpu.runtime.launch import parse_launch_env

CPU = torch.device("cpu")


def attempt(restart: int = 0, *, world: int = 1, shared: bool = True):
    """Rank 0's launch environment in torchrun attempt `restart` on one node."""
    return parse_launch_env(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": str(world),
            "TORCHELASTIC_RESTART_COUNT": str(restart),
            "TORCHELASTIC_MAX_RESTARTS": "3",
            "TORCHELASTIC_USE_AGENT_STORE": str(shared),
        }
    )


@pytest.fixture
def agent_store(monkeypatch):
    """A store that outlives the attempts, as torchrun's agent's does, at MASTER_ADDR:PORT."""
    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    return store


def test_each_restart_meets_under_keys_of_its_own(agent_store):
    for restart in (0, 1, 2):
        join_process_group(attempt(restart), "gloo", 10, CPU)
        try:
            total = torch.ones(1)
            tdist.all_reduce(total)  # the group works
            assert total.item() == 1
        finally:
            tdist.destroy_process_group()
        assert agent_store.check([f"mgpu/attempt-{restart}/join/0"])
    # The keys of an attempt that ran already (what a node whose restart count lags behind
    # another's would find): one line naming the fix, not an earlier attempt's addresses.
    with pytest.raises(PeerTimeout) as stop:
        join_process_group(attempt(1), "gloo", 10, CPU)
    assert not tdist.is_initialized()
    assert str(stop.value).startswith("rank 0: torchrun restart 1 of this node finds an earlier")
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in str(stop.value)
    assert "\n" not in str(stop.value)


@pytest.mark.parametrize("shared", [True, False], ids=["agent-store", "rank-0-store"])
def test_a_rank_that_never_joins_is_named_after_a_bounded_wait(monkeypatch, shared):
    if shared:
        agent = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        port = agent.port
    else:  # rank 0 hosts the store, bound to loopback (mgpu.runtime.launch.loopback_store)
        port = free_port()
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            monkeypatch.setenv(name, "lo")  # loopback_store sets them; restored after the test
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    with pytest.raises(PeerTimeout) as stop:
        join_process_group(attempt(world=2, shared=shared), "gloo", 2, CPU)
    assert not tdist.is_initialized()
    message = str(stop.value)
    assert message.startswith("rank 0: waited 2 s (dist.timeout_s) for rank 1 to join the ")
    assert f"(the launch's store at 127.0.0.1:{port}, torchrun restart 0)" in message
    assert "\n" not in message


def _one_rank_waits(rank: int, port: int, what: str, root: str) -> None:
    """Rank 0 waits in `what`; rank 1 never comes, but stays until rank 0 has timed out."""
    with gloo_runtime(rank, port, timeout_s=3) as rt:
        if rank == 1:
            time.sleep(8)  # past rank 0's 3 s: a peer that is there but never calls
            return
        with pytest.raises(PeerTimeout) as stop:
            if what == "config":
                check_same_config("trainer:\n  seed: 0\n", rt)
            else:
                resume_point(CheckpointConfig(), root, rt)
        message = str(stop.value)
        waited = {
            "config": "the first collective (the check that every rank has one config)",
            "resume": "agreeing on the checkpoint to resume from",
        }[what]
        assert message.startswith(
            f"rank 0: timed out (dist.timeout_s) waiting for the other ranks in {waited}; "
        ), message
        assert "\n" not in message


@pytest.mark.parametrize("what", ["config", "resume"])
def test_a_start_up_collective_that_times_out_names_the_rank_and_the_wait(tmp_path, what):
    spawn(_one_rank_waits, free_port(), what, str(tmp_path / "checkpoints"))


def test_stopped_turns_a_lost_peer_into_one_line_and_keeps_its_own_stops(caplog):
    """mgpu.runtime.dist.stopped: a collective whose peer process ended (gloo's and NCCL's words
    for it) becomes exit 1 and one line naming this rank; a stop of mgpu's own that is also a
    RuntimeError (PeerTimeout) keeps its own line, even where its text holds the same words;
    the same words from outside the backends, and any other error, are raised as they were."""
    import signal

    from mgpu.runtime.dist import Runtime, peer_gone, stopped

    gloo = "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:36074."
    nccl = "NCCL error: remote process exited or there was a network error, NCCL version 2.28"
    assert peer_gone(RuntimeError(gloo)) == "connection closed by peer"
    assert peer_gone(tdist.DistBackendError(nccl)) == "remote process exited"
    assert peer_gone(RuntimeError("CUDA out of memory")) is None
    assert peer_gone(RuntimeError("upload failed: connection reset by peer")) is None  # not ours
    assert peer_gone(ValueError(gloo)) is None
    rt = Runtime(1, 1, 2, "gloo", torch.device("cpu"), has_process_group=False)
    held = signal.getsignal(signal.SIGTERM)  # stopped() ignores SIGTERM on its way out
    try:
        with pytest.raises(SystemExit) as stop, caplog.at_level("INFO", logger="mgpu"):
            with stopped(rt):
                raise RuntimeError(gloo)
        assert stop.value.code == 1
        assert caplog.messages == [
            "rank 1: stopped: another rank's process ended under a collective (the backend: "
            "connection closed by peer); that rank's log in the run directory and the end of "
            "the launch's output on its node say why"
        ]
        caplog.clear()
        own = f"rank 1: timed out (dist.timeout_s) waiting for the other ranks; {gloo}"
        with pytest.raises(SystemExit) as stop, caplog.at_level("INFO", logger="mgpu"):
            with stopped(rt):
                raise PeerTimeout(own)
        assert stop.value.code == PeerTimeout.exit_code and caplog.messages == [own]
        with pytest.raises(RuntimeError, match="out of memory"):
            with stopped(rt):
                raise RuntimeError("CUDA out of memory")
    finally:
        signal.signal(signal.SIGTERM, held)


LEAVING = """
import sys
import torch.distributed as tdist
from mgpu.runtime.dist import distributed, exit_process, release_before_leaving

class Capture:  # stands for a CUDA graph that recorded collectives on the group
    def __init__(self, name):
        self.name = name
    def release(self):
        with open(sys.argv[1], "a") as f:
            f.write(f"{tdist.get_rank()} {self.name} group={tdist.is_initialized()}\\n")

def main():
    with distributed("gloo", timeout_s=60):
        kept, dropped = Capture("kept"), Capture("dropped")
        release_before_leaving(kept.release)
        release_before_leaving(dropped.release)
        del dropped  # gone before the end: nothing of it is called, nor kept alive
        tdist.barrier()
    with open(sys.argv[1], "a") as f:
        f.write(f"{tdist.is_initialized()}\\n")

exit_process(main)
"""


def test_what_holds_the_group_is_released_before_the_group_is_destroyed(tmp_path):
    # A CUDA graph that recorded NCCL collectives keeps their communicator until the graph is
    # destroyed, and destroy_process_group waits for it: such graphs go first, on every rank.
    script, out = tmp_path / "leaving.py", tmp_path / "out.txt"
    script.write_text(LEAVING)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(out),
        ],  # fmt: skip
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = sorted(out.read_text().splitlines())
    assert lines == ["0 kept group=True", "1 kept group=True", "False", "False"]


def test_a_rank_that_lost_its_peer_tells_the_others_through_the_store(monkeypatch):
    """On NCCL a survivor whose own collectives never touched the lost rank sees no error:
    the first survivor's check-in (peers.ranks_gone) is what the others' watchdog threads read
    (peers.loss_told), never as news to the rank that wrote it. Real TCPStore, ranks as calls."""
    from mgpu.runtime.peers import loss_told, ranks_gone

    store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port)}.items():
        monkeypatch.setenv(key, value)
    for rank in range(3):
        store.set(f"mgpu/join/{rank}", f"host{rank} pid {100 + rank}")
    assert not loss_told(store, 1)  # nobody lost anyone yet
    said = ranks_gone(0, 3, wait_s=0.3)  # rank 0 met the loss; ranks 1 and 2 never check in
    assert said.startswith("gone: rank 1 (pid 101) on host1; rank 2 (pid 102) on host2"), said
    assert loss_told(store, 1) and loss_told(store, 2)
    assert not loss_told(store, 0)  # its own check-in is no news to rank 0
