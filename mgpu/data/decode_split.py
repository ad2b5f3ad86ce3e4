"""data.cpu_decode_share=auto: the share of the JPEGs that the DataLoader workers decode beside
the GPU under data.decode=gpu, from the rates measured at start-up on this host, with the run's
own images: one core's decode-and-crop rate, times the workers, against the GPU's decode step.

Why a split at all: the GPU decode step costs the training step GPU time (nvJPEG's kernels and
the crops run beside it), while the workers sit idle. Why measured: the cores' rate differs by
2-3x between hosts of the same GPU (bench/README.md, "Real images"); a fixed share of 0.3
gained 0.025 on one H100 host and lost 0.18 on a slower one, where it asked the workers for
more than they could give.

The rule: each side takes the JPEGs in proportion to its measured rate (the workers' counted at
WORKER_EFFICIENCY of a core alone), so that, whatever the step consumes, the workers run out of
rate no sooner than the GPU does. The share is agreed over ranks (the least) and saved in
checkpoints: a resumed run decodes each image where the first run did, so it sees the same
pixels, even on another host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mgpu.data.encoded import BadImageFile, Encoded, EncodedBatch, collate_encoded
from mgpu.data.loader import worker_count
from mgpu.runtime.dist import Runtime, all_reduce_min_
from mgpu.runtime.stops import waiting

log = logging.getLogger(__name__)

# A worker's decode rate beside its peers, the prefetcher and the training process, as a share
# of one core's rate measured alone: a margin, not a measurement. It keeps the workers' load at
# most about three quarters of what they can do, so a slower stretch of images or a busy core
# shows as less head room, not as data wait.
WORKER_EFFICIENCY = 0.75
# JPEGs decoded on one core (~0.2-0.6 s at 100-300 images/s), then on the GPU as one batch,
# three timed calls after one to warm up.
PROBE_IMAGES = 64
STATE_KEY = "cpu_decode_share"  # in a checkpoint's "dataset" state
# The largest share: a data set takes shares below 1 (every JPEG on the CPU is data.decode=cpu).
MAX_SHARE = 0.99


class SplitSet(Protocol):
    """What the measurement needs of an image set (ImageFolder and ImageShards have it)."""

    def __len__(self) -> int: ...

    def probe_item(self, i: int, *, cpu: bool) -> Encoded | None: ...


@dataclass(frozen=True)
class Rates:
    """Images a second, measured on this rank: one core decoding and cropping (Pillow, as a
    worker does), and the GPU's decode step (decode and crops, a batch a call)."""

    core: float
    gpu: float
    images: int  # JPEGs the probes used


def split_share(workers: int, core_rate: float, gpu_rate: float) -> float:
    """The workers' share of the JPEGs: their counted rate over both sides' (0 without workers,
    at most MAX_SHARE)."""
    cpu = workers * core_rate * WORKER_EFFICIENCY
    if cpu <= 0:
        return 0.0
    return min(cpu / (cpu + gpu_rate), MAX_SHARE)


def probe_jpegs(dataset: SplitSet, count: int) -> list[int]:
    """Up to `count` indices of JPEGs the GPU path would take, spread evenly over the whole
    data set: its files are in class order, and image sizes can go by class (in
    bench/make_image_folder's realistic mix every 2400x1800 photo is in the first three of 100
    classes; a probe of the first quarter measured one core at half its rate)."""
    n = len(dataset)
    candidates = sorted({k * n // (2 * count) for k in range(2 * count)})
    picked = []
    for i in candidates:
        try:
            item = dataset.probe_item(i, cpu=False)
        except BadImageFile:
            continue  # the run's bad_files policy meets it later; a probe skips it
        if item is not None and item.data is not None:
            picked.append(i)
    return spread(picked, count)


def spread(items: list[int], count: int) -> list[int]:
    """`count` of `items`, evenly spaced over them (all of them if there are no more)."""
    if len(items) <= count:
        return items
    return [items[k * len(items) // count] for k in range(count)]


def measure(
    dataset: SplitSet,
    decode: Callable[[EncodedBatch], object],
    device: torch.device,
    *,
    count: int = PROBE_IMAGES,
) -> Rates | None:
    """One core's rate and the GPU decode step's, on up to `count` of the data set's own JPEGs,
    each decoded on the core first: one that Pillow cannot read is left out of both (the run's
    bad_files policy meets it later). None if fewer than 4 JPEGs are left to measure on."""
    chosen = probe_jpegs(dataset, count)
    if len(chosen) < 4:
        return None
    # One thread, as in a DataLoader worker (torch sets it there), not the training process's
    # pool: the resize runs as the workers will run it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    readable = []
    try:
        _try_on_core(dataset, chosen[0])  # Pillow's first call pays its imports
        start = time.perf_counter()
        readable = [i for i in chosen if _try_on_core(dataset, i)]
        core = len(chosen) / (time.perf_counter() - start)  # a bad file's try counts too
    finally:
        torch.set_num_threads(threads)
    if len(readable) < 4:
        return None
    encoded = collate_encoded([dataset.probe_item(i, cpu=False) for i in readable])
    if device.type == "cuda":
        encoded = encoded.pin_memory()  # as the DataLoader hands it over
    decode(encoded)  # the first call sets nvJPEG's buffers up
    calls = 3
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        decode(encoded)
    # Sync point (start-up, before training): the decode's GPU work must be done to be timed.
    _sync(device)
    gpu = calls * len(readable) / (time.perf_counter() - start)
    return Rates(core=core, gpu=gpu, images=len(readable))


def _try_on_core(dataset: SplitSet, i: int) -> bool:
    try:
        dataset.probe_item(i, cpu=True)
        return True
    except BadImageFile:
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed(share: float, rt: Runtime) -> float:
    """The smallest share of the ranks, the same number on every rank (a collective at
    start-up: every rank calls it): no rank's workers are asked for more than it measured they
    can give. Rounded to 3 places, so the log and the checkpoint say what is used."""
    if rt.distributed:
        device = rt.device if rt.backend == "nccl" else torch.device("cpu")
        least = torch.tensor([share], dtype=torch.float64, device=device)
        with waiting(rt.rank, "the agreement on data.cpu_decode_share=auto's share"):
            all_reduce_min_(least, rt)
        # Sync point (start-up): the agreed share is needed on the host, by the data sets.
        share = float(least.item())
    return min(round(share, 3), MAX_SHARE)


def counted_workers(workers: int, rt: Runtime) -> int:
    """The workers whose rate counts: no more than data.num_workers=auto would start (the cores
    this process may use, less the trainer's own); more share cores, and are no faster."""
    return min(workers, worker_count("auto", rt.cpu_share)) if workers > 0 else 0


def resolve_share(
    dataset: SplitSet,
    decode: Callable[[EncodedBatch], object] | None,
    workers: int,
    rt: Runtime,
    saved: float | None = None,
) -> float:
    """data.cpu_decode_share=auto's share for this run, logged with why: the checkpoint's when
    resuming (`saved`), else measured here and agreed over ranks. 0 where nothing is decoded on
    the GPU (`decode` None) or no worker runs. Every rank calls it (a collective)."""
    if saved is not None:
        log.info(
            "data.cpu_decode_share=auto: %.3f, the share the checkpoint's run decoded with "
            "(each image is decoded where it was then)", saved,
        )  # fmt: skip
        if saved and workers == 0:
            log.warning(
                "data.cpu_decode_share=auto: data.num_workers=0, so the training process "
                "decodes that share of the JPEGs itself, between steps"
            )  # fmt: skip
        return float(saved)
    rates, failed = None, ""
    if decode is not None and workers > 0:
        try:
            rates = measure(dataset, decode, rt.device)
        except Exception as err:  # every rank must still reach the agreement below
            failed = f"{type(err).__name__}: {err}"
    counted = counted_workers(workers, rt)
    share = split_share(counted, rates.core, rates.gpu) if rates is not None else 0.0
    share = agreed(share, rt)
    if decode is None or workers == 0:
        why = "nothing is decoded on the GPU" if decode is None else "data.num_workers is 0"
        log.info("data.cpu_decode_share=auto: 0 (%s)", why)
    elif failed:
        log.warning("data.cpu_decode_share=auto: %.3f; the measurement failed (%s)", share, failed)
    elif rates is None:
        log.info("data.cpu_decode_share=auto: %.3f (too few readable JPEGs to measure)", share)
    else:
        log.info(
            "data.cpu_decode_share=auto: %.3f of the JPEGs decoded by the %d workers, the rest "
            "on the GPU: one core decodes and crops %.0f images/s (counted at %.0f%% a worker, "
            "%d workers counted), the GPU's decode step %.0f images/s, measured on %d of the "
            "run's JPEGs%s",
            share, workers, rates.core, 100 * WORKER_EFFICIENCY, counted, rates.gpu,
            rates.images, " (the least of the ranks' shares)" if rt.distributed else "",
        )  # fmt: skip
    return share


def shared_split(datasets: Sequence[object], share: float) -> None:
    """Give every data set of the run (training and evaluation) the same share."""
    for dataset in datasets:
        setter = getattr(dataset, "set_cpu_decode_share", None)
        if setter is not None:
            setter(share)


def resolve_auto(
    share_setting: object,
    num_workers: object,
    datasets: Sequence[object],
    rt: Runtime,
    saved_state: dict | None,
) -> None:
    """data.cpu_decode_share=auto: the share resolved once for the run (training's data set
    measured) and given to every data set (training and evaluation), before their workers
    start. `saved_state`: the checkpoint's "dataset" state when resuming. Anything but auto:
    nothing to do (the data sets took the number)."""
    if share_setting != "auto" or not datasets:
        return
    train = datasets[0]
    saved_state = saved_state or {}
    # A share saved by a run that decoded every JPEG on the CPU was never measured: measure.
    saved = saved_state.get(STATE_KEY) if saved_state.get("decode") == "gpu" else None
    decode = None
    if saved is None:  # the decode step is made only to be measured
        make_decoder = getattr(train, "device_decoder", None)
        decode = make_decoder(rt.device) if make_decoder is not None else None
    workers = worker_count(num_workers, rt.cpu_share)
    shared_split(datasets, resolve_share(train, decode, workers, rt, saved))
