"""The process's place in the run: torchrun's environment (read here only), the pinned device, and
the process group's lifetime; also the run name that every rank of one launch agrees on.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from functools import cache

import torch
import torch.distributed as tdist

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The launch cannot work as asked (too many processes for the GPUs, nccl without CUDA)."""


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    under_torchrun: bool  # False for `python train.py`: a world of one with no process group
    run_id: str  # torchrun's --rdzv-id ("none" unless given or --standalone)
    num_nodes: int


def parse_launch_env(env: Mapping[str, str]) -> LaunchEnv:
    """torchrun's variables, or a world of one when they are absent."""
    under_torchrun = "RANK" in env and "WORLD_SIZE" in env
    get = (lambda k, d: int(env.get(k, d))) if under_torchrun else (lambda k, d: d)
    world_size = get("WORLD_SIZE", 1)
    return LaunchEnv(
        rank=get("RANK", 0),
        local_rank=get("LOCAL_RANK", 0),
        world_size=world_size,
        local_world_size=get("LOCAL_WORLD_SIZE", world_size),
        under_torchrun=under_torchrun,
        run_id=env.get("TORCHELASTIC_RUN_ID", "none"),
        num_nodes=get("GROUP_WORLD_SIZE", 1),
    )


@cache
def launch_env() -> LaunchEnv:
    """Read once per process: the environment torchrun gave this worker does not change."""
    return parse_launch_env(os.environ)


def _process_start_time(pid: int) -> float | None:
    """Wall-clock start of a process from /proc (Linux), or None where /proc is absent."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name may hold spaces and parentheses: fields resume after the last ')'.
            after_name = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    except (OSError, StopIteration, IndexError):
        return None
    start_ticks = int(after_name[19])  # field 22 of proc(5), counted from field 3
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def launch_run_name() -> str:
    """`outputs/<this>`: the same string on every rank of one launch and across its restarts.

    Each rank resolves the run directory on its own, so a clock read per process could split one
    run into several directories. Instead the name comes from the launch: the torchrun agent's
    start time (shared by all its workers, and unchanged when it restarts them), or, across
    several nodes, the rendezvous id that all their agents share.
    """
    env = launch_env()
    if env.num_nodes > 1 and env.run_id != "none":
        return env.run_id
    stamp = time.time()
    if env.under_torchrun:
        agent_start = _process_start_time(os.getppid())
        if agent_start is None:
            return time.strftime("%Y-%m-%d", time.localtime(stamp)) + f"/launch-{os.getppid()}"
        stamp = agent_start
    return time.strftime("%Y-%m-%d/%H-%M-%S", time.localtime(stamp))


def check_launch(backend: str, env: LaunchEnv | None = None) -> str:
    """Resolve `dist.backend` and fail before any work if the launch cannot run; returns it."""
    env = env or launch_env()
    cuda = torch.cuda.is_available()  # queries the driver; creates no context on any GPU
    if backend == "auto":
        backend = "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise LaunchError(
            "dist.backend='nccl' needs CUDA GPUs and none are visible; "
            "use dist.backend=gloo (or auto) on CPU"
        )
    if cuda and env.local_world_size > torch.cuda.device_count():
        n = torch.cuda.device_count()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise LaunchError(
            f"{env.local_world_size} processes on this node but {n} visible CUDA GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={visible}); start at most {n}: torchrun --nproc_per_node={n}"
        )
    return backend


@dataclass(frozen=True)
class Runtime:
    """What the rest of mgpu needs to know about this process's place in the run."""

    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    has_process_group: bool

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


@contextmanager
def distributed(backend: str, timeout_s: float) -> Iterator[Runtime]:
    """Pin this worker's device, join the process group, and always leave it again.

    Everything that runs inside this context sees `cuda:<local_rank>` as the current device, so
    no tensor or CUDA context can land on another rank's GPU by default.
    """
    env = launch_env()
    backend = check_launch(backend, env)
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda", env.local_rank) if on_cuda else torch.device("cpu")
    if on_cuda:
        torch.cuda.set_device(device)
    with torch.cuda.device(device) if on_cuda else nullcontext():
        if env.under_torchrun:
            # device_id binds the NCCL communicator to this GPU eagerly, so barriers and the
            # first collective cannot guess a device (which would touch GPU 0 from every rank).
            tdist.init_process_group(
                backend=backend,
                timeout=timedelta(seconds=timeout_s),
                device_id=device if backend == "nccl" else None,
            )
        try:
            yield Runtime(
                rank=env.rank,
                local_rank=env.local_rank,
                world_size=env.world_size,
                backend=backend,
                device=device,
                has_process_group=env.under_torchrun,
            )
        finally:
            if tdist.is_initialized():
                tdist.destroy_process_group()


def all_reduce_sum_(tensor: torch.Tensor, rt: Runtime) -> torch.Tensor:
    """In-place sum over ranks. Every rank must call it at the same point: it is a collective."""
    if rt.has_process_group and rt.world_size > 1:
        tdist.all_reduce(tensor, op=tdist.ReduceOp.SUM)
    return tensor
