"""The training loop: one optimizer step over `grad_accum_steps` micro-batches under the chosen
precision, gradient clipping, periodic and final evaluation, when to record metrics, and when
all ranks save a checkpoint together (mgpu.resume says how) or stop on preemption.

Hot-loop rule: nothing here reads a GPU value on the host during training steps. The loss stays
on the device and is handed to the Recorder, which reads it a log interval later, with the step's
timing marks and the loader's data-wait meter; the step's agreement (mgpu.guard: the non-finite
verdict and the preemption flag, one collective) is read two steps late. Checkpoint steps are
the exception: saving reads everything back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_
from torch.utils.data import DataLoader

from mgpu import watchdog
from mgpu.checkpoint import Loaded
from mgpu.comm import MgpuDataParallel, local_module, sync_gradients, unwrap
from mgpu.config import Precision, TrainerConfig
from mgpu.dist import Runtime, all_reduce_sum_
from mgpu.goodput import Goodput
from mgpu.guard import NonFiniteGuard, fused
from mgpu.loader import DeviceLoader, epochs, to_device
from mgpu.metrics import Recorder, StepTimer
from mgpu.models import compile_mode
from mgpu.preempt import Preempted, Preemption
from mgpu.profiling import BACKWARD, DATA, FORWARD, OPTIMIZER, StepProfiler, phase
from mgpu.resume import CheckpointPlan, RunCheckpoints
from mgpu.shard import ShardedOptimizer

log = logging.getLogger(__name__)


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `trainer.precision`, or None for plain fp32."""
    if precision is Precision.auto:
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return {Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}.get(precision)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Classification loss over the last dim: [B, C] (images) and [B, T, V] (tokens) alike."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction)


def training_loss(cfg: TrainerConfig, device: torch.device, mode: str | None) -> Callable:
    """The training loss, compiled where trainer.compile is on. Eager, the fp32 upcast, log-softmax
    and their backward each make a pass over the logits; over GPT-2's 16x1024x50304 logits that
    is ~30 GB of memory traffic, about 10 ms a step on an H100. Compiled, they fuse into a pass or
    two. The loss region holds no parameters, so gradient buckets still launch as before."""
    if not cfg.compiles(device.type):
        return cross_entropy
    return torch.compile(cross_entropy, backend=cfg.compile_backend, mode=mode)


def set_math_modes(cfg: TrainerConfig, device: torch.device) -> None:
    """trainer.tf32 and trainer.cudnn_benchmark, for this process (torch keeps them globally)."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark


# clip_grad_norm_'s guard against a zero norm: the same clipping, to the last bit of the norm.
CLIP_EPS = 1e-6


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        rt: Runtime,
        *,
        recorder: Recorder | None = None,
        input_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        checkpoints: CheckpointPlan | None = None,
        preemption: Preemption | None = None,
        profiler: StepProfiler | None = None,
        goodput: Goodput | None = None,
    ):
        self.cfg, self.model, self.rt = cfg, model, rt
        self.profiler, self.goodput = profiler, goodput
        self.optimizer, self.schedule, self.recorder = optimizer, schedule, recorder
        self.preemption = preemption
        # Applied on the device to the inputs of a plain DataLoader given to fit/evaluate. A
        # DeviceLoader (what build_loader returns) applies its own, per data.device_transform.
        self.input_transform = input_transform
        self.amp_dtype = autocast_dtype(cfg.precision, rt.device)
        # The loss is compiled in the mode of the model it follows (CUDA graphs or not).
        ddp = isinstance(model, DistributedDataParallel)
        mode = compile_mode(cfg.compile_mode, cfg.compile_backend, unwrap(model), rt.device, ddp)
        self.loss_fn = training_loss(cfg, rt.device, mode)
        # fp16 gradients underflow without loss scaling; bf16 and fp32 don't need it.
        self.scaler = torch.amp.GradScaler(
            rt.device.type,
            init_scale=cfg.loss_scale_init,
            enabled=self.amp_dtype is torch.float16,
        )
        self.sharded = isinstance(optimizer, ShardedOptimizer)
        if self.sharded and self.scaler.is_enabled():
            raise ValueError(
                "dist.shard_optimizer=true does not support fp16 (trainer.precision=fp16, or auto "
                "on a GPU without bf16): its loss scaler would skip steps per shard. Use "
                "trainer.precision=bf16 or fp32, or dist.shard_optimizer=false"
            )
        self.ckpt = RunCheckpoints(checkpoints, cfg, rt, model, optimizer, schedule, self.scaler)
        self.channels_last = rt.device.type == "cuda" and getattr(
            unwrap(model), "channels_last", False
        )
        # Where this rank is, for hang reports; started by fit (trainer.stall_timeout_s).
        self.watch = watchdog.Watchdog(rt, cfg.stall_timeout_s)
        self.guard = NonFiniteGuard(
            cfg.nonfinite,
            cfg.max_consecutive_skips,
            rt,
            scaler_owns_grads=self.scaler.is_enabled(),
            # Wrapped for data parallelism: the ranks share their parameters and must agree.
            agree=isinstance(model, MgpuDataParallel | DistributedDataParallel),
            preemptible=preemption is not None,
            on_skip=recorder.skipped if recorder is not None else None,
        )
        # Where train_step marks the parts of each step for the Recorder's breakdown.
        self.timer = recorder.timer if recorder is not None else StepTimer(None)

    def _autocast(self) -> AbstractContextManager:
        return torch.autocast(
            self.rt.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
        )

    def _prepare(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A device batch in the layout the model wants. A host batch is moved here (on the
        current stream; to_device leaves tensors already on the device as they are)."""
        inputs, targets = to_device(batch, self.rt.device)
        if self.channels_last and inputs.dim() == 4:
            inputs = inputs.contiguous(memory_format=torch.channels_last)
        return inputs, targets

    def _device_batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """A DeviceLoader's batches as they come; a plain loader's moved and transformed here."""
        if isinstance(loader, DeviceLoader):
            yield from self._adopt(loader)
            return
        for batch in loader:
            inputs, targets = to_device(batch, self.rt.device)
            if self.input_transform is not None:
                inputs = self.input_transform(inputs)
            yield inputs, targets

    def _prefetcher(self, loader: DeviceLoader | DataLoader) -> tuple[DeviceLoader, bool]:
        """The loader to train from, and whether fit made it (and so must close it)."""
        if isinstance(loader, DeviceLoader):
            return self._adopt(loader), False
        prefetcher = DeviceLoader(loader, self.rt.device, transform=self.input_transform)
        return self._adopt(prefetcher), True

    def _adopt(self, loader: DeviceLoader) -> DeviceLoader:
        """Have the loader hand over inputs in the model's layout, converted on its side stream
        (the conversion in _prepare is then a no-op)."""
        if self.channels_last:
            loader.memory_format = torch.channels_last
        return loader

    def train_step(
        self, batches: Iterator[Any], step: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the mean loss and
        whether the step was skipped as non-finite, both device tensors (reading them on the
        host would stall the GPU queue).

        `batches` yields (inputs, targets) ready for the model, as a DeviceLoader gives them
        (on the device, input transform applied); host batches are moved, not transformed."""
        accum = self.cfg.grad_accum_steps
        # The step's marks for the Recorder's breakdown (metrics.breakdown): CUDA events on
        # the compute stream, read a log interval later; host time on CPU.
        timer = self.timer
        total = torch.zeros((), device=self.rt.device)
        watch = self.watch
        for micro in range(accum):
            watch.beat(step, watchdog.DATA)
            timer.data_asked()
            with phase(DATA):
                inputs, targets = self._prepare(next(batches))
            timer.data_ready()
            watch.beat(step, watchdog.STEP)
            # Gradients are averaged across ranks on the last micro-step only; the earlier
            # ones accumulate locally (forward and backward both inside the no-sync region).
            with sync_gradients(self.model, enabled=micro == accum - 1):
                with phase(FORWARD), self._autocast():
                    loss = self.loss_fn(self.model(inputs), targets)
                with phase(BACKWARD):
                    self.scaler.scale(loss / accum).backward()
            timer.backward_done()
            total += loss.detach()
        watch.beat(step, watchdog.UPDATE)
        with phase(OPTIMIZER):
            loss, bad = self._update(total / accum, step)
        timer.step_done()
        self.guard.poll()  # verdicts LAG steps old: raises under trainer.nonfinite=stop
        return loss, bad

    def loss_scale(self) -> torch.Tensor | None:
        """fp16's current loss scale as a device scalar (no host sync), else None: the scaler
        multiplies a one by its scale, through its public API."""
        if not self.scaler.is_enabled():
            return None
        return self.scaler.scale(torch.ones((), device=self.rt.device))

    def _stop_asked(self) -> bool:
        return self.preemption is not None and self.preemption.asked

    def _update(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, agree on finiteness, step the optimizer (or skip it) and the schedule."""
        if self.sharded:  # this rank's averaged shards; the norm sums every rank's (mgpu.shard)
            grads, norm = self.optimizer.shard_grads(), self.optimizer.grad_norm()
        else:
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if self.scaler.is_enabled():
            # fp16: overflowing gradients are the scaler's to skip. A non-finite loss (agreed
            # across ranks) poisons the gradients so that the scaler skips that step too, on
            # every rank alike, without a host read.
            bad = self.guard.check(step, loss, grads, None, self._stop_asked())
            if grads:
                grads[0].add_(torch.where(bad, float("nan"), 0.0))
            if self.cfg.grad_clip > 0:
                self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
                clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip, foreach=True)
            # GradScaler.step reads found-inf on the host unless the optimizer is fused (mgpu's
            # are): then no sync.
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            if not self.sharded:
                norm = torch.nn.utils.get_total_norm(grads, foreach=True) if grads else None
            scale = None
            if self.cfg.grad_clip > 0 and norm is not None:
                if fused(self.optimizer):
                    # Clipping rides in the fused update: its kernel divides each gradient by
                    # grad_scale as it reads it, so no pass over the gradients (and none of the
                    # host time that launches it) is spent on scaling them first.
                    scale = (norm + CLIP_EPS).div(self.cfg.grad_clip).clamp(min=1.0)
                else:
                    clip_grads_with_norm_(grads, self.cfg.grad_clip, norm, foreach=True)
            # A collective: every rank learns whether any rank's step went non-finite.
            bad = self.guard.check(step, loss, grads, norm, self._stop_asked())
            self.guard.step(self.optimizer, bad, grad_scale=scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss, bad

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> float:
        """Mean loss over every eval sample exactly once, summed across ranks."""
        # The module under DDP: eval forward must not take part in DDP's gradient bookkeeping.
        model = local_module(self.model)
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        step = self.watch.step
        for batch in self._device_batches(loader):
            self.watch.beat(step, watchdog.EVAL)
            inputs, targets = self._prepare(batch)
            with self._autocast():
                logits = model(inputs)
            sums[0] += cross_entropy(logits, targets, reduction="sum").double()
            sums[1] += targets.numel()
        model.train()
        self.watch.beat(step, watchdog.EVAL)
        all_reduce_sum_(sums, self.rt)
        total, count = sums.tolist()  # sync point: evaluation only, not the training loop
        return total / count

    def fit(self, train_loader: DeviceLoader | DataLoader, eval_loader: Iterable | None) -> None:
        cfg, rec, stop = self.cfg, self.recorder, self.preemption
        if self.start_step >= cfg.max_steps:
            log.info(
                "resumed at step %d, trainer.max_steps=%d: done", self.start_step, cfg.max_steps
            )
            return
        train, owned = self._prefetcher(train_loader)
        self.ckpt.check_resumable(train)
        train.wait.take()  # data wait counts from here
        batches = epochs(train, start=self.ckpt.start_cursor)
        self.model.train()
        self.ckpt.restore_rng(train)  # the last thing before the first step
        # The interval's summed loss over its good steps, and their count (skipped steps' losses
        # are NaN/inf and would hide the rest): on the device, read by the Recorder later.
        loss_sum = torch.zeros(2, device=self.rt.device)
        start, steps, pending = rec.clock.mark(), 0, None
        profiler, goodput = self.profiler, self.goodput
        try:
            self.watch.start()  # the stall clock and progress reports, until the end
            for step in range(self.start_step + 1, cfg.max_steps + 1):
                if profiler is not None:
                    profiler.begin_step(step)
                lr = self.schedule.get_last_lr()[0]
                loss, bad = self.train_step(batches, step)
                if goodput is not None and step == self.start_step + 1:
                    # From here on: the first step is where a compiled model compiles, so
                    # start-up includes it.
                    goodput.enter("training")
                loss_sum += torch.stack((torch.where(bad, 0.0, loss), (~bad).float()))
                steps += 1
                # Agreed in the step's exchange: True on every rank after the same step.
                stopping = self.guard.preempted
                last = step == cfg.max_steps
                save = self.ckpt.due(step, last or stopping)
                evaluate = eval_loader is not None and (
                    last or (cfg.eval_every > 0 and step % cfg.eval_every == 0 and not stopping)
                )
                # Saves close a log interval too, so a resumed run logs the same intervals as
                # an uninterrupted one.
                if step % cfg.log_every == 0 or last or evaluate or save:
                    self.watch.beat(step, watchdog.LOG)
                    wait = train.wait.take()  # GPU events in it are read at publish, not now
                    scale = self.loss_scale()
                    interval = rec.snapshot(step, steps, loss_sum, lr, start, wait, scale)
                    if pending is not None:
                        rec.publish(pending)  # the previous interval: its GPU work is done by now
                    pending, start, steps = interval, interval.end, 0
                    loss_sum = torch.zeros(2, device=self.rt.device)
                if evaluate or save:
                    # Now, not an interval later: the record is complete up to the step that is
                    # evaluated or saved (and a restart's purge_step starts right after it).
                    rec.publish(pending)
                    pending = None
                if evaluate:
                    self._enter("eval")  # the interval published above: its GPU work is done
                    rec.eval_loss(step, self.evaluate(eval_loader))
                if save:
                    # Every verdict up to this step, now: a non-finite step is never saved.
                    self.guard.settle()
                    self._enter("checkpoint")
                    self.watch.beat(step, watchdog.SAVE)
                    rec.flush()  # the record up to this step is on disk, as the checkpoint is
                    saved = self.save(step, train, required=last or stopping)
                    if saved is not None and goodput is not None:  # rank 0, the one that counts
                        goodput.checkpointed(step)
                    rec.save_goodput()
                if evaluate or save:
                    self._enter("training")
                    start = rec.clock.mark()  # neither is training step time
                if stopping and not last:
                    self.guard.settle()  # no exchange left running when the group goes
                    raise Preempted(step, stop.signum if stop is not None else None)
            self.guard.settle()
            if pending is not None:
                rec.publish(pending)
            rec.finish(cfg.max_steps)
        except Exception as err:
            if watchdog.is_timeout(err):
                raise self.watch.timed_out(err) from err
            raise
        finally:
            self.watch.stop()
            if profiler is not None:
                profiler.close()
            batches.close()  # ends the running epoch: in-flight batches retired, threads joined
            if owned:
                train.close()

    def _enter(self, category: str) -> None:
        if self.goodput is not None:
            self.goodput.enter(category)

    # ---- checkpoints (mgpu.resume) ----

    @property
    def start_step(self) -> int:
        return self.ckpt.start_step

    def save(self, step: int, loader: DeviceLoader | DataLoader, *, required: bool) -> Path | None:
        """Every rank together saves step `step` (RunCheckpoints.save). A collective."""
        return self.ckpt.save(step, loader, required=required)

    def resume(self, loaded: Loaded, loader: DeviceLoader | DataLoader) -> None:
        """Continue from a checkpoint (checkpoint.load's result for this rank)."""
        self.ckpt.resume(loaded, loader)
