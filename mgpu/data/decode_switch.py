"""data.cpu_decode_share=auto, once the training step's pace is known: every JPEG moved to the
DataLoader workers where, counted as mgpu.data.decode_split counts them, they decode at least
as fast as the step takes images.

Why: at start-up the split knows the workers' rate and the GPU decode step's, not the step's,
so it balances the two (the workers never run out of rate before the GPU does). But the GPU's
decode kernels run beside the training step and slow it, while the workers' decoding costs the
step nothing as long as they keep up. With prepared shards (data=image_shards, images shrunk
to a 256 side) 14 workers decode about as fast as one H200 trains ResNet-50 at B=128, and every
JPEG on the workers ran 0.98-1.00 of batches-ready where the balanced split, which left 65-75 %
of them to the GPU, ran 0.95 (bench/README.md, "Prepared shards, decoded by the workers").

The rule: over batches WINDOW of the training loader's iteration, each rank measures the pace
at which its training process takes images. If on every rank the workers' counted rate is at
least that pace (one collective, at one batch), the workers decode every JPEG of the samples
from a place in the training order that no worker has been handed a sample of yet
(SampleKey.position); the GPU's decode step then gets none. Otherwise nothing changes. Once per
run; the place is saved in checkpoints (image_folder's checkpoint_state), so a resumed run
decodes each image where the first one did. A run resumed from a checkpoint saved before the
move keeps the split it started with.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import Protocol

import torch

from mgpu.data.sampler import DataCursor, stream_position
from mgpu.runtime.dist import Runtime, all_reduce_min_
from mgpu.runtime.stops import waiting

log = logging.getLogger(__name__)

# Batches of the training iteration over which the pace is measured: after the first steps'
# compiling and the workers' first fill, 40 batches (0.8 s of ResNet-50 at B=128 on an H200).
# The pace is a batch over the median time between two hand-overs: an evaluation or a checkpoint
# saved within the window pauses one of them, and would make a mean pace look slower than the
# step is (and the workers' rate enough when it is not). On a GPU that time is the training
# stream's, between CUDA events recorded at each hand-over: the host runs ahead of the GPU, and
# early in a run its own hand-overs came up to 37 % faster than the steps did (2 H200s,
# bench/README.md, 2026-11-28 12:28-12:49).
WINDOW = (20, 60)


class MovableSet(Protocol):
    """What the move needs of a data set (ImageFolder and ImageShards have it)."""

    def __len__(self) -> int: ...

    def workers_from(self) -> int | None: ...

    def workers_decode_from(self, position: int) -> None: ...


class StreamSampler(Protocol):
    """What the move needs of the training sampler (ShardedSampler): where its iteration
    started, and its seed."""

    epoch: int
    consumed: int
    seed: int


class WorkerSwitch:
    """The move, for one training loader. The DeviceLoader calls after_batch each time it hands
    a batch over; `in_flight` bounds the batches the loader can have asked its workers for
    beyond those handed over (the DataLoader's prefetch_factor x workers, the DeviceLoader's
    depth and the one it fetches)."""

    def __init__(
        self,
        dataset: MovableSet,
        sampler: StreamSampler,
        rt: Runtime,
        *,
        batch_size: int,
        workers_rate: float,
        in_flight: int,
        clock: Callable[[], float] = time.perf_counter,
    ):
        self.dataset, self.sampler, self.rt = dataset, sampler, rt
        self.batch_size, self.workers_rate, self.in_flight = batch_size, workers_rate, in_flight
        self.clock, self._times = clock, []  # host clock readings (without a GPU)
        self._events: list[torch.cuda.Event] = []  # the training stream's, on a GPU
        self.decided = dataset.workers_from() is not None  # a resumed run's, moved already

    def after_batch(self, taken: int) -> None:
        """`taken`: the batches handed over so far in this iteration, this one counted. Every
        rank calls it at the same batches (a collective at WINDOW[1])."""
        if self.decided or taken < WINDOW[0]:
            return
        self._mark()
        if taken < WINDOW[1]:
            return
        self.decided = True
        between = self._between()
        # No interval (every hand-over of the window inside a graph capture): no pace known,
        # and an unknown pace never moves the JPEGs.
        pace = self.batch_size / max(statistics.median(between), 1e-9) if between else math.inf
        # On every rank the workers' margin over its pace; the least decides for all.
        least = torch.tensor(
            [self.workers_rate - pace], dtype=torch.float64, device=self.rt.collective_device
        )
        if self.rt.distributed:
            with waiting(self.rt.rank, "the agreement on moving every JPEG to the workers"):
                all_reduce_min_(least, self.rt)
        # Sync point (once a run, at batch WINDOW[1]): the ranks' least margin, on the host.
        margin = float(least.item())
        if margin < 0:
            log.info(
                "data.cpu_decode_share=auto: the split stays: the workers decode %.0f images/s, "
                "the step took %.0f a second on this rank (batches %d-%d)%s",
                self.workers_rate, pace, *WINDOW,
                "; one rank's workers short keeps it on all" if self.rt.distributed else "",
            )  # fmt: skip
            return
        start = DataCursor(
            self.sampler.seed, self.sampler.epoch, self.sampler.consumed, len(self.dataset)
        )
        position = stream_position(
            start, taken + self.in_flight, batch_size=self.batch_size,
            world_size=self.rt.world_size,
        )  # fmt: skip
        self.dataset.workers_decode_from(position)
        log.info(
            "data.cpu_decode_share=auto: the workers decode every JPEG from batch %d on (sample "
            "%d of the training order): they decode %.0f images/s, the step took %.0f a second "
            "on this rank (batches %d-%d)%s; the GPU's decode step stops",
            taken + self.in_flight, position, self.workers_rate, pace, *WINDOW,
            ", as on every rank" if self.rt.distributed else "",
        )  # fmt: skip

    def _mark(self) -> None:
        """A hand-over's time: an event on the current (training) stream on a GPU, queued
        behind the steps the host has launched so far; the host clock elsewhere."""
        if self.rt.device.type != "cuda":
            self._times.append(self.clock())
        elif not torch.cuda.is_current_stream_capturing():  # no event inside a graph capture
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._events.append(event)

    def _between(self) -> list[float]:
        """Seconds between consecutive hand-overs of the window."""
        if self.rt.device.type != "cuda":
            return [b - a for a, b in zip(self._times, self._times[1:], strict=False)]
        # Sync point (once a run, at batch WINDOW[1]): the window's last event, so that every
        # one of them has its time; the GPU is then at most the loader's depth behind.
        self._events[-1].synchronize()
        pairs = zip(self._events, self._events[1:], strict=False)
        return [a.elapsed_time(b) / 1e3 for a, b in pairs]
