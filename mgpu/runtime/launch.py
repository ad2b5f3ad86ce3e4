"""The launch, as this process finds it: torchrun's and SLURM's environment (read here and nowhere
else), the checks that the launch can work as asked, the store and keys each torchrun attempt's
process group meets in (kept on loopback where it can be), this worker's share of the node's
CPUs, and the one-line report of a config that differs between ranks. Joining the process group
is mgpu.runtime.dist's; the run's name, mgpu.runtime.run_name's.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from functools import cache
from itertools import zip_longest

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
    run_id: str  # torchrun's --rdzv-id; without one, "none" (or a random UUID on one node)
    num_nodes: int
    restart_count: int = 0  # times torchrun restarted the workers of this launch (--max-restarts)
    max_restarts: int = 0  # torchrun's --max-restarts
    shared_store: bool = False  # the workers' store is the torchrun agent's own (torch's default)
    error_file: str = ""  # where torchrun reads why this worker failed (TORCHELASTIC_ERROR_FILE)
    launcher_says_errors: bool = False  # launch/torchrun.py ends with the recorded line itself
    # The store's MASTER_ADDR and MASTER_PORT that are missing (torchrun sets both; a launch of
    # its own that sets RANK and WORLD_SIZE must too)
    missing_store: tuple[str, ...] = ()


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
        restart_count=get("TORCHELASTIC_RESTART_COUNT", 0),
        max_restarts=get("TORCHELASTIC_MAX_RESTARTS", 0),
        shared_store=under_torchrun and env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        error_file=env.get("TORCHELASTIC_ERROR_FILE", "") if under_torchrun else "",
        launcher_says_errors=env.get("MGPU_LAUNCHER_SAYS_ERRORS") == "1",
        missing_store=tuple(
            k for k in ("MASTER_ADDR", "MASTER_PORT") if under_torchrun and k not in env
        ),
    )


@cache
def launch_env() -> LaunchEnv:
    """Read once per process: the environment torchrun gave this worker does not change."""
    return parse_launch_env(os.environ)


def check_sweep_launch(multirun: bool, env: LaunchEnv | None = None) -> None:
    """Refuse `hydra -m` under torchrun with several processes, before any work.

    Hydra runs a sweep's points one after another inside each process; torchrun's ranks would
    each make and tear down a process group per point and drift out of lockstep at the first
    point that fails on one rank only. One launch per point (launch/sweep.sh) has none of that.
    """
    env = env or launch_env()
    if multirun and env.under_torchrun and env.world_size > 1:
        raise LaunchError(
            f"hydra -m (multirun) cannot run under torchrun with {env.world_size} processes; "
            "start one launch per sweep point instead: launch/sweep.sh key=a,b [overrides ...]"
        )


def restart_hazard(env: LaunchEnv) -> str | None:
    """Why a torchrun restart of this launch may stop instead of resuming, or None.

    A restarted group meets under keys of its own attempt (attempt_prefix), named by torchrun's
    restart count. That count is each node's own: on several nodes sharing the agent's store it
    can differ between them (an agent restarted for a new node, not a failure, does not count),
    and the group then cannot meet; mgpu.runtime.dist stops it, saying so, rather than let it read
    an earlier attempt's addresses (pytorch#135712). With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    and the c10d rendezvous (launch/multi_node.sh), rank 0 hosts a new store for every attempt.
    """
    if env.max_restarts > 0 and env.shared_store and env.num_nodes > 1:
        return (
            "torchrun --max-restarts on several nodes with its store shared with the workers: a "
            "restart may stop (the nodes can count restarts differently, pytorch#135712); start "
            "torchrun with --rdzv-backend=c10d and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its "
            "environment, as launch/multi_node.sh does"
        )
    return None


# CUDA's hardware work queues per process: the driver's default is 8, the most it allows 32.
CUDA_CONNECTIONS = "CUDA_DEVICE_MAX_CONNECTIONS"
MAX_CUDA_CONNECTIONS = 32


def default_cuda_connections() -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=32 in this process unless its environment sets a value; called
    first by train.py, mgpu.evaluate and the benchmarks that train, before anything asks CUDA for
    a device (the driver reads it as it starts). The effect on several GPUs' communication
    overlap is not measured yet; on one GPU the synthetic ResNet-50 step was unchanged.

    Why: streams beyond the queues a process has share them, and work on one stream then waits
    behind work on another that it shares a queue with, though the two are independent. nvJPEG
    (data.decode=gpu) decodes through streams of its own with a host wait per image; sharing a
    queue with the training stream, each wait lasted until the step's queued kernels had run.
    Beside a loop of convolutions on one H100 the batched decode fell from ~9,000 images/s to
    ~1,400 with 8 queues, and kept ~8,000 with 32 (bench/README.md, "Real images").
    """
    if not os.environ.get(CUDA_CONNECTIONS, "").strip():  # unset or empty: the driver's 8
        os.environ[CUDA_CONNECTIONS] = str(MAX_CUDA_CONNECTIONS)


def cuda_connections_warning(environ: Mapping[str, str] | None = None) -> str | None:
    """What to tell a user whose environment gives CUDA fewer than 32 queues, or None."""
    environ = os.environ if environ is None else environ
    value = environ.get(CUDA_CONNECTIONS)
    if value is None or not value.strip().isdigit() or int(value) >= MAX_CUDA_CONNECTIONS:
        return None
    return (
        f"{CUDA_CONNECTIONS}={value} in the environment: the GPU's JPEG decode shares CUDA's "
        f"queues with the training step and waits behind it (ResNet-50 from JPEGs on one H100 "
        f"ran at 0.65 of its rate with 8 queues, 0.87 with 32); unset it to let mgpu use "
        f"{MAX_CUDA_CONNECTIONS}"
    )


def check_launch(backend: str, env: LaunchEnv | None = None) -> str:
    """Resolve `dist.backend` and fail before any work if the launch cannot run; returns it."""
    env = env or launch_env()
    if env.missing_store:
        raise LaunchError(
            f"RANK and WORLD_SIZE are set, so this process is one of {env.world_size}, but "
            f"{' and '.join(env.missing_store)} not: start the processes with torchrun "
            "(torchrun --nproc_per_node=N train.py), or set MASTER_ADDR and MASTER_PORT to rank "
            "0's host and a free port on it"
        )
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
    cores = len(os.sched_getaffinity(0))
    if not cuda and env.local_world_size > cores and env.local_rank == 0:  # said once a node
        log.warning(
            "%d processes on this node share its %d CPU cores (no GPU): each trains on a "
            "fraction of a core, and each with its DataLoader workers holds its own memory; "
            "torchrun --nproc_per_node=%d gives each a core", env.local_world_size, cores, cores,
        )  # fmt: skip
    return backend


def attempt_prefix(env: LaunchEnv) -> str:
    """The keys this torchrun attempt's process group meets under, in launch_store's store.

    torchrun's agent keeps its store for the whole launch, across the restarts it makes, and
    its workers meet in it too: always under the static rendezvous (plain torchrun, without
    --standalone or --rdzv-backend), and under c10d unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1.
    Under one fixed prefix a restarted group would read the attempt before's keys: gloo dials a
    dead worker's address, or both sides of a pair wait for the other to call until
    dist.timeout_s; NCCL takes an old unique id (pytorch#135712). So there each attempt meets
    under a prefix of its own, named by torchrun's restart count (a count per node: see
    restart_hazard). Rank 0's own store is new with every attempt and needs no such prefix."""
    return f"mgpu/attempt-{env.restart_count}" if env.shared_store else "mgpu"


def launch_store(env: LaunchEnv, timeout_s: float) -> tdist.Store:
    """The key-value store the workers of this attempt meet in (MASTER_ADDR:MASTER_PORT).

    The torchrun agent's own when it shares it (TORCHELASTIC_USE_AGENT_STORE, torch's default),
    else one that rank 0 hosts: bound to MASTER_ADDR alone when that is a loopback address
    (loopback_store), on every interface otherwise, as torch's env:// would. Nothing here waits
    for the other ranks: joining does (mgpu.runtime.dist), for a bounded time, naming who did not
    come. A rank that cannot reach the store fails after `timeout_s`."""
    timeout = timedelta(seconds=timeout_s)
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if env.shared_store:
        return tdist.TCPStore(host, port, is_master=False, timeout=timeout, wait_for_workers=False)
    store = loopback_store(env, timeout_s)
    if store is not None:
        return store
    return tdist.TCPStore(
        host,
        port,
        env.world_size,
        is_master=env.rank == 0,
        timeout=timeout,
        wait_for_workers=False,
        multi_tenant=True,
    )


def loopback_store(env: LaunchEnv, timeout_s: float) -> tdist.TCPStore | None:
    """Rank 0's store for a run kept on loopback (a client of it on the other ranks), or None.

    A loopback MASTER_ADDR (launch/single_node.sh asks for 127.0.0.1) puts every rank on this
    machine. Left to torch, rank 0's store would listen on every interface whatever MASTER_ADDR
    says, and gloo on the address of the host's name; here rank 0 binds the store's socket to
    MASTER_ADDR itself, and gloo and NCCL are pointed at the loopback interface, so that nothing
    of the run listens where another machine could reach it.
    """
    addr = os.environ.get("MASTER_ADDR", "")
    try:
        loopback = ipaddress.ip_address(addr).is_loopback
    except ValueError:  # a host name, which may stand for any interface
        loopback = False
    # With the torchrun agent's store shared (TORCH_DISABLE_SHARE_RDZV_TCP_STORE unset), no
    # worker starts one: the agent has bound it already.
    if not env.under_torchrun or env.shared_store or not loopback:
        return None
    names = {name for _, name in socket.if_nameindex()}
    lo = next((name for name in ("lo", "lo0") if name in names), None)
    if lo is not None:
        # Over any inherited value: one meant for multi-node runs would expose this one.
        os.environ["GLOO_SOCKET_IFNAME"] = lo
        os.environ["NCCL_SOCKET_IFNAME"] = f"={lo}"  # "=": this name exactly, not a prefix
    port = int(os.environ["MASTER_PORT"])
    listen_fd = None
    if env.rank == 0:
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((addr, port))
        listen_fd = sock.detach()  # the store's server owns it from here on
    return tdist.TCPStore(
        addr,
        port,
        env.world_size,
        is_master=env.rank == 0,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
        master_listen_fd=listen_fd,
    )


def _keyed_lines(text: str) -> list[str]:
    """YAML lines prefixed with their parent keys (`trainer.seed: 1`), to name a difference."""
    out: list[str] = []
    parents: list[tuple[int, str]] = []
    for line in text.splitlines():
        body = line.strip()
        indent = len(line) - len(line.lstrip(" "))
        # A YAML list's items sit at their key's own indent, so `- x` keeps that key as a parent.
        parents = [
            (i, k) for i, k in parents if i < indent or (i == indent and body.startswith("- "))
        ]
        out.append(".".join([k for _, k in parents] + [body]))
        if body.endswith(":"):
            parents.append((indent, body[:-1]))
    return out


def describe_config_mismatch(texts: list[str]) -> str:
    """One line naming the ranks whose text differs from rank 0's, and the first difference."""
    differ = [r for r, t in enumerate(texts) if t != texts[0]]
    if not differ:
        return ""
    first = differ[0]
    for mine, theirs in zip_longest(
        _keyed_lines(texts[0]), _keyed_lines(texts[first]), fillvalue="(nothing)"
    ):
        if mine != theirs:
            break
    shown = ", ".join(map(str, differ[:8])) + (", ..." if len(differ) > 8 else "")
    return (
        f"config differs between ranks: rank {first} has {theirs!r} where rank 0 has {mine!r} "
        f"(ranks that differ from rank 0: {shown}). Every rank must resolve the same config and "
        "run directory: look for a value that differs per rank or node (${oc.env:...}, RUN_ID, "
        "hydra.run.dir) or another checkout of conf/ on some node"
    )


def pin_host_cpus(local_rank: int, local_world_size: int) -> list[int]:
    """Confine this worker (and the DataLoader workers it forks later) to its own share of the
    CPUs it may use: the local ranks split them into equal contiguous blocks.

    Why: a launch-bound model (many small kernels, e.g. ResNet-50 in eager mode) is paced by
    its slowest rank's host thread once the ranks meet every step. Unpinned, eight workers'
    launch threads, NCCL proxy threads and loader workers migrate across every core. Returns
    the CPUs kept; raises where there are fewer CPUs than local workers.
    """
    allowed = sorted(os.sched_getaffinity(0))
    share = len(allowed) // local_world_size
    if share == 0:
        raise ValueError(
            f"dist.cpu_affinity=true: {len(allowed)} CPUs for {local_world_size} workers on this "
            "node; set dist.cpu_affinity=false"
        )
    mine = allowed[local_rank * share : (local_rank + 1) * share]
    os.sched_setaffinity(0, mine)
    return mine
