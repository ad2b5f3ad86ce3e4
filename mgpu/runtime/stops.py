"""How a run's process stops on purpose: RunStopped (an error said in one line with an exit code,
not a traceback), waits on the other ranks that time out (PeerTimeout), a collective whose peer
process ended, and stopped(), which turns each into its line and its exit code. The process
group and the teardown rule are mgpu.runtime.dist's.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

import torch.distributed as tdist

from mgpu.runtime.launch import launch_env
from mgpu.runtime.peers import loss_told, nccl_lost_peer


class Place(Protocol):
    """What stopped() reads of mgpu.runtime.dist.Runtime (which imports this module)."""

    @property
    def rank(self) -> int: ...

    @property
    def is_primary(self) -> bool: ...

    @property
    def backend(self) -> str: ...

    def ranks_gone(self) -> str: ...


BAD_INPUT = 2  # the exit code of a stop for input that cannot work (a config, a data file)


class RunStopped(Exception):
    """An error that ends the run with a message and an exit code, not a traceback (stopped()
    turns it into the exit). `every_rank`: every rank meets it at the same point, so no
    collective is left waiting; rank 0 says it on the console, every rank in its log file."""

    exit_code = 1
    every_rank = True
    level = logging.ERROR

    def report(self) -> str:
        return str(self)


class PeerTimeout(RuntimeError, RunStopped):
    """A wait on the other ranks outside the training loop (joining the process group, the
    first collective, agreeing on the checkpoint to resume from) ended without them. Said by
    the rank that waited, whichever it is."""

    every_rank = False


def is_timeout(err: BaseException) -> bool:
    # Backends raise DistBackendError (a RuntimeError) or plain RuntimeError, both saying so.
    return isinstance(err, RuntimeError) and "timed out" in str(err).lower()


# What a backend says when a collective's peer process has ended: gloo's TCP pairs, NCCL's
# remote-error report and the abort of its communicator (lower case, as matched).
PEER_GONE = (
    "connection closed by peer",
    "connection reset by peer",
    "remote process exited",
    "communicator was aborted",
)


def peer_gone(err: BaseException) -> str | None:
    """The backend's words for a collective whose peer process ended, or None: how a rank
    learns that another one stopped (a bad image after the first step, a crash) mid-run. Only
    the communication backends' errors count (NCCL's DistBackendError, gloo's RuntimeError that
    names its source file): the same words from elsewhere keep their traceback."""
    if not isinstance(err, RuntimeError):
        return None
    text = str(err).lower()
    if not isinstance(err, tdist.DistBackendError) and "gloo" not in text:
        return None
    return next((words for words in PEER_GONE if words in text), None)


def first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


@contextmanager
def waiting(rank: int, what: str) -> Iterator[None]:
    """Around a wait on the other ranks: one that times out (dist.timeout_s bounds every
    collective) becomes one line naming this rank and `what` it waited in."""
    try:
        yield
    except RuntimeError as err:
        if isinstance(err, RunStopped) or not is_timeout(err):
            raise
        raise PeerTimeout(
            f"rank {rank}: timed out (dist.timeout_s) waiting for the other ranks in {what}; "
            f"a rank that is stuck or gone is why (its log says where). The backend said: "
            f"{first_line(err)}"
        ) from err


SAID = "mgpu_said"  # the error file's key for record_for_torchrun's `said` (launch/torchrun.py)


def record_for_torchrun(line: str, path: str, said: bool = False) -> bool:
    """`line` in this worker's error file (`path`: LaunchEnv.error_file), where torchrun reads why
    a worker failed: its closing table shows the line there instead of a link to its docs, and
    launch/torchrun.py ends with it. False without torchrun or where it cannot be written. The
    table's traceback column gets the line without its "mgpu: " (the table names train.py);
    torch's @record would write a traceback that a stop does not have. `said`: this process has
    said the line on its console already, and launch/torchrun.py, where it shows that console,
    does not say it again."""
    if not path:
        return False
    shown = line.removeprefix("mgpu: ")
    extra = {"py_callstack": shown, "timestamp": str(int(time.time()))}
    message: dict = {"message": line, "extraInfo": extra}
    if said:
        message[SAID] = True
    try:
        with open(path, "w") as f:
            json.dump({"message": message}, f)
    except OSError:
        return False
    return True


def on_console(level: int) -> bool:
    """Whether a line that mgpu logs at `level` reaches this process's console: Hydra's console
    handler (a plain StreamHandler; mgpu.runtime.dist.quiet_other_ranks raises its level on
    every rank but 0) lets it through."""
    if not logging.getLogger("mgpu").isEnabledFor(level):
        return False
    handlers = logging.getLogger().handlers
    return any(type(h) is logging.StreamHandler and level >= h.level for h in handlers)


@contextmanager
def stopped(rt: Place) -> Iterator[None]:
    """A RunStopped raised inside becomes its one-line report and SystemExit(its exit code); so
    does a collective that failed because another rank's process ended: that rank says why
    (its own stop, or its crash's traceback), this one says only that it stopped with it, in
    one line with exit code 1, instead of a second traceback that would bury the first."""
    try:
        yield
    except RunStopped as err:  # first: PeerTimeout is a RuntimeError too
        if err.exit_code == BAD_INPUT and threading.current_thread() is threading.main_thread():
            # Every rank stops on its own, with this code: torchrun's SIGTERM, sent as the
            # first of them exits, would turn the others' into -15 on their way out.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        loud = rt.is_primary or not err.every_rank  # an agreed stop is said once
        level = err.level if loud else logging.INFO
        logging.getLogger("mgpu").log(level, "%s", err.report())
        # torchrun's closing table says it too; launch/torchrun.py ends with it only where no
        # worker's console that it shows has (a node without rank 0, say). Logged first: a
        # SIGTERM from torchrun in between leaves a line said twice rather than not at all.
        said = on_console(level)
        record_for_torchrun(f"mgpu: {err.report()}", launch_env().error_file, said)
        raise SystemExit(err.exit_code) from None
    except RuntimeError as err:
        words = peer_gone(err)
        if words is None:
            raise
        if threading.current_thread() is threading.main_thread():
            # torchrun's SIGTERM, sent as the first rank exited, must not end this one as -15
            # before it has said why it stops (the SIGTERM handler of a run is gone by now)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if rt.backend == "nccl":
            leave_lost(rt, words)
        gone = rt.ranks_gone()  # a lost node's ranks and host, or a crashed rank's
        logging.getLogger("mgpu").error("%s", peer_gone_line(rt.rank, words, gone))
        raise SystemExit(1) from None


def peer_gone_line(rank: int, words: str, gone: str) -> str:
    """The one line a rank stops with when another rank's process ended under a collective:
    the backend's `words` for it and `gone`, the ranks and hosts that did not answer
    (Runtime.ranks_gone)."""
    return (
        f"rank {rank}: stopped: another rank's process ended under a collective (the backend: "
        f"{words}){f'; {gone}' if gone else ''}; that rank's log in the run directory and the "
        "end of the launch's output on its node say why"
    )


# One lost-peer line per process: the training thread's (stopped) or the watchdog thread's.
_SAYING = threading.Lock()


def lost_peer_stop(rt, store: tdist.Store | None) -> None:
    """On NCCL, asked by mgpu.train.watchdog's thread every couple of seconds: where this rank's
    communicator failed (peers.nccl_lost_peer), or another rank checked in after losing a peer
    (peers.loss_told: ranks whose own collectives never touched the lost one see no error),
    say the line and end the process (leave_lost); else return. `rt`: a Runtime."""
    if nccl_lost_peer(rt.device):
        words = "NCCL's communication error: a peer's process ended or its link broke"
    elif store is not None and loss_told(store, rt.rank):
        words = "NCCL, through another rank that lost its peer"
    else:
        return
    leave_lost(rt, words)


def leave_lost(rt, words: str) -> None:
    """Say the lost-peer line and end the process at once: on NCCL the GPU still runs the
    collective whose peer is gone and never finishes it, so each later wait on it (releasing the
    CUDA graphs, destroying the process group) would hang. Whichever thread comes second waits
    while the first one ends the process. Not recorded for torchrun: the rank that ended first
    (or the node lost) is its "Root Cause"."""
    if not _SAYING.acquire(blocking=False):
        threading.Event().wait()
    gone = rt.ranks_gone()  # a lost node's ranks and host, or a crashed rank's
    logging.getLogger("mgpu").error("%s", peer_gone_line(rt.rank, words, gone))
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)
