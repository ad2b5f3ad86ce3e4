"""Training telemetry: step time from marks on the device's own timeline, the interval's loss
copied to the host without stalling, the time steps waited for data, and what rank 0 writes to
TensorBoard and the console.

Nothing here waits on the GPU at the step it is recorded. An interval's numbers are published one
log interval later, when the GPU has long finished them, so logging never drains the GPU queue.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch

from mgpu.dist import Runtime, all_reduce_sum_

log = logging.getLogger(__name__)

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


class TensorBoard:
    """Rank 0 writes event files into the run directory; every other rank writes nothing.

    `purge_step`: a resumed run's first step. TensorBoard then drops what earlier event files in
    the directory hold from that step on (steps an interrupted attempt logged after its last
    checkpoint), so each step shows once, with the value of the run that continued.
    """

    def __init__(self, run_dir: Path, enabled: bool, purge_step: int | None = None):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, body: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, body)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


class NonFiniteLoss(RuntimeError):
    """The training loss read back is NaN or infinite; training stops before any further save."""


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
    loss: torch.Tensor  # host tensor, filled by a copy that may still be in flight
    copied: torch.cuda.Event | None
    start: Mark
    end: Mark
    data_wait: WaitSample | None = None
    comm: list[tuple[Mark, Mark]] | None = None  # per synchronised step: backward end, comm end


def exposed_ms(marks: list[tuple[Mark, Mark]], clock: Clock) -> float:
    """Total time the compute stream waited for gradient communication after backward."""
    return sum(clock.elapsed_ms(start, end) for start, end in marks)


class Recorder:
    """Turns intervals of training into loss, learning rate, throughput and step time."""

    def __init__(
        self,
        rt: Runtime,
        board: TensorBoard,
        *,
        samples_per_step: int,
        tokens_per_sample: int | None,
        max_steps: int,
        comm_marks: deque | None = None,
    ):
        self.rt, self.board, self.clock = rt, board, Clock(rt.device)
        # The reducer's (backward end, communication end) marks: rank 0's own, like data wait.
        self.comm_marks = comm_marks
        self.samples_per_step = samples_per_step  # global: batch x accumulation x world
        self.tokens_per_sample = tokens_per_sample
        self.max_steps = max_steps

    def snapshot(
        self,
        step: int,
        steps: int,
        loss_sum: torch.Tensor,
        lr: float,
        start: Mark,
        data_wait: WaitSample | None = None,
    ) -> Interval:
        """Close an interval. A collective: every rank calls it at the same step.

        `data_wait` is this rank's own (rank 0's is what gets written): averaging it across
        ranks would need a collective at publish time, queued behind the current step.
        """
        mean = all_reduce_sum_(loss_sum.detach() / steps, self.rt) / self.rt.world_size
        end = self.clock.mark()
        comm = None
        if self.comm_marks is not None:
            # backward (which appends these) has returned on this thread; events read later
            comm = list(self.comm_marks)
            self.comm_marks.clear()
        if self.clock.cuda:
            host = torch.empty((), dtype=mean.dtype, pin_memory=True)
            host.copy_(mean, non_blocking=True)  # lands when the GPU gets here; read later
            copied = torch.cuda.Event()
            copied.record()
            return Interval(step, steps, lr, host, copied, start, end, data_wait, comm)
        return Interval(step, steps, lr, mean, None, start, end, data_wait, comm)

    def publish(self, iv: Interval) -> None:
        if iv.copied is not None:
            iv.copied.synchronize()  # sync point on an interval that ended a log interval ago
        step_ms = self.clock.elapsed_ms(iv.start, iv.end) / iv.steps
        loss = float(iv.loss)  # the mean over ranks: every rank reads the same value
        samples_per_sec = self.samples_per_step / (step_ms / 1e3)
        values = {
            "train/loss": loss,
            "train/lr": iv.lr,
            "time/step_ms": step_ms,
            "throughput/samples_per_sec": samples_per_sec,
            "throughput/samples_per_sec_per_device": samples_per_sec / self.rt.world_size,
        }
        rate = f"{samples_per_sec:,.0f} samples/s"
        if self.tokens_per_sample:
            tokens_per_sec = samples_per_sec * self.tokens_per_sample
            values["throughput/tokens_per_sec"] = tokens_per_sec
            values["throughput/tokens_per_sec_per_device"] = tokens_per_sec / self.rt.world_size
            rate = f"{tokens_per_sec:,.0f} tokens/s"
        waited = ""
        if iv.data_wait is not None:
            wait_ms = iv.data_wait.total_ms() / iv.steps
            values["time/data_wait_ms"] = wait_ms
            values["time/data_wait_pct"] = 100.0 * wait_ms / step_ms
            values["time/data_host_wait_ms"] = iv.data_wait.host_s * 1e3 / iv.steps
            waited = f" | data {values['time/data_wait_pct']:.1f}%"
        if iv.comm is not None:
            comm_ms = exposed_ms(iv.comm, self.clock) / iv.steps
            values["time/exposed_comm_ms"] = comm_ms
            values["time/exposed_comm_pct"] = 100.0 * comm_ms / step_ms
        self.board.scalars(iv.step, values)
        if not math.isfinite(loss):
            self.board.flush()
            first = iv.step - iv.steps + 1
            over = f" (the mean over steps {first}-{iv.step})" if iv.steps > 1 else ""
            raise NonFiniteLoss(
                f"training loss is {loss} at step {iv.step}{over}: stopping, with no checkpoint "
                "saved after it. Resume from the last checkpoint with a lower optim.lr, or "
                "trainer.grad_clip; trainer.log_every=1 names the first bad step"
            )
        if self.rt.is_primary:
            eta = timedelta(seconds=round((self.max_steps - iv.step) * step_ms / 1e3))
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | %s | %.1f ms/step%s | eta %s",
                iv.step,
                self.max_steps,
                loss,
                iv.lr,
                rate,
                step_ms,
                waited,
                eta,
            )

    def flush(self) -> None:
        """Everything published so far onto disk (a checkpoint's step: what a restart keeps)."""
        self.board.flush()

    def eval_loss(self, step: int, loss: float) -> None:
        self.board.scalars(step, {"eval/loss": loss})
        if self.rt.is_primary:
            log.info("step %d/%d | eval loss %.4f", step, self.max_steps, loss)
