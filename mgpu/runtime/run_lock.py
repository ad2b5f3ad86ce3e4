"""One run directory, one run: rank 0 holds an exclusive lock on `<run dir>/run.lock` for as long
as its process lives, and a launch that finds the lock held stops before any work (exit code 2),
naming the directory, the holder and the fix.

Why a POSIX record lock (fcntl F_SETLK, what `fcntl.lockf` takes): it belongs to the process that
took it, not to the open file, so the kernel drops it when that process ends however it ends
(exit, crash, SIGKILL, the OOM killer), and no process forked from it ever holds it. flock(2),
used before, belongs to the open file, which a fork shares: a DataLoader worker that hung in
CPython's post-fork code (before any at-fork hook could close its copy) lived on as an orphan
after its trainer died and kept the lock, and every relaunch was refused naming a dead pid.
After a torchrun restart (`--max-restarts`), whose agent ends the old workers before it starts
new ones, the new rank 0 takes the lock again. The file stays behind; it is never removed,
since a process waiting on a removed file would lock a different file than the next one to
create it. Its text only names the last holder.

The hazard of record locks: closing ANY descriptor of the file drops this process's lock on it,
whichever descriptor took it. So this process opens run.lock once, through acquire(), and a
second acquire() of a directory it already holds is refused without opening the file again.

Held by global rank 0 alone, not by every node's local rank 0: all ranks of a run resolve one run
directory (mgpu.runtime.dist.check_same_config), and one holder per run means the lock never has to
tell this run's processes from another's. On a filesystem shared between nodes, whether a launch
on another node sees the lock is the filesystem's business: NFS keeps record locks on the server
(NLM for v3, the protocol itself for v4), so every client sees them unless mounted with
`local_lock=posix` or `nolock`; a lock whose node crashed (not just its process) is freed when
the server's lease for that client expires (NFSv4: about 90 s). Lustre shares them only when
mounted with `-o flock` (`localflock` keeps them per node). Where the filesystem refuses locks,
the run goes on unguarded, with a warning.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mgpu.runtime.dist import RunStopped, Runtime, all_flags, broadcast_object, waiting

log = logging.getLogger(__name__)

LOCK_FILE = "run.lock"

# How long a restarted rank 0 waits for the attempt before it to let go. torchrun ends the old
# workers before it starts new ones, so the lock is free at once; a process still exiting (a
# dead worker's memory being released, a slow filesystem) gets this long.
RESTART_WAIT_S = 30.0

# The run directories whose lock this process holds, and the descriptor that holds each.
_held: dict[Path, int] = {}


class RunDirInUse(RunStopped):
    """Another launch holds the run directory's lock; said once, by rank 0, on every rank's exit."""

    exit_code = 2


class RunDirNotShared(RunStopped):
    """Some ranks' run directory is not rank 0's (nodes without a shared filesystem, or started
    in other working directories): every save would fail, as a checkpoint holds every rank's
    files in one directory."""

    exit_code = 2


# How long a rank looks for rank 0's lock file before it counts as unseen: a shared filesystem
# may show another node's new file a moment late.
SHARED_WAIT_S = 5.0


def _holder(fd: int) -> str:
    text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    return text or "holder unknown: it has not written its name yet"


def _refusal(run_dir: Path, holder: str, waited: float) -> str:
    where = f"run directory {run_dir.resolve()} is in use by another launch ({holder})"
    if waited:
        where += f", still after {waited:g} s of waiting for the attempt before this restart"
    return (
        f"{where}: wait until it ends (or stop it), or give this launch a directory of its own "
        "(RUN_ID=NAME, --rdzv-id=NAME or hydra.run.dir=PATH)"
    )


def acquire(run_dir: Path, wait_s: float = 0.0) -> int | None:
    """The run directory's lock, taken by this process: the lock file's descriptor, kept open
    while the run lives (release() lets go sooner). None where the filesystem refuses locks.
    Raises RunDirInUse, naming the holder, when another process keeps it for `wait_s`."""
    path = (Path(run_dir) / LOCK_FILE).resolve()
    start = time.monotonic()
    while path in _held:  # opening it again and closing that copy would drop the lock (above)
        if time.monotonic() - start >= wait_s:
            raise RunDirInUse(_refusal(run_dir, _holder(_held[path]), wait_s))
        time.sleep(0.2)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the whole file, from offset 0
            break
        except OSError as err:
            if err.errno not in (errno.EACCES, errno.EAGAIN):  # ENOLCK, ENOSYS, EOPNOTSUPP
                os.close(fd)
                log.warning(
                    "%s: the filesystem refuses file locks (%s), so a second launch on this "
                    "run directory would not be stopped; make sure none runs",
                    path, errno.errorcode.get(err.errno, err),
                )  # fmt: skip
                return None
            if time.monotonic() - start >= wait_s:  # held by another process
                holder = _holder(fd)
                os.close(fd)
                raise RunDirInUse(_refusal(run_dir, holder, wait_s)) from None
            time.sleep(0.2)
    waited = time.monotonic() - start
    if waited > 0.5:
        log.info("took %s after %.1f s (the attempt before this restart let go)", path, waited)
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    holder = f"rank 0 on host {socket.gethostname()}, pid {os.getpid()}, since {since}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{holder}\n".encode(), 0)
    _held[path] = fd
    return fd


def release(fd: int | None) -> None:
    for path, held in list(_held.items()):
        if held == fd:
            del _held[path]
            os.close(fd)  # closing a descriptor of the file drops this process's lock on it


def leave_logs_of(run_dir: Path) -> None:
    """Close this process's log files inside `run_dir`. Hydra opened them (`rank<N>.log`, in
    append mode) before the lock was asked for; a launch refused the directory must leave the
    running launch's logs as they are, so its own lines go to the console only."""
    root, inside = logging.getLogger(), run_dir.resolve()
    for handler in list(root.handlers):
        if not isinstance(handler, logging.FileHandler):
            continue
        # both resolved: the directory may be reached through a symbolic link
        if inside in Path(handler.baseFilename).resolve().parents:
            root.removeHandler(handler)
            handler.close()


@contextmanager
def hold_run_dir(run_dir: Path, rt: Runtime, peer_timeout_s: float) -> Iterator[None]:
    """Inside: this launch alone uses `run_dir` (rank 0 holds its lock). A collective, before
    any other work on the directory: where another launch holds it, every rank stops with
    RunDirInUse (exit code 2), which rank 0 says in one line. `peer_timeout_s` (dist.timeout_s)
    bounds how long the other ranks wait for that answer, so rank 0's wait for a restarted
    attempt's lock stays well inside it."""
    fd, refusal = None, None
    try:
        if rt.is_primary:
            wait_s = min(RESTART_WAIT_S, peer_timeout_s / 2) if rt.restart_count > 0 else 0.0
            try:
                fd = acquire(run_dir, wait_s)
            except RunDirInUse as err:
                refusal = str(err)
        holder = _holder(fd) if fd is not None else None  # None: the filesystem has no locks
        with waiting(rt.rank, "the check that no other launch uses the run directory"):
            refusal, holder = broadcast_object((refusal, holder), rt)
        if refusal is not None:
            leave_logs_of(run_dir)  # the refusal is said on the console, not in the run's logs
            raise RunDirInUse(refusal)
        if holder is not None:
            check_shared(run_dir, holder, rt)
        yield
    finally:
        release(fd)


def check_shared(run_dir: Path, holder: str, rt: Runtime) -> None:
    """Every rank sees, in its `run_dir`, the lock file rank 0 holds with rank 0's name in it:
    one directory for the whole run. A collective. Ranks whose directory is another (a node
    without the shared filesystem; a relative run directory from another working directory)
    would fail every save, and a run that saves nothing trains on: every rank stops instead,
    RunDirNotShared naming them."""
    path, deadline = Path(run_dir) / LOCK_FILE, time.monotonic() + SHARED_WAIT_S
    # Rank 0 holds the lock: it must not open the file again, since closing any descriptor of it
    # would drop its own lock (the hazard above).
    seen = rt.is_primary
    while not seen:
        try:
            seen = path.read_text(errors="replace").strip() == holder
        except OSError:
            seen = False
        if seen or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    with waiting(rt.rank, "the check that every rank sees the run directory"):
        unseen = [rank for rank, ok in enumerate(all_flags(seen, rt)) if not ok]
    if unseen:
        raise RunDirNotShared(
            f"rank(s) {', '.join(map(str, unseen))} do not see rank 0's run directory "
            f"{Path(run_dir).resolve()} (its {LOCK_FILE}, which names {holder}): every rank "
            "writes its part of each checkpoint there, so every node must reach that directory "
            "by the same path, on a shared filesystem, and start in the same working directory "
            "(or give hydra.run.dir as an absolute path)"
        )
