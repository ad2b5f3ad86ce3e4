"""Input pipeline from config: the dataset, the pinned DataLoader over mgpu.data.sampler's rank
shard, and the side-stream prefetcher (mgpu.data.prefetch.DeviceLoader) put in front of it.

DataLoader workers come from a fork server (worker_context), never from a fork of the training
process: that process runs threads (the stall clock, the parent watch, TensorBoard's writer,
the backends' own), and a fork taken while one of them holds an interpreter lock leaves the
child stuck in CPython's post-fork code for good (seen about once in 350 evaluation starts).
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import select
import signal
import sys
import threading
from dataclasses import dataclass
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from types import ModuleType

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from mgpu.config.checks import ConfigError
from mgpu.config.targets import build_from_target
from mgpu.data.batches import (  # noqa: F401 - re-exported: mgpu.data.loader was their home
    Transform,
    map_tensors,
    tensors,
    to_device,
    transform_inputs,
)
from mgpu.data.config import DataConfig, short_of_a_batch
from mgpu.data.decode_switch import WorkerSwitch
from mgpu.data.prefetch import DeviceLoader
from mgpu.data.sampler import ShardedSampler, epochs  # noqa: F401 - epochs re-exported
from mgpu.runtime.dist import Runtime
from mgpu.runtime.preempt import leave_preemption_to_the_trainer


def build_dataset(cfg: DataConfig, split: str) -> Dataset:
    return build_from_target("data", cfg._target_, cfg.dataset_kwargs(), split=split)


def build_dataloader(
    cfg: DataConfig,
    dataset: Dataset,
    rt: Runtime,
    *,
    seed: int,
    train: bool,
    stream: bool | None = None,
) -> DataLoader:
    """A DataLoader over this rank's shard; train loaders drop ragged last batches and, unless
    `stream=False`, iterate epoch after epoch without end (ShardedSampler's stream_batch: the
    workers run on into the next epoch; set_epoch before iterating says where to start)."""
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        why = "is an iterable data set; mgpu shards a map-style one across the processes by "
        why += "index: give the class __len__ and __getitem__ (torch.utils.data.Dataset)"
        raise ConfigError("data._target_", cfg._target_, why)
    # A dataset that augments per epoch (`sample_keys`) gets SampleKeys from the train sampler.
    keyed = train and getattr(dataset, "sample_keys", False)
    stream = train if stream is None else stream and train
    per_rank = len(dataset) // rt.world_size  # a training shard's samples an epoch
    if train and per_rank < cfg.batch_size:  # the data set is known only now: one line, exit 2
        raise short_of_a_batch(cfg.batch_size, rt.world_size, per_rank)
    if not train and len(dataset) == 0:  # a user's data set: an evaluation averages over none
        why = "its split='eval' holds no samples, and every evaluation (each trainer.eval_every "
        why += "steps, and at the end) averages the loss over them; give it some"
        raise ConfigError("data._target_", cfg._target_, why)
    sampler = ShardedSampler(
        len(dataset), rt.rank, rt.world_size, shuffle=train, seed=seed, even=train, keyed=keyed,
        stream_batch=cfg.batch_size if stream else 0,
    )  # fmt: skip
    workers = worker_count(cfg.num_workers, rt.cpu_share)
    return DataLoader(
        dataset,
        batch_size=cfg.batch_size,
        sampler=sampler,
        num_workers=workers,
        # Pinned host memory only helps a copy to a GPU; on CPU there is nothing to pin for.
        # Pinned batches are what make the prefetcher's non_blocking copies asynchronous.
        pin_memory=cfg.pin_memory and rt.device.type == "cuda",
        drop_last=train,
        prefetch_factor=cfg.prefetch_factor if workers > 0 else None,
        # Persistent where safe: train loaders run for many epochs over a dataset that does not
        # change, so their workers stay instead of forking anew. Eval loaders run briefly now
        # and then; kept workers would hold processes and memory through all of training.
        persistent_workers=train and workers > 0,
        generator=torch.Generator().manual_seed(seed + rt.rank),
        worker_init_fn=functools.partial(
            start_worker,
            trainer_pid=os.getpid(),
            keep_trainer_cores=cfg.keep_trainer_cores,
            nice=cfg.worker_nice,
            logs=log_targets(),
        ),
        collate_fn=getattr(dataset, "collate", None),  # a dataset's own batch type, if any
        multiprocessing_context=worker_context(dataset) if workers > 0 else None,
    )


# What the fork server imports once, before it forks any worker: with them in the server, a
# worker starts in milliseconds (bench/README.md, worker start-up) instead of the seconds that
# importing torch takes a new interpreter, which each evaluation's workers would pay again.
WORKER_PRELOAD = ("torch", "numpy", "mgpu.data.loader")


def entry_imports() -> list[str]:
    """The modules the entry script (`__main__`) took its names from: those its top level
    imports, e.g. train.py's hydra and mgpu.run.build."""
    main = sys.modules.get("__main__")
    names = []
    for key, value in vars(main).items() if main is not None else ():
        if key.startswith("__"):  # the interpreter's own: __builtins__, __loader__, __spec__
            continue
        name = (
            value.__name__ if isinstance(value, ModuleType) else getattr(value, "__module__", None)
        )
        if isinstance(name, str) and name in sys.modules and name != "builtins":
            names.append(name)
    return names


def worker_context(dataset: Dataset) -> BaseContext:
    """The start method of DataLoader workers: forkserver. The server is a new interpreter,
    started once per training process (when its first loader is built) and single-threaded,
    so the forks it makes cannot inherit a lock that another thread held; nor do they inherit
    the training process's descriptors (its run lock included). The dataset and
    worker_init_fn travel to each worker pickled, as under spawn. The preload is the server's
    for its whole life: the first loader built (the training set's) sets it. The workers'
    parent is the server; each worker ends with this process (end_with_the_trainer), and the
    server once it and its workers have."""
    ctx = multiprocessing.get_context("forkserver")
    # A user's dataset's module too, and what the entry script imports: each worker runs the
    # script's top level again as `__mp_main__` (as spawn's children do; how a dataset defined
    # there reaches it), and with its imports preloaded that costs milliseconds, not seconds.
    preload = [*WORKER_PRELOAD, type(dataset).__module__, *entry_imports()]
    ctx.set_forkserver_preload(sorted({name for name in preload if name != "__main__"}))
    # Started now, not on the first iteration: its imports (seconds of CPU) overlap with
    # building the model. It starts by fork and exec in C (as subprocess does), with no Python
    # run between them, so the threads here cannot leave it stuck either. It starts with these
    # signals ignored (an ignored signal stays ignored across exec, and in the workers it forks):
    # - SIGINT: a terminal's Ctrl-C reaches every process of the job, and the training process
    #   says it in one line (mgpu.run.interrupt); the server, importing its preload, would add a
    #   KeyboardInterrupt traceback;
    # - SIGTERM and SIGUSR1: torchrun and SLURM signal every process of the job at a preemption.
    #   A server they killed takes its workers with it (a worker whose parent is gone exits), and
    #   the trainer's next batch raised "DataLoader worker exited unexpectedly" before the
    #   preemption checkpoint was written. The trainer saves, then ends its workers itself.
    main = threading.current_thread() is threading.main_thread()
    before = {sig: signal.signal(sig, signal.SIG_IGN) for sig in SERVER_IGNORES} if main else {}
    try:
        forkserver.ensure_running()
    finally:
        for sig, handler in before.items():
            if handler is not None:  # None: a handler set outside Python, left as it was
                signal.signal(sig, handler)
    return ctx


SERVER_IGNORES = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


# Cores left to each training process by data.num_workers=auto: its Python thread that launches
# the GPU work, and the prefetcher's copy thread. A launch-bound model (ResNet-50) slows down when
# DataLoader workers take every core.
TRAINER_CORES = 2


def spare_cpus(allowed: list[int], keep: int = TRAINER_CORES) -> list[int]:
    """The CPUs a DataLoader worker may run on under data.keep_trainer_cores: those its training
    process may use (`allowed`, sorted) but the first `keep`; all of them where no CPU would be
    left to the workers."""
    return allowed[keep:] if len(allowed) > keep else allowed


@dataclass(frozen=True)
class LogTarget:
    """One of the training process's log handlers, as a worker makes it again: a file (the
    rank's log) or a console stream, with its level and format."""

    path: str | None
    stream: str | None  # "stdout" or "stderr", where path is None
    level: int
    formatter: logging.Formatter | None


def log_targets() -> tuple[int, tuple[LogTarget, ...]]:
    """The root logger's level and the handlers a worker writes to as its trainer does."""
    root, targets = logging.getLogger(), []
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler):
            target = LogTarget(handler.baseFilename, None, handler.level, handler.formatter)
        elif type(handler) is logging.StreamHandler and handler.stream in (sys.stdout, sys.stderr):
            stream = "stdout" if handler.stream is sys.stdout else "stderr"
            target = LogTarget(None, stream, handler.level, handler.formatter)
        else:
            continue
        targets.append(target)
    return root.level, tuple(targets)


def log_like_the_trainer(logs: tuple[int, tuple[LogTarget, ...]]) -> None:
    """A worker's log lines (a replaced image, a dataset's warning) go where its trainer's go.
    A forked worker inherited the handlers; one from the fork server starts with none."""
    level, targets = logs
    root = logging.getLogger()
    root.setLevel(level)
    for target in targets:
        if target.path is not None:  # appended to, beside the trainer's own lines
            handler: logging.Handler = logging.FileHandler(target.path, encoding="utf-8")
        else:
            handler = logging.StreamHandler(getattr(sys, target.stream))
        handler.setLevel(target.level)
        handler.setFormatter(target.formatter)
        root.addHandler(handler)


def quiet_when_the_trainer_hangs_up() -> None:
    """In a DataLoader worker: no traceback when the training process hangs up mid-batch.

    Why: a worker hands each tensor over with a file descriptor that a thread of its own
    (multiprocessing's resource sharer) sends when the training process asks for it. A Ctrl-C
    that interrupts the training process in the middle of that exchange closes its end, and the
    sharer thread prints a BrokenPipe traceback beside the trainer's one-line report
    (mgpu.run.interrupt). Only a closed connection (ConnectionError, EOFError) raised through
    the sharer's code (resource_sharer.py in the traceback) is kept quiet: the training process
    is ending and says why itself; every other error is printed as before."""
    printed = sys.excepthook

    def hook(kind, value, tb) -> None:  # noqa: ANN001 - sys.excepthook's signature
        if issubclass(kind, (ConnectionError, EOFError)) and _in_resource_sharer(tb):
            return
        printed(kind, value, tb)

    sys.excepthook = hook


def _in_resource_sharer(tb) -> bool:  # noqa: ANN001 - a traceback
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith(
            os.path.join("multiprocessing", "resource_sharer.py")
        ):
            return True
        tb = tb.tb_next
    return False


def end_with_the_trainer(trainer_pid: int) -> None:
    """In a DataLoader worker: exit as soon as the training process `trainer_pid` has ended,
    however it ended (a kill -9, the OOM killer, a crash in native code).

    Why: the worker's parent is the fork server, and torch's worker watches only its parent. The
    server ends once every holder of its liveness pipe has closed it, and multiprocessing hands
    that pipe to each process the server forks, so after the trainer was killed the server and
    its workers waited on each other for good, beside the next launch (and holding its memory).
    A pidfd of the trainer turns readable when it ends; a daemon thread waits on it."""
    try:
        pidfd = os.pidfd_open(trainer_pid)
    except ProcessLookupError:  # ended already, before this worker started
        os._exit(0)
    threading.Thread(
        target=_exit_when_readable, args=(pidfd,), name="mgpu-trainer-watch", daemon=True
    ).start()


def _exit_when_readable(fd: int) -> None:
    select.select([fd], [], [])
    os._exit(0)  # nobody reads a batch any more; no cleanup is owed to a gone trainer


def start_worker(
    worker_id: int,
    trainer_pid: int,
    keep_trainer_cores: bool = False,
    nice: int = 0,
    logs: tuple[int, tuple[LogTarget, ...]] = (logging.WARNING, ()),
) -> None:
    """Each DataLoader worker's first act: SIGTERM and SIGUSR1 left to the trainer, its end tied
    to the trainer's, its log lines sent where the trainer's go, no traceback when the trainer
    hangs up mid-batch, under `keep_trainer_cores` its CPUs narrowed to spare_cpus (the
    training process keeps the whole set), and its priority lowered by `nice`
    (data.worker_nice)."""
    leave_preemption_to_the_trainer(worker_id)
    end_with_the_trainer(trainer_pid)
    log_like_the_trainer(logs)
    quiet_when_the_trainer_hangs_up()
    if keep_trainer_cores:
        os.sched_setaffinity(0, spare_cpus(sorted(os.sched_getaffinity(0))))
    if nice:
        # The worker's thread, before it starts any other: threads inherit their creator's
        # niceness, and Linux keeps one per thread.
        os.nice(nice)


def worker_count(setting: int | str, cpu_share: int) -> int:
    """`data.num_workers`: a number as it is; auto, this training process's share of the node's
    CPUs (Runtime.cpu_share) less TRAINER_CORES, at least 1."""
    if setting != "auto":
        return int(setting)
    return max(1, cpu_share - TRAINER_CORES)


def build_loader(
    cfg: DataConfig,
    dataset: Dataset,
    rt: Runtime,
    *,
    seed: int,
    train: bool,
    layout: torch.memory_format | None = None,
    workers_rate: float | None = None,
) -> DeviceLoader:
    """This rank's batches on its device: the DataLoader behind a side-stream prefetcher.
    `layout`: the memory format 4-D inputs leave in (the model's, e.g. channels_last).
    `workers_rate`: a training set's under data.cpu_decode_share=auto (decode_split's
    resolve_auto): the loader then decides, once, whether its workers take every JPEG
    (mgpu.data.decode_switch)."""
    loader = build_dataloader(cfg, dataset, rt, seed=seed, train=train)
    transform = device_transform(cfg, dataset)
    # A dataset that decodes on the device (image_folder's decode=gpu) makes the decode step.
    make_decoder = getattr(dataset, "device_decoder", None)
    decode = make_decoder(rt.device) if make_decoder is not None else None
    switch = None
    if train and workers_rate is not None and loader.num_workers > 0:
        # Batches the workers can be asked for beyond those handed over: the DataLoader's
        # prefetch_factor a worker, and the DeviceLoader's depth, the batch it fetches and the
        # one it hands over; two more for good measure.
        in_flight = loader.prefetch_factor * loader.num_workers + cfg.prefetch_depth + 4
        switch = WorkerSwitch(
            dataset, loader.sampler, rt, batch_size=cfg.batch_size, workers_rate=workers_rate,
            in_flight=in_flight,
        )  # fmt: skip
    return DeviceLoader(
        loader,
        rt.device,
        depth=cfg.prefetch_depth,
        transform=transform,
        memory_format=layout,
        decode=decode,
        # A decode step waits on the host for its GPU work (torchvision's nvJPEG does): on the
        # copy thread that wait overlaps the training loop's launches instead of delaying them.
        copy_thread=decode is not None,
        after_batch=switch.after_batch if switch is not None else None,
    )


def device_transform(cfg: DataConfig, dataset: Dataset) -> Transform | None:
    """`data.device_transform`: auto takes the dataset's `device_transform` attribute, if any."""
    if cfg.device_transform == "none":
        return None
    if cfg.device_transform == "auto":
        return getattr(dataset, "device_transform", None)
    raise ConfigError("data.device_transform", cfg.device_transform, "must be auto or none")
