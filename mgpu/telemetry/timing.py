"""Where a step's time goes, measured without waiting on the GPU: marks on the device's own
timeline (Clock), the four marks the training loop takes per step (StepTimer), the time steps
waited for data (DataWait), and the breakdown of an interval's steps into data wait, compute,
exposed communication, optimizer and other. Read a log interval later by mgpu.telemetry.metrics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from mgpu.telemetry.lagged import HostCopy
from mgpu.telemetry.stamps import StampRange

Mark = torch.cuda.Event | float


class Clock:
    """Marks points in the stream of work: CUDA events on a GPU, host time on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self) -> Mark:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()  # on the current stream, after all work queued so far
            return event
        return time.perf_counter()  # CPU ops run synchronously: host time is their time

    def elapsed_ms(self, start: Mark, end: Mark) -> float:
        if self.cuda:
            end.synchronize()  # sync point, but only on an event at least one interval old
            return start.elapsed_time(end)
        return (end - start) * 1e3


# The parts of a step (breakdown()), each in time/<part>_ms and time/<part>_pct.
PARTS = ("data_wait", "compute", "exposed_comm", "optimizer", "other")


class StepTimer:
    """The marks breakdown() tiles a step with, taken by the training loop at four points: per
    micro-step when its batch is asked for, when the batch is ready and when backward is done;
    then when the optimizer step is done. Kept here until the interval that holds them closes.
    Without a clock (no Recorder) it takes no marks."""

    def __init__(self, clock: Clock | None):
        self.clock = clock
        self.steps: list[list[Mark]] = []  # per step: (asked, ready, backward) x micro, done
        self._current: list[Mark] = []

    def _mark(self) -> None:
        if self.clock is not None:
            self._current.append(self.clock.mark())

    data_asked = data_ready = backward_done = _mark

    def step_done(self) -> None:
        if self.clock is not None:
            self._mark()
            self.steps.append(self._current)
            self._current = []

    def take(self) -> list[list[Mark]]:
        """Every finished step's marks since the last take."""
        steps, self.steps = self.steps, []
        return steps


@dataclass
class WaitSample:
    """Data wait over some batches: host time now, GPU stalls as event pairs still to be read."""

    host_s: float = 0.0  # host time the loop spent blocked in next()
    gpu: bool = False  # whether the batches went to a GPU (and the pairs below are the measure)
    gpu_ms: float = 0.0  # stalls already read from completed event pairs
    pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = field(default_factory=list)

    def total_ms(self) -> float:
        """The time data cost: on a GPU the compute stream's stall, on CPU the host's wait.
        Read it a log interval after the batches were handed over: each `synchronize` is then
        on an event the GPU has long passed."""
        if not self.gpu:
            return self.host_s * 1e3
        ms = self.gpu_ms
        for requested, ready in self.pending:
            ready.synchronize()  # sync point, but on an event at least one interval old
            ms += requested.elapsed_time(ready)
        return ms


class DataWait:
    """What the consumer of a loader waited for its batches, gathered without a host sync.

    Host: the time next() blocked the training loop (perf_counter, summed). GPU: per batch, a
    pair of timing events on the consumer's stream, one recorded when next() is called (so it
    completes when the work queued before is done) and one after the stream's wait for the
    batch's copy. Between them the compute stream had nothing to do but wait for data: for the
    host to deliver the batch, then for its copy. That stall is the data wait on a GPU; host
    time blocked while the GPU still had queued work cost nothing, so it is not added (it is
    kept, as `host_s`). The pairs are read later (`WaitSample.total_ms`), never at the step
    that records them.
    """

    FOLD_AT = 256  # pending pairs before completed ones are folded into a number

    def __init__(self) -> None:
        self._sample = WaitSample()

    def add(self, host_s: float, pair: tuple[torch.cuda.Event, torch.cuda.Event] | None) -> None:
        sample = self._sample
        sample.host_s += host_s
        if pair is None:
            return
        sample.gpu = True
        sample.pending.append(pair)
        if len(sample.pending) >= self.FOLD_AT:
            # A loader nobody reads (an eval loader, a benchmark) must not hoard events: fold
            # the pairs the GPU has finished. query() asks without waiting.
            done = 0
            for requested, ready in sample.pending:
                if not ready.query():
                    break
                sample.gpu_ms += requested.elapsed_time(ready)
                done += 1
            del sample.pending[:done]

    def take(self) -> WaitSample:
        """Everything since the last take; the meter starts again from zero."""
        sample, self._sample = self._sample, WaitSample()
        return sample


@dataclass
class Interval:
    """The steps since the previous record, waiting for the GPU to finish them."""

    step: int
    steps: int
    lr: float
    loss: HostCopy  # [mean loss, good steps(, fp16 loss scale)]: a copy that may be in flight
    start: Mark
    end: Mark
    data_wait: WaitSample | None = None
    # per synchronised step: (backward end, comm end); replayed steps' in a StampRange
    comm: list | None = None
    # per step: (data requested, data ready, backward done) per micro-step, then optimizer done
    marks: list[list[Mark]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # Recorder.counters at the end


def breakdown(iv: Interval, clock: Clock) -> dict[str, float]:
    """Milliseconds per step in each part of the interval's steps; they tile the interval.

    On the compute stream's timeline (host time on CPU) each step is: [other] until the batch
    is asked for, [data_wait] until the stream may use it, [compute] forward and backward, per
    micro-step; then [optimizer] from the end of backward to the end of the step. Backward's
    end includes the stream's wait for the last gradient buckets: that share is
    [exposed_comm] (the reducer's marks), taken out of compute. What follows the last step's
    end up to the interval's end mark (the loss reduction) is other too.
    """
    ms = dict.fromkeys(PARTS, 0.0)
    prev = iv.start
    for step in iv.marks:
        *micro, done = step
        for asked, ready, backward in zip(micro[0::3], micro[1::3], micro[2::3], strict=True):
            ms["other"] += clock.elapsed_ms(prev, asked)
            ms["data_wait"] += clock.elapsed_ms(asked, ready)
            ms["compute"] += clock.elapsed_ms(ready, backward)
            prev = backward
        ms["optimizer"] += clock.elapsed_ms(prev, done)
        prev = done
    ms["other"] += clock.elapsed_ms(prev, iv.end)
    if iv.comm:
        ms["exposed_comm"] = exposed_ms(iv.comm, clock)
        ms["compute"] -= ms["exposed_comm"]
    elif iv.comm is not None:
        # A reducer that left no marks reduced inside replayed CUDA graphs on a GPU that could
        # not stamp them (mgpu.telemetry.stamps: no Triton): its exposed share is in compute,
        # unmeasured, and no figure is better than a zero.
        del ms["exposed_comm"]
    return {k: v / iv.steps for k, v in ms.items()}


def exposed_ms(marks: list[tuple[Mark, Mark] | StampRange], clock: Clock) -> float:
    """Total time the compute stream waited for gradient communication after backward: timed
    events per step launched from Python, the GPU's own stamps for replayed steps."""
    return sum(m.total_ms() if isinstance(m, StampRange) else clock.elapsed_ms(*m) for m in marks)
