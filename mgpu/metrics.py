"""Training telemetry: step time from marks on the device's own timeline, the interval's loss
copied to the host without stalling, and what rank 0 writes to TensorBoard and the console.

Nothing here waits on the GPU at the step it is recorded. An interval's numbers are published one
log interval later, when the GPU has long finished them, so logging never drains the GPU queue.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
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
    """Rank 0 writes event files into the run directory; every other rank writes nothing."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(run_dir))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def text(self, tag: str, body: str) -> None:
        if self.writer is not None:
            self.writer.add_text(tag, body)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


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
    ):
        self.rt, self.board, self.clock = rt, board, Clock(rt.device)
        self.samples_per_step = samples_per_step  # global: batch x accumulation x world
        self.tokens_per_sample = tokens_per_sample
        self.max_steps = max_steps

    def snapshot(
        self, step: int, steps: int, loss_sum: torch.Tensor, lr: float, start: Mark
    ) -> Interval:
        """Close an interval. A collective: every rank calls it at the same step."""
        mean = all_reduce_sum_(loss_sum.detach() / steps, self.rt) / self.rt.world_size
        end = self.clock.mark()
        if self.clock.cuda:
            host = torch.empty((), dtype=mean.dtype, pin_memory=True)
            host.copy_(mean, non_blocking=True)  # lands when the GPU gets here; read later
            copied = torch.cuda.Event()
            copied.record()
            return Interval(step, steps, lr, host, copied, start, end)
        return Interval(step, steps, lr, mean, None, start, end)

    def publish(self, iv: Interval) -> None:
        if iv.copied is not None:
            iv.copied.synchronize()  # sync point on an interval that ended a log interval ago
        step_ms = self.clock.elapsed_ms(iv.start, iv.end) / iv.steps
        loss = float(iv.loss)
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
        self.board.scalars(iv.step, values)
        if self.rt.is_primary:
            eta = timedelta(seconds=round((self.max_steps - iv.step) * step_ms / 1e3))
            log.info(
                "step %d/%d | loss %.4f | lr %.2e | %s | %.1f ms/step | eta %s",
                iv.step,
                self.max_steps,
                loss,
                iv.lr,
                rate,
                step_ms,
                eta,
            )

    def eval_loss(self, step: int, loss: float) -> None:
        self.board.scalars(step, {"eval/loss": loss})
        if self.rt.is_primary:
            log.info("step %d/%d | eval loss %.4f", step, self.max_steps, loss)
