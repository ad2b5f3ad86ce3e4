"""The process's place in the run and the process group's lifetime: the pinned device, joining
and leaving the group, the few collectives start-up and checkpoints use, the check that all
ranks resolved the same config. What the launch environment says is mgpu.runtime.launch's, the
stops said in one line with an exit code are mgpu.runtime.stops', and how the process ends (the
teardown rule) is mgpu.runtime.ending's (the names of all three are importable from here too).
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as tdist

from mgpu.runtime.ending import end_process, exit_process  # noqa: F401 - re-exported
from mgpu.runtime.launch import (  # noqa: F401 - re-exported: mgpu.runtime.dist was their home
    LaunchEnv,
    LaunchError,
    attempt_prefix,
    check_launch,
    check_sweep_launch,
    describe_config_mismatch,
    launch_env,
    launch_store,
    loopback_store,
    parse_launch_env,
    pin_host_cpus,
    restart_hazard,
)
from mgpu.runtime.peers import ranks_gone, store_client  # noqa: F401 - store_client's home was here
from mgpu.runtime.run_name import launch_run_name  # noqa: F401 - re-exported
from mgpu.runtime.stops import (  # noqa: F401 - re-exported: mgpu.runtime.dist was their home
    BAD_INPUT,
    PeerTimeout,
    RunStopped,
    first_line,
    is_timeout,
    peer_gone,
    stopped,
    waiting,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    """What the rest of mgpu needs to know about this process's place in the run."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    has_process_group: bool
    restart_count: int = 0  # torchrun's restarts of this launch; > 0: an earlier attempt failed
    local_world_size: int = 1  # training processes on this node (they share its CPUs)
    # This process's share of the node's CPUs, counted before dist.cpu_affinity pinned it to
    # that share (0: not counted; see cpu_share)
    cpus: int = 0

    @property
    def cpu_share(self) -> int:
        """CPUs per training process on this node: for sizing DataLoader worker pools."""
        return self.cpus or len(os.sched_getaffinity(0)) // max(1, self.local_world_size)

    @property
    def collective_device(self) -> torch.device:
        """Where the tensors of a collective of host values (flags, digests, shares) live: NCCL
        reduces only device tensors, gloo host ones."""
        return self.device if self.backend == "nccl" else torch.device("cpu")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        """Whether there are other ranks to communicate with (a process group of two or more)."""
        return self.has_process_group and self.world_size > 1

    def ranks_gone(self) -> str:
        """Which ranks' processes are gone, said after a collective failed because one ended
        (mgpu.runtime.stops.stopped; mgpu.runtime.peers.ranks_gone); "" without a process group."""
        return ranks_gone(self.rank, self.world_size) if self.distributed else ""


# Called before the process group is destroyed (release_before_leaving).
_leave_first: list[weakref.WeakMethod] = []


def release_before_leaving(method: Callable[[], None]) -> None:
    """Have the bound `method` called when this process leaves its process group, before the
    group is destroyed, whatever ended the run; its object is not kept alive by this.

    Why: a CUDA graph that recorded NCCL collectives holds a reference on their communicator
    until the graph itself is destroyed, and NCCL's communicator teardown waits for those
    references to go, so destroy_process_group with such a graph still alive never returns (a
    finished run hung at its end). mgpu.train.graphs releases its captures here."""
    _leave_first.append(weakref.WeakMethod(method))


def _release_first() -> None:
    while _leave_first:
        method = _leave_first.pop()()
        if method is not None:
            method()


@contextmanager
def distributed(backend: str, timeout_s: float, cpu_affinity: bool = False) -> Iterator[Runtime]:
    """Pin this worker's device (and with `cpu_affinity` its share of the CPUs), join the
    process group, and always leave it again.

    Everything that runs inside this context sees `cuda:<local_rank>` as the current device, so
    no tensor or CUDA context can land on another rank's GPU by default.
    """
    env = launch_env()
    backend = check_launch(backend, env)
    share = len(os.sched_getaffinity(0)) // max(1, env.local_world_size)  # before any pinning
    if cpu_affinity:
        # Before CUDA, NCCL and DataLoader workers start threads: they inherit the mask.
        pin_host_cpus(env.local_rank, env.local_world_size)
        cpus = sorted(os.sched_getaffinity(0))  # what the kernel now allows, not what we asked
        log.info("rank %d pinned to CPUs %d-%d", env.rank, cpus[0], cpus[-1])
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    with torch.cuda.device(device) if on_cuda else nullcontext():
        if env.under_torchrun:
            try:
                join_process_group(env, backend, timeout_s, device)
            except RunStopped as err:  # before stopped() can say it: one line, no traceback
                log.error("%s", err.report())
                raise SystemExit(err.exit_code) from None
        hazard = restart_hazard(env)
        if hazard is not None and env.rank == 0:
            log.warning("%s", hazard)
        try:
            yield Runtime(
                rank=env.rank,
                local_rank=env.local_rank,
                world_size=env.world_size,
                backend=backend,
                device=device,
                has_process_group=env.under_torchrun,
                restart_count=env.restart_count,
                local_world_size=env.local_world_size,
                cpus=share,
            )
        finally:
            _release_first()  # CUDA graphs holding NCCL work, then the group (teardown rule)
            if tdist.is_initialized():
                tdist.destroy_process_group()


def join_process_group(
    env: LaunchEnv, backend: str, timeout_s: float, device: torch.device
) -> None:
    """Meet the other ranks of this torchrun attempt under its own keys (attempt_prefix), then
    start the process group there. Each wait is bounded by `timeout_s` and ends in one line
    (PeerTimeout) naming this rank and what it waited for."""
    what = f"the launch's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    try:
        store = tdist.PrefixStore(attempt_prefix(env), launch_store(env, timeout_s))
        _meet(store, env, timeout_s, what)
    except RunStopped:
        raise
    except RuntimeError as err:  # unreachable, or gone in the middle of the join
        raise PeerTimeout(
            f"rank {env.rank}: lost or never reached {what} within dist.timeout_s "
            f"({timeout_s:g} s), joining the process group: {first_line(err)}"
        ) from err
    # device_id binds the NCCL communicator to this GPU eagerly, so barriers and the first
    # collective cannot guess a device (which would touch GPU 0 from every rank).
    with waiting(env.rank, f"joining the process group ({backend} connecting every pair)"):
        tdist.init_process_group(
            backend=backend,
            timeout=timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,
            store=store,
            rank=env.rank,
            world_size=env.world_size,
        )


def _meet(store: tdist.Store, env: LaunchEnv, timeout_s: float, what: str) -> None:
    """Every rank of this attempt checks in under the attempt's keys and waits, at most
    `timeout_s`, for the others. Stops with one line naming the ranks that did not come, or,
    where this attempt's keys were used before, naming the launch's fix."""
    arrivals = store.add("join/arrivals", 1)
    store.set(f"join/{env.rank}", f"{socket.gethostname()} pid {os.getpid()}")
    if arrivals > env.world_size:
        # One process per rank and attempt: more arrivals than ranks are an earlier attempt's,
        # whose restart count this node shares (restart_hazard says when that happens).
        raise PeerTimeout(
            f"rank {env.rank}: torchrun restart {env.restart_count} of this node finds an "
            f"earlier attempt's process-group keys in {what} (the nodes count restarts "
            "differently, pytorch#135712); start torchrun with --rdzv-backend=c10d and "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment, as launch/multi_node.sh does"
        )
    keys = [f"join/{rank}" for rank in range(env.world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as err:
        if "timeout" not in str(err).lower():  # "wait timeout after ...ms"; else: store gone
            raise
        missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return  # the last came as the wait ended
        shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
        raise PeerTimeout(
            f"rank {env.rank}: waited {timeout_s:g} s (dist.timeout_s) for rank {shown} to join "
            f"the process group ({what}, torchrun restart {env.restart_count}): it did not "
            "start, died before joining, or reached another store (its log says which)"
        ) from err


# One tensor gathered from every rank into one, and one summed (or averaged) across ranks and
# scattered in equal parts: newer torch names them all_gather_single and reduce_scatter_single
# and deprecates all_gather_into_tensor and reduce_scatter_tensor, the only names torch 2.10 and
# 2.11 have (the GPU machines' torch: a call under the newer names fails there).
all_gather_single = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor
reduce_scatter_single = getattr(tdist, "reduce_scatter_single", None) or tdist.reduce_scatter_tensor


def all_reduce_sum_(tensor: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """In-place sum over ranks. Every rank must call it at the same point: it is a collective."""
    if rt.distributed:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor


def all_reduce_min_(tensor: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """In-place minimum over ranks. A collective, as all_reduce_sum_."""
    if rt.distributed:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.MIN)
    return tensor


def all_ok(ok: bool, rt: Runtime) -> bool:
    """True on every rank if `ok` is True on every rank. A collective and a barrier: every rank
    must call it at the same point; a CPU-GPU sync point on NCCL (checkpoints and start-up)."""
    if not rt.distributed:
        return ok
    flag = torch.tensor([int(ok)], device=rt.collective_device)
    tdist.all_reduce(flag, op=tdist.ReduceOp.MIN)
    return bool(flag.item())


def all_flags(flag: bool, rt: Runtime) -> list[bool]:
    """Every rank's `flag`, in rank order; a collective (and a sync point on NCCL), for
    start-up checks that name the ranks that failed them."""
    if not rt.distributed:
        return [flag]
    mine = torch.tensor([int(flag)], device=rt.collective_device)
    flags = [torch.empty_like(mine) for _ in range(rt.world_size)]
    tdist.all_gather(flags, mine)
    return [bool(f.item()) for f in flags]


def broadcast_object(obj: object, rt: Runtime) -> object:
    """Rank 0's `obj` (picklable) on every rank; a collective, for start-up decisions only."""
    if not rt.distributed:
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


def _shown_dir(run_dir: Path) -> str:
    """The run directory as ranks can compare it: relative to the working directory when inside
    it, since nodes may mount one shared directory at different absolute paths."""
    run_dir = Path(run_dir).resolve()
    cwd = Path.cwd().resolve()
    return str(run_dir.relative_to(cwd)) if run_dir.is_relative_to(cwd) else str(run_dir)


class ConfigsDiffer(RunStopped):
    """Some ranks resolved another config (or run directory) than rank 0: a config error."""

    exit_code = 2


def check_same_config(text: str, rt: Runtime, run_dir: Path | None = None) -> None:
    """Stop every rank, with one message naming the ranks that differ, unless all ranks resolved
    the same config text (and run directory) as rank 0.

    A collective: every rank must call it at the same point, before any other collective. Every
    rank raises ConfigsDiffer (exit 2), which stopped() has rank 0 say, once.
    """
    if run_dir is not None:
        text = f"{text}run_dir: {_shown_dir(run_dir)}\n"
    if not rt.distributed:
        return
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    mine = torch.tensor(
        [int.from_bytes(digest, "little", signed=True)], device=rt.collective_device
    )
    digests = [torch.empty_like(mine) for _ in range(rt.world_size)]
    with waiting(rt.rank, "the first collective (the check that every rank has one config)"):
        tdist.all_gather(digests, mine)
    # A CPU-GPU sync point, once at start-up. All ranks see the same digests, so all of them
    # take the same branch: either every rank gathers the texts below, or none does.
    if len({int(d.item()) for d in digests}) == 1:
        return
    texts: list[str] = [""] * rt.world_size
    tdist.all_gather_object(texts, text)
    raise ConfigsDiffer(describe_config_mismatch(texts))


def quiet_other_ranks(rt: Runtime) -> None:
    """Only rank 0 talks on the console; every rank keeps its full log file."""
    if not rt.is_primary:
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:
                handler.setLevel(logging.WARNING)
