"""Side channels through the launch's key-value store (torchrun's MASTER_ADDR:MASTER_PORT), which
work when a collective does not: a client of the store for hang reports, and which ranks are gone
after a peer's process ended under a collective."""

from __future__ import annotations

import logging
import os
import socket
import time
from datetime import timedelta
from typing import Protocol

import torch.distributed as tdist

from mgpu.runtime.launch import attempt_prefix, launch_env

log = logging.getLogger(__name__)


class Place(Protocol):  # what store_client needs of mgpu.runtime.dist.Runtime
    distributed: bool


def store_client(rt: Place, timeout_s: float) -> tdist.Store | None:
    """A new client of this launch's key-value store (torchrun's MASTER_ADDR:MASTER_PORT), for
    side channels such as hang reports; None without a process group or if it is unreachable.
    A short timeout: a report must not wait long on a store whose host is gone."""
    if not rt.distributed:
        return None
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port:
        return None
    try:
        return connect(host, int(port), timeout_s)
    except Exception as err:  # noqa: BLE001 - the side channel is lost, nothing else
        log.warning("the launch's store at %s:%s is unreachable: %s", host, port, err)
        return None


def connect(host: str, port: int, timeout_s: float) -> tdist.TCPStore:
    """A client of the store at host:port; OSError at once where nothing accepts a connection
    there (a lost node's store: refused, or no answer within `timeout_s`). torch's client
    retries a refused connection until its timeout, then some more, printing a C++ stack trace
    for each try: 10-20 s and some 40 lines on a console for a store known to be gone."""
    with socket.create_connection((host, port), timeout=timeout_s):
        pass  # the store's host accepts connections: its own client's handshake follows
    return tdist.TCPStore(
        host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


# How long a rank whose peer's process ended waits for the other survivors to say they are there:
# on NCCL some learn it only from the first one's check-in, through their watchdog thread, which
# looks at the store every 2 s (mgpu.train.watchdog).
GONE_WAIT_S = 5.0


def ranks_gone(rank: int, world_size: int, wait_s: float = GONE_WAIT_S) -> str:
    """The ranks whose processes are gone and their hosts, after a collective failed because a
    peer's process ended: a lost node's ranks, or a crashed rank. Each rank that meets the failure
    checks in under this attempt's keys in the launch's store and waits `wait_s` for the others;
    the ranks that did not come are named with the host and pid they joined from. A store that no
    longer answers was hosted on rank 0's node (by rank 0, or by that node's torchrun agent), so
    that node is the one named. For a stop's line only: costs up to `wait_s`, never raises."""
    host = os.environ.get("MASTER_ADDR", "")
    try:
        client = connect(host, int(os.environ.get("MASTER_PORT", "0")), wait_s)
        store = tdist.PrefixStore(attempt_prefix(launch_env()), client)
        store.set(GONE_KEY, str(rank))  # first: the survivors that saw nothing learn it here
        store.set(f"gone/here/{rank}", "1")
        deadline = time.monotonic() + wait_s
        here = [f"gone/here/{r}" for r in range(world_size)]
        while time.monotonic() < deadline and not store.check(here):
            time.sleep(0.1)
        missing = [r for r, key in enumerate(here) if not store.check([key])]
        joined = {r: store.get(f"join/{r}").decode() for r in missing}  # "host pid N"
        store.set(f"gone/read/{rank}", "1")
        if rank == 0:  # the store's host, unless an agent is: kept until the others have read
            read = [f"gone/read/{r}" for r in range(world_size) if r not in missing]
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and not store.check(read):
                time.sleep(0.1)
    except Exception:  # noqa: BLE001 - the store's host is gone, or never was reachable
        return f"rank 0's node ({host}, the launch's store) is gone: its store does not answer"
    if not missing:
        return "no rank is gone (each answered)"
    by_host: dict[str, list[str]] = {}
    for r in missing:
        name, _, pid = joined[r].partition(" pid ")
        by_host.setdefault(name, []).append(f"{r} (pid {pid})")
    parts = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)} on {name}"
        for name, ranks in by_host.items()
    ]
    return f"gone: {'; '.join(parts)} (no answer within {wait_s:g} s)"


def nccl_lost_peer(device) -> bool | None:
    """Whether this process's NCCL communicator failed (a peer's process ended, its link broke:
    torch's ErrorType COMM_ERROR, or REMOTE_ERROR where torch propagates another rank's). None
    where the backend cannot say (not NCCL, or a torch without ProcessGroupNCCL.get_error). A
    host does not wait inside an NCCL collective, so no exception reaches the training thread;
    torch's own NCCL watchdog sees the error at once but ends the process only after its
    debug-dump wait (four times TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC, a minute by default),
    without a word: mgpu.train.watchdog asks here every couple of seconds and stops the rank
    with its one line. A timed-out collective (TIMEOUT) is the hang report's, not this.
    Thread-safe: torch guards the backend's error state."""
    if not tdist.is_initialized() or tdist.get_backend() != "nccl":
        return None
    # The backend object of the default group: torch's public ProcessGroup does not say it.
    backend = tdist.group.WORLD._get_backend(device)
    get_error = getattr(backend, "get_error", None)
    if get_error is None:
        return None
    return get_error().name in ("COMM_ERROR", "REMOTE_ERROR")  # c10d's ErrorType


GONE_KEY = "gone/by"  # set by the first rank of an attempt that checks in after a lost peer


def loss_told(store: tdist.Store, rank: int) -> bool:
    """Whether another rank of this attempt checked in after losing a peer (ranks_gone): on NCCL
    a rank whose own collectives did not touch the lost one sees no error of its own. Never
    raises: a store that does not answer tells nothing here (the stall clock still runs)."""
    try:
        store = tdist.PrefixStore(attempt_prefix(launch_env()), store)
        return store.check([GONE_KEY]) and store.get(GONE_KEY).decode() != str(rank)
    except Exception:  # noqa: BLE001
        return False
