"""Shared test helpers: run train.py the way users do (torchrun as a subprocess) and read back
what it wrote."""

import gc
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

# On a GPU machine each pytest-xdist worker runs its test files on a pair of GPUs
# (pytest_configure below names them, in the controller), as many workers as GPUs: two workers
# share each pair. Most GPU tests leave a GPU idle most of their time (starting processes,
# compiling), so two files on a pair end sooner than one after the other; no GPU test times
# anything against a fixed figure (those that compare runs compare runs of their own). Set
# before torch is imported, so that CUDA in this process only ever sees its pair.
_WORKER, _GPUS = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("MGPU_TEST_GPUS")
if _WORKER and _GPUS and len(_GPUS.split(",")) >= 2:
    _pair = int(_WORKER.removeprefix("gw")) % (len(_GPUS.split(",")) // 2)  # more workers: shared
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(_GPUS.split(",")[2 * _pair : 2 * _pair + 2])
    # nvidia-smi's numbering, which the IDs above and GPU tests' nvidia-smi queries use
    os.environ["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"

# No cyclic collection while this process imports torch and the test modules (as train.py
# does while a run starts): a sixth of collecting's CPU. pytest_collection turns it on.
gc.disable()
import torch  # noqa: E402

# On a CPU machine one thread for this process's own tensor work, as the processes the tests
# start have (OMP_NUM_THREADS=1 below, _run_then_exit): pytest's workers and the runs they start
# already take every core, and a thread per core more in each worker waits for them spinning
# (pytest_xdist_auto_num_workers says what it cost). GPU machines' cores outnumber the workers.
if not torch.cuda.is_available():
    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "train.py"

# Small and quick on 2 CPU cores: the default model and data, fewer steps, no worker processes.
FAST = [
    "trainer.max_steps=40",
    "trainer.log_every=10",
    "trainer.eval_every=20",
    "data.num_workers=0",
    "data.eval_samples=64",
]


def train_command(
    args,
    *,
    nproc: int | None = 2,
    env: dict | None = None,
    torchrun_args: tuple[str, ...] = (),
    program: tuple[str, ...] = (str(TRAIN),),
    rendezvous: tuple[str, ...] = ("--standalone",),
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that run_train runs, for a test that starts it with
    subprocess.Popen and acts while it runs."""
    launcher = [sys.executable]
    if nproc is not None:
        launcher += ["-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}"]
        launcher += torchrun_args
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    full_env.update(env or {})
    return [*launcher, *program, *args], full_env


def run_train(
    args,
    *,
    cwd: Path,
    nproc: int | None = 2,
    env: dict | None = None,
    timeout: float = 240,
    torchrun_args: tuple[str, ...] = (),
    program: tuple[str, ...] = (str(TRAIN),),
    rendezvous: tuple[str, ...] = ("--standalone",),
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node=N train.py args` (or plain `python train.py` for nproc=None);
    `program` runs another script or module instead, e.g. ("-m", "mgpu.evaluate");
    `rendezvous`: torchrun's flags for it, e.g. ("--master-port=PORT",) for its static one."""
    command, full_env = train_command(
        args,
        nproc=nproc,
        env=env,
        torchrun_args=torchrun_args,
        program=program,
        rendezvous=rendezvous,
    )
    return subprocess.run(
        command, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout
    )


def together(*runs: Callable[[], subprocess.CompletedProcess]) -> list:
    """Runs that do not depend on each other (a reference run and its faulty twin), started at
    once and awaited: on a GPU machine the slowest GPU tests are pairs of such runs, each mostly
    start-up and compiling. Their results in the order given."""
    with ThreadPoolExecutor(len(runs)) as pool:
        return [f.result() for f in [pool.submit(run) for run in runs]]


def made_once(tmp_path_factory, name: str, make: Callable[[Path], Path]) -> Path:
    """What `make(folder)` returns, made once for the whole test run however many pytest-xdist
    workers ask for it (a reference run that several files compare with): the first to ask makes
    it, holding a lock; the others wait for it and get the same path."""
    from filelock import FileLock  # torch's own dependency

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the folder that holds every worker's own
    made = root / f"{name}.made"
    with FileLock(root / f"{name}.lock"):
        if not made.exists():  # not yet, or the one that tried failed (and said why)
            folder = root / name
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            made.write_text(str(make(folder)))
    return Path(made.read_text())


def said_lines(proc) -> list[str]:
    """The run's own output lines (stdout, where mgpu's log lines are, and stderr), without
    torchrun's closing table, whose `traceback :` rows repeat each failed rank's recorded line
    (mgpu.runtime.stops.record_for_torchrun)."""
    lines = (proc.stdout + proc.stderr).splitlines()
    return [line for line in lines if not line.lstrip().startswith("traceback :")]


def said_by_train_py(args: list[str], cwd: Path) -> str:
    """The one line train.py's first step says for `args` in a run started in `cwd`
    (mgpu.run.cli.check_command_line, in this process): each mistake's words, without a launch.
    Tests that launch train.py check that a run says it alone, exits 2 and makes no run
    directory."""
    from omegaconf.errors import OmegaConfBaseException

    from mgpu.config.checks import ConfigError
    from mgpu.run.cli import check_command_line, config_error_line

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        with pytest.raises((ConfigError, OmegaConfBaseException)) as err:
            check_command_line(args)
    return config_error_line(err.value)


def one_line_under_torchrun(proc, run_dir, prefix: str = "mgpu: config error: ") -> str:
    """What bad input must give under torchrun: one line of mgpu's, said once (not once per
    rank), every worker's exit code 2, no traceback but torchrun's own summary (its
    ChildFailedError for any worker that did not exit 0, which mgpu cannot avoid), and no run
    directory if `run_dir` is given. Returns the line, found by `prefix`."""
    output = proc.stdout + proc.stderr  # mgpu's log lines are on stdout (Hydra's console)
    lines = [line for line in said_lines(proc) if prefix in line]
    assert len(lines) == 1, output
    assert proc.returncode == 1 and "ChildFailedError" in proc.stderr, output  # torchrun's
    assert output.count("Traceback") == 1, output  # torchrun's own only
    codes = set(re.findall(r"exitcode\s*:\s*(-?\d+)", proc.stderr))
    assert codes == {"2"}, proc.stderr
    assert run_dir is None or not run_dir.exists()
    return lines[0]


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in the run's TensorBoard event files: tag -> [(step, value), ...].

    The directory is read as TensorBoard reads it: event files in order, and a resumed run's
    purge_step drops what earlier files logged from that step on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def pytest_xdist_auto_num_workers(config) -> int:
    """pyproject's `-n auto`: one pytest worker per CPU this process may use and one more. A
    serial run kept about one of 2 CPUs busy (its processes start, wait for each other and time
    out one by one); one worker a CPU kept 1.52 of 2 busy (10:24), and a third worker, once
    every worker computes on one thread (the top of this file; before, its waiting threads spun
    and the third worker added a tenth to the suite's CPU), 1.69 with the same CPU (9:14). On a
    GPU machine one per GPU (none with fewer than 4), two on each pair of GPUs (the top of this
    file): one worker a pair left the 4-GPU suite at 8:17 for 56 of its 58 tests, its test time
    (~1,000 s) split over only two workers."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        return gpus if gpus >= 4 else 0
    return len(os.sched_getaffinity(0)) + 1


def pytest_configure(config) -> None:
    """In the controller of a GPU machine's run: the GPUs its workers share out, a pair each."""
    if _WORKER is None and "MGPU_TEST_GPUS" not in os.environ and torch.cuda.is_available():
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # as its workers number them
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else range(torch.cuda.device_count())
        os.environ["MGPU_TEST_GPUS"] = ",".join(map(str, ids))


# The files that take longest on 2 CPUs (25 s or more each), longest first, as a whole run
# of the suite measured them (each file's tests summed). pytest-xdist hands out whole files in
# collection order (pyproject: --dist loadfile, --no-loadscope-reorder): these go first, longest
# first, so that no long file starts last and runs alone while the other workers sit idle.
SLOW_FILES = [
    "test_resume.py",
    "test_image_folder.py",
    "test_two_nodes.py",
    "test_run_dir.py",
    "test_ctrl_c.py",
    "test_shard_resume.py",
    "test_launch.py",
    "test_after_training.py",
    "test_hang_report.py",
    "test_launch_lines.py",
    "test_one_line.py",
    "test_nonfinite.py",
    "test_tokenizer.py",
    "test_eval_starts.py",
    "test_rendezvous.py",
    "test_config.py",
]


# The same on a 4-GPU machine, where `pytest -m gpu` runs four workers: the GPU files of a
# minute or more (on 4 H200s), longest first, so that the workers end close together.
GPU_SLOW_FILES = [
    "test_gpu.py",
    "test_two_nodes.py",
    "test_reducer_gpu.py",
    "test_fast_path.py",
    "test_telemetry.py",
    "test_fused_loss.py",
]


@pytest.hookimpl(wrapper=True)
def pytest_collection(session):
    """Collection on again once the test modules are imported, what they made frozen (never
    walked again by the collections while the tests run); in pytest-xdist's controller too,
    which collects nothing itself."""
    try:
        return (yield)
    finally:
        gc.collect()
        gc.freeze()
        gc.enable()


def pytest_collection_modifyitems(config, items):
    slow = GPU_SLOW_FILES if torch.cuda.is_available() else SLOW_FILES

    def slow_first(item) -> int:
        name = item.path.name
        return slow.index(name) if name in slow else len(slow)

    items.sort(key=slow_first)  # stable: each file's tests keep their order
    # The benchmark scripts' quick runs (marked bench) check measurement scripts, not mgpu's
    # behaviour, and take a third of the suite's CPU: they run when selected (-m bench).
    if "bench" not in (config.getoption("markexpr") or ""):
        later = pytest.mark.skip(reason="a benchmark's quick run: select it with -m bench")
        for item in items:
            if "bench" in item.keywords:
                item.add_marker(later)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)  # in an xdist worker, before it sends the controller its tests
def pytest_collection_finish(session) -> None:
    """Once the tests are selected (-m applied). Tests not marked gpu are the CPU suite, CI's:
    beside visible CUDA GPUs the processes they start train on the GPUs (two processes of a
    node need two; train.py stops otherwise) and are compared with what this process computes,
    so on one H200 62 of them failed or erred. They run as on CI with the GPUs hidden: this
    says how, instead of failing them one by one."""
    if not torch.cuda.is_available():
        return
    cpu = [
        i
        for i in session.items
        if i.get_closest_marker("gpu") is None and i.get_closest_marker("skip") is None
    ]
    if not cpu:
        return
    why = (
        f"{len(cpu)} of the selected tests are CPU tests (not marked gpu, e.g. "
        f"{cpu[0].nodeid}) and this machine's CUDA GPUs are visible. Run them with the GPUs "
        "hidden, as CI does: CUDA_VISIBLE_DEVICES= python -m pytest -q -m 'not gpu'; and "
        "the GPU tests with: python -m pytest -q -m gpu"
    )
    if not hasattr(session.config, "workerinput"):  # not a pytest-xdist worker
        raise pytest.UsageError(why)
    # A UsageError raised in a pytest-xdist worker reaches its controller as an internal error
    # that does not say why. Run nothing and stop the session: the controller ends it as
    # interrupted, with this message, and exits non-zero.
    session.items.clear()
    session.shouldstop = why


def free_port() -> int:
    """A TCP port free on this host now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the fork server imports once, so that the processes it forks start with it: importing
# torch costs a new interpreter seconds of CPU, and a test run starts dozens of them.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",  # a process's first optimizer imports it: ~1.8 s of CPU (it starts no thread)
    "mgpu.comm.engine",
    "mgpu.comm.shard",
    "mgpu.train.trainer",
    "conftest",
]


def spawn(worker, *args, nprocs: int = 2) -> None:
    """`worker(rank, *args)` in `nprocs` fresh processes, each ending like train.py does once
    its work succeeded: without the interpreter's teardown of torch's communication threads,
    which can abort a finished process ("terminate called without an active exception") and
    fail a test that passed. A worker's exception still reaches the test with its traceback.

    The processes come from torch.multiprocessing's forkserver: forked from one clean server
    process (started on first use, single-threaded, nothing of the test's state in it) that
    has PRELOAD imported, rather than each a new interpreter as with spawn. Their environment
    is the server's, taken when it started: a worker sets what it needs itself."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(
        _run_then_exit,
        args=(worker, *args),
        nprocs=nprocs,
        join=True,
        start_method="forkserver",
    )


def _run_then_exit(rank: int, worker, *args) -> None:
    # One thread per process, as run_train's OMP_NUM_THREADS=1 gives torchrun's workers: the
    # default (a thread per core in each of N processes) oversubscribes the cores, and on 2
    # cores a 4-process run then spends most of its time spinning, 3-4 times slower.
    torch.set_num_threads(1)
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


@contextmanager
def gloo_runtime(rank: int, port: int, world: int = 2, timeout_s: float | None = None) -> Iterator:
    """A spawned worker's CPU process group (gloo) and its Runtime, torn down on the way out;
    `timeout_s` bounds its collectives (torch's default: 30 minutes)."""
    from datetime import timedelta

    import torch.distributed as tdist

    from mgpu.runtime.dist import Runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    tdist.init_process_group("gloo", rank=rank, world_size=world, timeout=timeout)
    try:
        yield Runtime(rank, rank, world, "gloo", torch.device("cpu"), has_process_group=True)
    finally:
        tdist.destroy_process_group()


# NVLink multicast stays off on the lent GPU machines (../shared/GPU.md)
NCCL_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


@contextmanager
def nccl_runtime(rank: int, port: int, world: int = 2) -> Iterator:
    """A spawned worker's NCCL process group on GPU `rank` and its Runtime, torn down on the way
    out (the spawned worker's environment is the fork server's: NCCL_ENV is set here)."""
    import torch.distributed as tdist

    from mgpu.runtime.dist import Runtime

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **NCCL_ENV)
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    tdist.init_process_group("nccl", rank=rank, world_size=world, device_id=device)
    try:
        yield Runtime(rank, rank, world, "nccl", device, has_process_group=True)
    finally:
        tdist.destroy_process_group()
