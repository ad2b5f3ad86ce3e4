"""Training telemetry: step time from marks on the device's own timeline, the interval's loss
copied to the host without stalling, the time steps waited for data, and the values rank 0
publishes each log interval (to TensorBoard through mgpu.board, and to the console).

Nothing here waits on the GPU at the step it is recorded. An interval's numbers are published one
log interval later, when the GPU has long finished them, so logging never drains the GPU queue.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as tdist

from mgpu.dist import Runtime, all_reduce_sum_
from mgpu.goodput import Goodput
from mgpu.lagged import HostCopy

log = logging.getLogger(__name__)

Mark = torch.cuda.Event | float


class Board(Protocol):
    """Where the Recorder writes (mgpu.board.TensorBoard, which imports this module's PARTS)."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def flush(self) -> None: ...


# Seconds between rewrites of the goodput file at log steps (each is an fsync); checkpoints and
# the end of training write it too.
GOODPUT_SAVE_S = 30.0


# One tensor gathered from every rank into one: all_gather_single in newer torch, which
# deprecates all_gather_into_tensor; only the latter exists in torch 2.10 and 2.11.
_all_gather = getattr(tdist, "all_gather_single", None) or tdist.all_gather_into_tensor


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


def memory_scalars(device: torch.device) -> dict[str, float]:
    """The caching allocator's peaks since start and its retries (host counters: no sync)."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    gib = 2.0**30
    return {
        "memory/max_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / gib,
        "memory/max_reserved_gib": stats.get("reserved_bytes.all.peak", 0) / gib,
        "memory/alloc_retries": float(stats.get("num_alloc_retries", 0)),
    }


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
    comm: list[tuple[Mark, Mark]] | None = None  # per synchronised step: backward end, comm end
    # per step: (data requested, data ready, backward done) per micro-step, then optimizer done
    marks: list[list[Mark]] = field(default_factory=list)


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
    return {k: v / iv.steps for k, v in ms.items()}


class RankSpread:
    """Per-rank figures, gathered at each log step by one small all_gather that the host does
    not wait for: each exchange is read at the next log step (or at the end), when the GPU has
    long finished it. A collective: every rank calls exchange() and take() at the same points.
    """

    def __init__(self, rt: Runtime):
        self.rt = rt
        self.distributed = rt.distributed
        self.cuda = rt.device.type == "cuda"
        self.pending: deque = deque()

    def exchange(self, step: int, values: list[float]) -> None:
        if not self.distributed:
            self.pending.append((step, HostCopy(torch.tensor([values]))))
            return
        n, world = len(values), self.rt.world_size
        if not self.cuda:
            out = torch.empty(world * n, dtype=torch.float64)
            _all_gather(out, torch.tensor(values, dtype=torch.float64))
            self.pending.append((step, HostCopy(out.view(world, n))))
            return
        # Pinned staging both ways: a copy from pageable memory would wait for the stream.
        src = torch.tensor(values, dtype=torch.float64).pin_memory()
        mine = src.to(self.rt.device, non_blocking=True)
        out = torch.empty(world * n, dtype=torch.float64, device=self.rt.device)
        _all_gather(out, mine)  # queued behind this step's work, not awaited
        self.pending.append((step, HostCopy(out.view(world, n), keep=(src,))))  # src until read

    def take(self, everything: bool = False) -> list[tuple[int, list[list[float]]]]:
        """Exchanges issued before the latest one (all of them with `everything`)."""
        out = []
        while len(self.pending) > (0 if everything else 1):
            step, table = self.pending.popleft()
            out.append((step, table.read().tolist()))  # an exchange a log interval old
        return out


# What every rank reports at each log step: a slow loader shows in data wait, a slow or
# throttled GPU in compute (the other ranks wait for it in exposed communication instead).
SPREAD = ("step_ms", "data_wait_ms", "compute_ms")


def spread_scalars(table: list[list[float]], names: tuple[str, ...]) -> dict[str, float]:
    """min, median, max over ranks of each figure, and which rank had the max."""
    values = {}
    for i, name in enumerate(names):
        column = [row[i] for row in table]
        slowest = max(range(len(column)), key=column.__getitem__)
        values[f"ranks/{name}_min"] = min(column)
        values[f"ranks/{name}_median"] = statistics.median(column)
        values[f"ranks/{name}_max"] = column[slowest]
        values[f"ranks/{name}_slowest_rank"] = float(slowest)
    return values


def exposed_ms(marks: list[tuple[Mark, Mark]], clock: Clock) -> float:
    """Total time the compute stream waited for gradient communication after backward."""
    return sum(clock.elapsed_ms(start, end) for start, end in marks)


class Recorder:
    """Turns intervals of training into loss, learning rate, throughput and step time."""

    def __init__(
        self,
        rt: Runtime,
        board: Board,
        *,
        samples_per_step: int,
        tokens_per_sample: int | None,
        max_steps: int,
        comm_marks: Callable[[], list[tuple[Mark, Mark]]] | None = None,
        flops_per_sample: float | None = None,
        peak_tflops: float | None = None,
        goodput: Goodput | None = None,
    ):
        self.rt, self.board, self.clock = rt, board, Clock(rt.device)
        # Takes the reducer's (backward end, communication end) marks since the last call
        # (GradReducer.take_exposed): rank 0's own, like data wait.
        self.comm_marks = comm_marks
        self.samples_per_step = samples_per_step  # global: batch x accumulation x world
        self.tokens_per_sample = tokens_per_sample
        self.max_steps = max_steps
        self.flops_per_sample, self.peak_tflops = flops_per_sample, peak_tflops
        self.goodput = goodput
        self.spread = RankSpread(rt)
        self.timer = StepTimer(self.clock)  # the training loop marks each step's parts here
        self._saved_goodput = time.monotonic()

    def snapshot(
        self,
        step: int,
        steps: int,
        loss_sum: torch.Tensor,
        lr: float,
        start: Mark,
        data_wait: WaitSample | None = None,
        loss_scale: torch.Tensor | None = None,
    ) -> Interval:
        """Close an interval. A collective: every rank calls it at the same step.

        `loss_sum`: [summed loss, count] over the interval's steps that were not skipped as
        non-finite (the count is the same on every rank). `data_wait` is this rank's own (rank
        0's is what gets written): averaging it across ranks would need a collective at publish
        time, queued behind the current step. `loss_scale` (fp16): a device scalar, which
        rides the loss's copy to the host and is read an interval later (GradScaler.get_scale()
        would wait for every step queued so far).
        """
        sums = all_reduce_sum_(loss_sum.detach().clone(), self.rt)
        parts = [sums[0] / sums[1].clamp(min=1), sums[1] / self.rt.world_size]
        if loss_scale is not None:
            parts.append(loss_scale.to(sums.dtype).reshape(()))
        mean = torch.stack(parts)  # [loss, good steps(, loss scale)]
        end = self.clock.mark()
        # Backward (which makes the reducer's marks) has returned on this thread; read later.
        comm = self.comm_marks() if self.comm_marks is not None else None
        loss = HostCopy(mean)  # lands when the GPU gets here; read at publish
        return Interval(step, steps, lr, loss, start, end, data_wait, comm, self.timer.take())

    def publish(self, iv: Interval) -> None:
        """Write a closed interval. A collective (the rank spread): every rank calls it."""
        # A sync point, on an interval that ended a log interval ago. The loss is the mean over
        # ranks: the same on every rank.
        loss, good, *scale = iv.loss.read().tolist()
        step_ms = self.clock.elapsed_ms(iv.start, iv.end) / iv.steps
        values = {"train/lr": iv.lr, "time/step_ms": step_ms}
        if good > 0:  # an interval whose every step was skipped as non-finite has no loss
            values["train/loss"] = loss
        if scale:
            values["train/loss_scale"] = scale[0]
        values.update(self._throughput(step_ms))
        if iv.marks:
            for part, ms in breakdown(iv, self.clock).items():
                values[f"time/{part}_ms"] = ms
                values[f"time/{part}_pct"] = 100.0 * ms / step_ms
        elif iv.data_wait is not None:
            values["time/data_wait_ms"] = iv.data_wait.total_ms() / iv.steps
            values["time/data_wait_pct"] = 100.0 * values["time/data_wait_ms"] / step_ms
        if iv.data_wait is not None:
            values["time/data_host_wait_ms"] = iv.data_wait.host_s * 1e3 / iv.steps
        values.update(memory_scalars(self.rt.device))
        wait_ms = values.get("time/data_wait_ms", 0.0)
        self.spread.exchange(iv.step, [step_ms, wait_ms, values.get("time/compute_ms", 0.0)])
        for step, table in self.spread.take():
            self.board.scalars(step, spread_scalars(table, SPREAD))
        if self.goodput is not None:
            self.goodput.move_to_stall(wait_ms * iv.steps / 1e3)
            values.update(self.goodput.scalars())
            if time.monotonic() - self._saved_goodput > GOODPUT_SAVE_S:
                self.save_goodput()
        self.board.scalars(iv.step, values)
        if self.rt.is_primary:
            self._console(iv, values, good > 0)

    def _throughput(self, step_ms: float) -> dict[str, float]:
        world = self.rt.world_size
        samples_per_sec = self.samples_per_step / (step_ms / 1e3)
        values = {
            "throughput/samples_per_sec": samples_per_sec,
            "throughput/samples_per_sec_per_device": samples_per_sec / world,
        }
        if self.tokens_per_sample:
            tokens_per_sec = samples_per_sec * self.tokens_per_sample
            values["throughput/tokens_per_sec"] = tokens_per_sec
            values["throughput/tokens_per_sec_per_device"] = tokens_per_sec / world
        if self.flops_per_sample and self.peak_tflops:
            achieved = self.flops_per_sample * samples_per_sec / world
            values["throughput/tflops_per_device"] = achieved / 1e12
            values["throughput/mfu_pct"] = 100.0 * achieved / (self.peak_tflops * 1e12)
        return values

    def _console(self, iv: Interval, values: dict[str, float], has_loss: bool) -> None:
        if "throughput/tokens_per_sec" in values:
            rate = f"{values['throughput/tokens_per_sec']:,.0f} tokens/s"
        else:
            rate = f"{values['throughput/samples_per_sec']:,.0f} samples/s"
        if "throughput/mfu_pct" in values:
            rate += f" | MFU {values['throughput/mfu_pct']:.1f}%"
        waited = ""
        if "time/data_wait_pct" in values:
            waited = f" | data {values['time/data_wait_pct']:.1f}%"
        step_ms = values["time/step_ms"]
        eta = timedelta(seconds=round((self.max_steps - iv.step) * step_ms / 1e3))
        log.info(
            "step %d/%d | loss %s | lr %.2e | %s | %.1f ms/step%s | eta %s",
            iv.step,
            self.max_steps,
            f"{values['train/loss']:.4f}" if has_loss else "-",
            iv.lr,
            rate,
            step_ms,
            waited,
            eta,
        )

    def finish(self, step: int) -> None:
        """At the end of training, on every rank: the rank spread still in flight (a
        collective's result, read now), and goodput including the final eval and save."""
        for at, table in self.spread.take(everything=True):
            self.board.scalars(at, spread_scalars(table, SPREAD))
        if self.goodput is not None:
            self.board.scalars(step, self.goodput.scalars())
        self.save_goodput()

    def save_goodput(self) -> None:
        if self.goodput is not None:
            self.goodput.save()
            self._saved_goodput = time.monotonic()

    def skipped(self, step: int, total: int) -> None:
        """A step skipped as non-finite (learnt a couple of steps after it ran)."""
        self.board.scalars(step, {"train/skipped_steps": total})

    def flush(self) -> None:
        """Everything published so far onto disk (a checkpoint's step: what a restart keeps)."""
        self.board.flush()

    def eval_loss(self, step: int, loss: float) -> None:
        self.board.scalars(step, {"eval/loss": loss})
        if self.rt.is_primary:
            log.info("step %d/%d | eval loss %.4f", step, self.max_steps, loss)
