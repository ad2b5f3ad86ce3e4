"""The training loop: one optimizer step over `grad_accum_steps` micro-batches under the chosen
precision, gradient clipping, periodic and final evaluation, and when to record metrics.

Hot-loop rule: nothing here reads a GPU value on the host during training steps. The loss stays
on the device and is handed to the Recorder, which reads it a log interval later; so does the
loader's data-wait meter.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from mgpu.comm import local_module, sync_gradients, unwrap
from mgpu.config import Precision, TrainerConfig
from mgpu.dist import Runtime, all_reduce_sum_
from mgpu.loader import DeviceLoader, epochs, to_device
from mgpu.metrics import Recorder

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
    ):
        self.cfg, self.model, self.rt = cfg, model, rt
        self.optimizer, self.schedule, self.recorder = optimizer, schedule, recorder
        # Applied on the device to the inputs of a plain DataLoader given to fit/evaluate. A
        # DeviceLoader (what build_loader returns) applies its own, per data.device_transform.
        self.input_transform = input_transform
        self.amp_dtype = autocast_dtype(cfg.precision, rt.device)
        # fp16 gradients underflow without loss scaling; bf16 and fp32 don't need it.
        self.scaler = torch.amp.GradScaler(rt.device.type, enabled=self.amp_dtype is torch.float16)
        self.channels_last = rt.device.type == "cuda" and getattr(
            unwrap(model), "channels_last", False
        )

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

    def train_step(self, batches: Iterator[Any]) -> torch.Tensor:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the mean loss
        as a device tensor (reading it on the host would stall the GPU queue).

        `batches` yields (inputs, targets) ready for the model, as a DeviceLoader gives them
        (on the device, input transform applied); host batches are moved, not transformed."""
        accum = self.cfg.grad_accum_steps
        total = torch.zeros((), device=self.rt.device)
        for micro in range(accum):
            inputs, targets = self._prepare(next(batches))
            # Gradients are averaged across ranks on the last micro-step only; the earlier
            # ones accumulate locally (forward and backward both inside the no-sync region).
            with sync_gradients(self.model, enabled=micro == accum - 1):
                with self._autocast():
                    loss = cross_entropy(self.model(inputs), targets)
                self.scaler.scale(loss / accum).backward()
            total += loss.detach()
        if self.cfg.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            torch.nn.utils.clip_grad_norm_(
                self.model.parameters(), self.cfg.grad_clip, foreach=True
            )
        # Under fp16, GradScaler.step reads found-inf on the host: a sync point torch's
        # scaler imposes once per step. bf16 and fp32 disable the scaler and skip it.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return total / accum

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> float:
        """Mean loss over every eval sample exactly once, summed across ranks."""
        # The module under DDP: eval forward must not take part in DDP's gradient bookkeeping.
        model = local_module(self.model)
        model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.rt.device)
        for batch in self._device_batches(loader):
            inputs, targets = self._prepare(batch)
            with self._autocast():
                logits = model(inputs)
            sums[0] += cross_entropy(logits, targets, reduction="sum").double()
            sums[1] += targets.numel()
        model.train()
        all_reduce_sum_(sums, self.rt)
        total, count = sums.tolist()  # sync point: evaluation only, not the training loop
        return total / count

    def fit(self, train_loader: DeviceLoader | DataLoader, eval_loader: Iterable | None) -> None:
        cfg, rec = self.cfg, self.recorder
        train, owned = self._prefetcher(train_loader)
        train.wait.take()  # data wait counts from here
        batches = epochs(train)
        self.model.train()
        loss_sum = torch.zeros((), device=self.rt.device)
        start, steps, pending = rec.clock.mark(), 0, None
        try:
            for step in range(1, cfg.max_steps + 1):
                lr = self.schedule.get_last_lr()[0]
                loss_sum += self.train_step(batches)
                steps += 1
                last = step == cfg.max_steps
                evaluate = eval_loader is not None and (
                    last or (cfg.eval_every > 0 and step % cfg.eval_every == 0)
                )
                if step % cfg.log_every == 0 or last or evaluate:
                    wait = train.wait.take()  # GPU events in it are read at publish, not now
                    interval = rec.snapshot(step, steps, loss_sum, lr, start, wait)
                    if pending is not None:
                        rec.publish(pending)  # the previous interval: its GPU work is done by now
                    pending, start, steps = interval, interval.end, 0
                    loss_sum = torch.zeros((), device=self.rt.device)
                if evaluate:
                    rec.publish(pending)
                    pending = None
                    rec.eval_loss(step, self.evaluate(eval_loader))
                    start = rec.clock.mark()  # evaluation time is not training step time
            if pending is not None:
                rec.publish(pending)
        finally:
            batches.close()  # ends the running epoch: in-flight batches retired, threads joined
            if owned:
                train.close()
