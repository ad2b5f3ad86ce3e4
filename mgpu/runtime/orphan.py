"""A torchrun worker does not outlive its agent. torchrun starts each worker in a session of its
own, so a SIGKILL of the agent (or of its process group, as `kill -9 -PGID` or a job scheduler's
hard kill does) reaches no worker: they went on training as orphans, saving checkpoints into a
run directory that a relaunch then shared with them.

Two mechanisms, set up first thing in train.py (it imports nothing heavy, so the window before
they hold is a fraction of a second): on Linux the kernel sends the worker SIGKILL when its
parent dies (prctl PR_SET_PDEATHSIG), and on every platform a daemon thread checks every
CHECK_EVERY_S seconds whether the parent pid changed (the worker was re-parented): the backstop
where prctl is missing. SIGKILL, not SIGTERM: with the agent gone nobody restarts the workers or
reads their exit codes, and SIGTERM would start a preemption save that a relaunch, free to start
once rank 0 is gone, could race. Checkpoint saves are atomic, so a killed save leaves the
previous checkpoint the newest. Only under torchrun: a plain `python train.py` started from a
shell that exits (nohup, `&`) keeps running. That test reads torchrun's environment here, not
through mgpu.runtime.launch (whose job it is), because mgpu.runtime.launch imports torch, which
takes seconds.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# The pid of the torchrun worker that armed the ties, inherited by the processes it starts
WORKER_PID = "MGPU_WORKER_PID"
CHECK_EVERY_S = 2.0


def _set_parent_death_signal() -> bool:
    """Whether the kernel will SIGKILL this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc to load, or no prctl in it
        return False


def _end(parent: int) -> None:
    log.error(
        "the torchrun agent (pid %d) that started this worker is gone; ending it (SIGKILL)", parent
    )
    for handler in logging.getLogger().handlers:
        handler.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(parent: int) -> None:
    while True:
        time.sleep(CHECK_EVERY_S)
        if os.getppid() != parent:  # re-parented: to init, or to a subreaper
            _end(parent)


def end_with_agent(environ: dict[str, str] | None = None) -> str | None:
    """Under torchrun, make this worker end when its agent dies; returns how ("prctl" or
    "parent watch"), or None outside torchrun."""
    environ = os.environ if environ is None else environ
    if "TORCHELASTIC_RUN_ID" not in environ:  # set by torchrun's agent for its workers only
        return None
    if environ.setdefault(WORKER_PID, str(os.getpid())) != str(os.getpid()):
        # A process the worker started that runs train.py's top level again (a DataLoader
        # worker imports it as __mp_main__): its parent is the worker, not the agent, and a
        # watch thread would make the DataLoader fork server a threaded process.
        return None
    parent = os.getppid()
    how = "prctl" if _set_parent_death_signal() else "parent watch"
    if os.getppid() != parent:  # it died before the signal was armed
        _end(parent)
    threading.Thread(target=_watch, args=(parent,), name="mgpu-parent-watch", daemon=True).start()
    return how
