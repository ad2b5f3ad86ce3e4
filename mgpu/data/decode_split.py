"""data.cpu_decode_share=auto: the share of the JPEGs that the DataLoader workers decode beside
the GPU under data.decode=gpu, from the rates measured at start-up on this host, with the run's
own images: one core's decode-and-crop rate, times the workers, against the GPU's decode step.

Why a split at all: the GPU decode step costs the training step GPU time (nvJPEG's kernels and
the crops run beside it), while the workers sit idle. Why measured: the cores' rate differs by
2-3x between hosts of the same GPU (bench/README.md, "Real images"); a fixed share of 0.3
gained 0.025 on one H100 host and lost 0.18 on a slower one, where it asked the workers for
more than they could give.

Two kinds of JPEG: those decoded at full size, and those whose crop box lets the CPU decode them
DCT-scaled (a large photo, reduced_decode): such a JPEG costs a core a fraction of its full
decode and the GPU all of it, so the workers take that kind first when it frees more GPU time
per core second (measured, kind by kind).

The rule: the workers (counted at WORKER_EFFICIENCY of a core alone) take JPEGs, kind by kind in
that order, until they would spend as long on a stream's JPEGs as the GPU spends on the rest:
whatever the step consumes, the workers run out of rate no sooner than the GPU does. The shares
are agreed over ranks (the least) and saved in checkpoints: a resumed run decodes each image
where the first run did, so it sees the same pixels, even on another host.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from mgpu.data.encoded import BadImageFile, Encoded, EncodedBatch, collate_encoded
from mgpu.data.image_folder import SCALED_KEY, STATE_KEY, WORKERS_KEY  # a checkpoint's state
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
# three timed calls after one to warm up: up to PROBE_IMAGES decoded at full size and
# SCALED_PROBE DCT-scaled ones (a few percent of a photo set, each costing several). SCAN times
# PROBE_IMAGES headers are read to find them and count their share; a kind is timed on its own
# from MIN_PROBE readable JPEGs.
PROBE_IMAGES = 64
SCALED_PROBE = 16
SCAN = 4
MIN_PROBE = 4
# The largest share: a data set takes shares below 1 (every JPEG on the CPU is data.decode=cpu).
MAX_SHARE = 0.99


class SplitSet(Protocol):
    """What the measurement needs of an image set (ImageFolder and ImageShards have it)."""

    def __len__(self) -> int: ...

    def probe_item(self, i: int, *, cpu: bool) -> Encoded | None: ...

    def decodes_scaled(self, box: tuple) -> bool: ...


@dataclass(frozen=True)
class KindRates:
    """One kind of JPEG, measured on this rank: images a second of one core decoding and
    cropping it (Pillow, as a worker does) and of the GPU's decode step (a batch a call), and
    its share of the JPEGs the GPU path takes."""

    core: float
    gpu: float
    fraction: float
    images: int  # JPEGs the probes used


@dataclass(frozen=True)
class Rates:
    """`full`: the JPEGs decoded at full size; `scaled`: those the CPU decodes DCT-scaled. With
    too few of either kind to time, `full` is all of them and `scaled` None."""

    full: KindRates
    scaled: KindRates | None


def split_shares(workers: int, rates: Rates) -> tuple[float, float]:
    """The workers' shares (of the full-size JPEGs, of the DCT-scaled ones): kind by kind, the
    one that frees the most GPU time per core second first, until their counted time on a
    stream's JPEGs equals the GPU's on the rest. 0 without workers; the full-size share at
    most MAX_SHARE; with one kind measured, one share for both."""
    cores = workers * WORKER_EFFICIENCY
    if cores <= 0:
        return 0.0, 0.0
    # (slot in the returned pair, the kind, its cap)
    kinds = [(0, rates.full, MAX_SHARE)] + ([(1, rates.scaled, 1.0)] if rates.scaled else [])
    kinds = [(slot, k, cap) for slot, k, cap in kinds if k.fraction > 0]
    gpu_time = sum(k.fraction / k.gpu for _, k, _ in kinds)  # GPU seconds a JPEG of the stream
    cpu_time = 0.0  # the workers' seconds a JPEG of the stream, their cores' together
    shares = [0.0, 0.0]
    for slot, kind, cap in sorted(kinds, key=lambda t: t[1].gpu / t[1].core):  # core s per GPU s
        # the share x at which cpu_time + x*f/(core*cores) == gpu_time - x*f/gpu
        x = (gpu_time - cpu_time) / (kind.fraction / (kind.core * cores) + kind.fraction / kind.gpu)
        shares[slot] = x = min(max(x, 0.0), cap)
        cpu_time += x * kind.fraction / (kind.core * cores)
        gpu_time -= x * kind.fraction / kind.gpu
    return shares[0], (shares[1] if rates.scaled is not None else shares[0])


def workers_rate(workers: int, rates: Rates) -> float:
    """Images a second the workers decode and crop when they take every JPEG of the stream (its
    kinds in their measured fractions), counted as split_shares counts them."""
    per_image = sum(k.fraction / k.core for k in (rates.full, rates.scaled) if k is not None)
    return workers * WORKER_EFFICIENCY / per_image if per_image > 0 else 0.0


def probe_jpegs(dataset: SplitSet, count: int) -> tuple[list[int], list[int]]:
    """Indices of JPEGs the GPU path would take among SCAN * `count` spread evenly over the
    whole data set (its files are in class order, and image sizes can go by class: in
    bench/make_image_folder's realistic mix every 2400x1800 photo is in the first three of 100
    classes, and a probe of the first quarter measured one core at half its rate), whose
    headers are read: those decoded at full size on the CPU, and those it decodes DCT-scaled
    (epoch 0's crops)."""
    n = len(dataset)
    candidates = sorted({k * n // (SCAN * count) for k in range(SCAN * count)})
    full, scaled = [], []
    for i in candidates:
        try:
            item = dataset.probe_item(i, cpu=False)
        except BadImageFile:
            continue  # the run's bad_files policy meets it later; a probe skips it
        if item is not None and item.data is not None:
            (scaled if dataset.decodes_scaled(item.box) else full).append(i)
    return full, scaled


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
    """Each kind's rates on the data set's own JPEGs (probe_jpegs: up to `count` decoded at
    full size, SCALED_PROBE DCT-scaled), each decoded on the core first: one that Pillow cannot
    read is left out of both rates (the run's bad_files policy meets it later). With fewer than
    MIN_PROBE readable JPEGs of a kind, both kinds are timed as one (up to `count` of them, as
    they come in the data set); None if fewer than MIN_PROBE are readable in all."""
    found_full, found_scaled = probe_jpegs(dataset, count)
    fraction = len(found_scaled) / max(len(found_full) + len(found_scaled), 1)
    if min(len(found_full), len(found_scaled)) < MIN_PROBE:
        kinds = [spread(sorted(found_full + found_scaled), count), []]
    else:
        kinds = [spread(found_full, count), spread(found_scaled, SCALED_PROBE)]
    if len(kinds[0]) < MIN_PROBE:
        return None
    # One thread, as in a DataLoader worker (torch sets it there), not the training process's
    # pool: the resize runs as the workers will run it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _try_on_core(dataset, kinds[0][0])  # Pillow's first call pays its imports
        (full_s, full), (scaled_s, scaled) = [_on_core(dataset, kind) for kind in kinds]
    finally:
        torch.set_num_threads(threads)
    if min(len(full), len(scaled)) < MIN_PROBE:  # too few readable to time apart: one kind
        full, seconds = sorted(full + scaled), full_s + scaled_s
        if len(full) < MIN_PROBE:
            return None
        core = (len(kinds[0]) + len(kinds[1])) / seconds  # a bad file's try counts too
        return Rates(KindRates(core, _on_gpu(dataset, full, decode, device), 1.0, len(full)), None)
    return Rates(
        KindRates(
            len(kinds[0]) / full_s, _on_gpu(dataset, full, decode, device), 1 - fraction, len(full)
        ),
        KindRates(
            len(kinds[1]) / scaled_s,
            _on_gpu(dataset, scaled, decode, device),
            fraction,
            len(scaled),
        ),
    )


def _on_core(dataset: SplitSet, chosen: list[int]) -> tuple[float, list[int]]:
    """Seconds one core takes over `chosen` (a bad file's try counts too), and the readable
    ones."""
    start = time.perf_counter()
    readable = [i for i in chosen if _try_on_core(dataset, i)]
    return time.perf_counter() - start, readable


def _on_gpu(
    dataset: SplitSet, chosen: list[int], decode: Callable[[EncodedBatch], object], device
) -> float:
    """The GPU decode step's images a second on `chosen` as one batch: three timed calls after
    one that sets nvJPEG's buffers up."""
    encoded = collate_encoded([dataset.probe_item(i, cpu=False) for i in chosen])
    if device.type == "cuda":
        encoded = encoded.pin_memory()  # as the DataLoader hands it over
    decode(encoded)
    calls = 3
    _sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        decode(encoded)
    # Sync point (start-up, before training): the decode's GPU work must be done to be timed.
    _sync(device)
    return calls * len(chosen) / (time.perf_counter() - start)


def _try_on_core(dataset: SplitSet, i: int) -> bool:
    try:
        dataset.probe_item(i, cpu=True)
        return True
    except BadImageFile:
        return False


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed(shares: tuple[float, float], rt: Runtime) -> tuple[float, float]:
    """The smallest shares of the ranks, the same on every rank (a collective at start-up:
    every rank calls it): no rank's workers are asked for more than it measured they can give.
    Rounded to 3 places, so the log and the checkpoint say what is used."""
    if rt.distributed:
        least = torch.tensor(shares, dtype=torch.float64, device=rt.collective_device)
        with waiting(rt.rank, "the agreement on data.cpu_decode_share=auto's share"):
            all_reduce_min_(least, rt)
        # Sync point (start-up): the agreed shares are needed on the host, by the data sets.
        shares = tuple(least.tolist())
    full, scaled = shares
    return min(round(full, 3), MAX_SHARE), min(round(scaled, 3), 1.0)


def counted_workers(workers: int, rt: Runtime) -> int:
    """The workers whose rate counts: no more than data.num_workers=auto would start (the cores
    this process may use, less the trainer's own); more share cores, and are no faster."""
    return min(workers, worker_count("auto", rt.cpu_share)) if workers > 0 else 0


def resolve_share(
    dataset: SplitSet,
    decode: Callable[[EncodedBatch], object] | None,
    workers: int,
    rt: Runtime,
    saved: tuple[float, float] | None = None,
) -> tuple[tuple[float, float], float | None]:
    """data.cpu_decode_share=auto's shares for this run (of the full-size JPEGs, of the
    DCT-scaled ones), logged with why: the checkpoint's when resuming (`saved`), else measured
    here and agreed over ranks. 0 where nothing is decoded on the GPU (`decode` None) or no
    worker runs. Every rank calls it (a collective). With them, this rank's workers' counted
    rate on every JPEG (workers_rate; 0 where it could not be measured) where the move to the
    workers (mgpu.data.decode_switch) is for the run to decide, else None: the same on every
    rank, as it follows from the settings and the checkpoint alone."""
    if saved is not None:
        log.info(
            "data.cpu_decode_share=auto: %.3f (%.3f of the DCT-scaled JPEGs), the shares the "
            "checkpoint's run decoded with (each image is decoded where it was then)", *saved,
        )  # fmt: skip
        if any(saved) and workers == 0:
            log.warning(
                "data.cpu_decode_share=auto: data.num_workers=0, so the training process "
                "decodes those JPEGs itself, between steps"
            )  # fmt: skip
        return saved, None
    rates, failed = None, ""
    if decode is not None and workers > 0:
        try:
            rates = measure(dataset, decode, rt.device)
        except Exception as err:  # every rank must still reach the agreement below
            failed = f"{type(err).__name__}: {err}"
    counted = counted_workers(workers, rt)
    shares = split_shares(counted, rates) if rates is not None else (0.0, 0.0)
    shares = agreed(shares, rt)
    if decode is None or workers == 0:
        why = "nothing is decoded on the GPU" if decode is None else "data.num_workers is 0"
        log.info("data.cpu_decode_share=auto: 0 (%s)", why)
    elif failed:
        log.warning("data.cpu_decode_share=auto: 0; the measurement failed (%s)", failed)
    elif rates is None:
        log.info("data.cpu_decode_share=auto: 0 (too few readable JPEGs to measure)")
    else:
        log.info("data.cpu_decode_share=auto: %s", _said(shares, rates, workers, counted, rt))
    if decode is None or workers == 0:
        return shares, None
    return shares, workers_rate(counted, rates) if rates is not None else 0.0


def _said(shares: tuple[float, float], rates: Rates, workers: int, counted: int, rt) -> str:
    """The log line's body: the shares, and the rates they come from."""
    full, scaled = shares
    why = f"(counted at {100 * WORKER_EFFICIENCY:.0f}% a worker, {counted} workers counted)" + (
        " (the least of the ranks' shares)" if rt.distributed else ""
    )
    if rates.scaled is None:
        return (
            f"{full:.3f} of the JPEGs decoded by the {workers} workers, the rest on the GPU: "
            f"one core decodes and crops {rates.full.core:.0f} images/s {why}, the GPU's "
            f"decode step {rates.full.gpu:.0f} images/s, measured on {rates.full.images} of "
            "the run's JPEGs"
        )
    f, s = rates.full, rates.scaled
    return (
        f"{full:.3f} of the JPEGs decoded at full size and {scaled:.3f} of those decoded "
        f"DCT-scaled ({100 * s.fraction:.1f}% of them) by the {workers} workers, the rest on "
        f"the GPU: one core decodes and crops {f.core:.0f} and {s.core:.0f} images/s of each "
        f"{why}, the GPU's decode step {f.gpu:.0f} and {s.gpu:.0f}, measured on {f.images} "
        f"and {s.images} of the run's JPEGs"
    )


def shared_split(datasets: Sequence[object], shares: tuple[float, float]) -> None:
    """Give every data set of the run (training and evaluation) the same shares."""
    for dataset in datasets:
        setter = getattr(dataset, "set_cpu_decode_share", None)
        if setter is not None:
            setter(*shares)


def resolve_auto(
    share_setting: object,
    num_workers: object,
    datasets: Sequence[object],
    rt: Runtime,
    saved_state: dict | None,
) -> float | None:
    """data.cpu_decode_share=auto: the shares resolved once for the run (training's data set
    measured) and given to every data set (training and evaluation), before their workers
    start; a checkpoint's move of every JPEG to the workers given to the training set.
    `saved_state`: the checkpoint's "dataset" state when resuming. Anything but auto: nothing
    to do (the data sets took the number). Returns what resolve_share does of the rate: the
    training loader's WorkerSwitch is built where it is not None."""
    if share_setting != "auto" or not datasets:
        return None
    train = datasets[0]
    saved_state = saved_state or {}
    saved = None
    # Shares saved by a run that decoded every JPEG on the CPU were never measured: measure.
    # A checkpoint from before the two kinds has one share for both.
    if saved_state.get("decode") == "gpu" and STATE_KEY in saved_state:
        full = float(saved_state[STATE_KEY])
        saved = (full, float(saved_state.get(SCALED_KEY, full)))
    decode = None
    if saved is None:  # the decode step is made only to be measured
        make_decoder = getattr(train, "device_decoder", None)
        decode = make_decoder(rt.device) if make_decoder is not None else None
    workers = worker_count(num_workers, rt.cpu_share)
    shares, rate = resolve_share(train, decode, workers, rt, saved)
    shared_split(datasets, shares)
    moved = saved_state.get(WORKERS_KEY) if saved is not None else None
    if moved is not None:  # the checkpoint's run moved every JPEG to the workers from there on
        train.workers_decode_from(int(moved))
        log.info(
            "data.cpu_decode_share=auto: the workers decode every JPEG from sample %d of the "
            "training order on, as the checkpoint's run did", int(moved),
        )  # fmt: skip
    return rate
