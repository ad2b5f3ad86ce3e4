"""Training telemetry: step time from marks on the device's own timeline, the interval's loss
copied to the host without stalling, the time steps waited for data, and the values rank 0
publishes each log interval (to TensorBoard through mgpu.telemetry.board, and to the console).

Nothing here waits on the GPU at the step it is recorded. An interval's numbers are published one
log interval later, when the GPU has long finished them, so logging never drains the GPU queue.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

import torch

from mgpu.runtime.dist import Runtime, all_gather_single, all_reduce_sum_
from mgpu.telemetry.goodput import Goodput
from mgpu.telemetry.lagged import HostCopy
from mgpu.telemetry.timing import (
    Clock,
    Interval,
    Mark,
    StepTimer,
    WaitSample,
    breakdown,
)

log = logging.getLogger(__name__)


class Board(Protocol):
    """Where the Recorder writes (mgpu.telemetry.board.TensorBoard)."""

    def scalars(self, step: int, values: dict[str, float]) -> None: ...
    def flush(self) -> None: ...


# Seconds between rewrites of the goodput file at log steps (each is an fsync); checkpoints and
# the end of training write it too.
GOODPUT_SAVE_S = 30.0


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
            all_gather_single(out, torch.tensor(values, dtype=torch.float64))
            self.pending.append((step, HostCopy(out.view(world, n))))
            return
        # Pinned staging both ways: a copy from pageable memory would wait for the stream.
        src = torch.tensor(values, dtype=torch.float64).pin_memory()
        mine = src.to(self.rt.device, non_blocking=True)
        out = torch.empty(world * n, dtype=torch.float64, device=self.rt.device)
        all_gather_single(out, mine)  # queued behind this step's work, not awaited
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
        comm_marks: Callable[[], list] | None = None,
        flops_per_sample: float | None = None,
        peak_tflops: float | None = None,
        goodput: Goodput | None = None,
        counters: Callable[[], dict[str, float]] | None = None,
    ):
        self.rt, self.board, self.clock = rt, board, Clock(rt.device)
        # Host counters published with every record, as they stand (the training set's own,
        # e.g. image_folder's data/bad_files_replaced): summed over ranks, riding the rank
        # spread's exchange (so written a log interval later, at the step they were read).
        self.counters = counters
        self._counter_names: list[str] = []
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
        self.begin()

    # ---- the open interval, on the device until it is closed ----

    def begin(self) -> None:
        """Start counting: at the start of fit."""
        # The interval's summed loss over its good steps, and their count (skipped steps'
        # losses are NaN/inf and would hide the rest).
        self._loss_sum = torch.zeros(2, device=self.rt.device)
        self._steps, self._start = 0, self.clock.mark()
        self._pending: Interval | None = None  # closed, published at the next close

    def step(self, loss: torch.Tensor, bad: torch.Tensor) -> None:
        """A training step's mean loss and whether it was skipped (device tensors: no sync)."""
        self._loss_sum += torch.stack((torch.where(bad, 0.0, loss), (~bad).float()))
        self._steps += 1

    def close_interval(
        self,
        step: int,
        lr: float,
        data_wait: WaitSample | None,
        loss_scale: torch.Tensor | None = None,
    ) -> None:
        """Close the open interval at `step` and publish the one before it, whose GPU work is
        done by now. A collective: every rank calls it at the same step."""
        interval = self.snapshot(
            step, self._steps, self._loss_sum, lr, self._start, data_wait, loss_scale
        )
        self.publish_pending(now=step)
        self._pending, self._start, self._steps = interval, interval.end, 0
        self._loss_sum = torch.zeros(2, device=self.rt.device)

    def publish_pending(self, now: int | None = None) -> None:
        """Publish the last closed interval now (before an evaluation or a save, and at the
        end), not at the next close. `now`: the step training has reached (the interval's own
        by default), from which the console's eta counts. A collective."""
        if self._pending is not None:
            self.publish(self._pending, self._pending.step if now is None else now)
            self._pending = None

    def restart_clock(self) -> None:
        """What ran since the last close (evaluation, a save) is not training step time."""
        self._start = self.clock.mark()

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
        counters = self.counters() if self.counters is not None else {}  # as at this step
        marks = self.timer.take()
        return Interval(step, steps, lr, loss, start, end, data_wait, comm, marks, counters)

    def publish(self, iv: Interval, now: int | None = None) -> None:
        """Write a closed interval. A collective (the rank spread): every rank calls it. `now`:
        the step training has reached (an interval is published one log interval late)."""
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
            if iv.comm and "time/exposed_comm_ms" in values:
                # The step against its own estimate without communication: the same step less
                # the time the compute stream waited for the last gradient buckets. What NCCL's
                # kernels take from backward's while they overlap is not in it (a lower bound
                # on the cost of data parallelism, not the whole of it).
                exposed = values["time/exposed_comm_ms"]
                values["time/no_comm_efficiency"] = (step_ms - exposed) / step_ms
        elif iv.data_wait is not None:
            values["time/data_wait_ms"] = iv.data_wait.total_ms() / iv.steps
            values["time/data_wait_pct"] = 100.0 * values["time/data_wait_ms"] / step_ms
        if iv.data_wait is not None:
            values["time/data_host_wait_ms"] = iv.data_wait.host_s * 1e3 / iv.steps
        values.update(memory_scalars(self.rt.device))
        wait_ms = values.get("time/data_wait_ms", 0.0)
        mine = [step_ms, wait_ms, values.get("time/compute_ms", 0.0)]
        self._counter_names = list(iv.counters)  # the same names, in order, on every rank
        self.spread.exchange(iv.step, mine + list(iv.counters.values()))
        for step, table in self.spread.take():
            self._write_spread(step, table)
        if self.goodput is not None:
            self.goodput.move_to_stall(wait_ms * iv.steps / 1e3)
            values.update(self.goodput.scalars())
            if time.monotonic() - self._saved_goodput > GOODPUT_SAVE_S:
                self.save_goodput()
        self.board.scalars(iv.step, values)
        if self.rt.is_primary:
            self._console(iv, values, good > 0, iv.step if now is None else now)

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

    def _console(self, iv: Interval, values: dict[str, float], has_loss: bool, now: int) -> None:
        if "throughput/tokens_per_sec" in values:
            rate = f"{values['throughput/tokens_per_sec']:,.0f} tokens/s"
        else:
            rate = f"{values['throughput/samples_per_sec']:,.0f} samples/s"
        if "throughput/mfu_pct" in values:
            rate += f" | MFU {values['throughput/mfu_pct']:.1f}%"
        waited = ""
        if "time/data_wait_pct" in values:
            waited = f" | data {values['time/data_wait_pct']:.1f}%"
        if "time/no_comm_efficiency" in values:  # several processes, their exposed share measured
            waited += (
                f" | comm {values['time/exposed_comm_ms']:.1f} ms exposed, "
                f"{values['time/no_comm_efficiency']:.3f} of no-comm"
            )
        step_ms = values["time/step_ms"]
        # From the step reached, not the interval's: the line comes a log interval late
        eta = timedelta(seconds=round((self.max_steps - now) * step_ms / 1e3))
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
            self._write_spread(at, table)
        if self.goodput is not None:
            self.board.scalars(step, self.goodput.scalars())
        self.save_goodput()

    def _write_spread(self, step: int, table: list[list[float]]) -> None:
        """An exchange's rank spread, and its counters summed over ranks."""
        values = spread_scalars(table, SPREAD)
        for k, name in enumerate(self._counter_names, start=len(SPREAD)):
            values[name] = sum(row[k] for row in table)
        self.board.scalars(step, values)

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
