"""The optimizer step that ends a training step, after the micro-batches' backward: fp16 loss
scaling (torch's GradScaler, or mgpu's LossScaler on gradient shards), gradient clipping, the
ranks' agreement on a non-finite step (mgpu.train.guard's one collective), stepping or skipping
the optimizer, and the schedule. Nothing here reads a GPU value on the host."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.utils import clip_grad_norm_, clip_grads_with_norm_

from mgpu.comm.sharded_optim import ShardedOptimizer
from mgpu.config.schema import TrainerConfig
from mgpu.optim.loss_scale import LossScaler
from mgpu.train.guard import NonFiniteGuard, fused
from mgpu.train.update_replay import UpdateGraph, replays_update

# clip_grad_norm_'s guard against a zero norm: the same clipping, to the last bit of the norm.
CLIP_EPS = 1e-6


def build_scaler(cfg: TrainerConfig, device: torch.device, amp_dtype, sharded: bool):
    """fp16 gradients underflow without loss scaling; bf16 and fp32 don't need it (the scaler is
    then disabled, a pass-through). Sharded, each rank sees only its shards' overflows: mgpu's
    LossScaler, whose verdict the ranks agree on (Update._clipped); else torch's GradScaler on
    the whole averaged gradients."""
    fp16 = amp_dtype is torch.float16
    if sharded:
        return LossScaler(device, init_scale=cfg.loss_scale_init, enabled=fp16)
    return torch.amp.GradScaler(device.type, init_scale=cfg.loss_scale_init, enabled=fp16)


class Update:
    """Clip, agree on finiteness, step the optimizer (or skip it) and the schedule: called once
    per optimizer step with the step's mean loss; returns it and the device flag `bad`."""

    def __init__(
        self,
        cfg: TrainerConfig,
        params: list[torch.nn.Parameter],
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        scaler,
        guard: NonFiniteGuard,
        stop_asked: Callable[[], int],
        grad_tensors: Callable[[], list[torch.Tensor] | None] | None = None,
        backward_replayed: Callable[[], bool] | None = None,
    ):
        self.grad_clip, self.params = cfg.grad_clip, params
        # The data-parallel wrapper's gradients as its few flat tensors, where it has them
        # (MgpuDataParallel.grad_tensors): the global norm over those is the same sum of squares
        # in a handful of ops instead of a few per parameter, each launched from the host.
        self.grad_tensors = grad_tensors
        self.optimizer, self.schedule, self.scaler, self.guard = optimizer, schedule, scaler, guard
        self.sharded = isinstance(optimizer, ShardedOptimizer)
        self.stop_asked = stop_asked  # this rank's reason to stop (guard.CTRL_C...): agreed
        # trainer.replay_update: device_step replayed as one CUDA graph (mgpu.train.
        # update_replay), where the step's backward is replayed with its reductions
        # (`backward_replayed`, None where it never is).
        replay = replays_update(
            cfg.replay_update,
            params[0].device if params else torch.device("cpu"),
            backward_replayed is not None,
            optimizer is not None and fused(optimizer),  # None: a Trainer that only evaluates
            self.sharded,
            scaler.is_enabled(),
        )
        self.replay = (
            UpdateGraph(self.device_step, optimizer, params, backward_replayed)
            if replay and backward_replayed is not None
            else None
        )

    def replayed(self) -> bool:
        """Whether the update now replays as a CUDA graph (trainer.replay_update)."""
        return self.replay is not None and self.replay.captured()

    def __call__(self, loss: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.scaler.is_enabled() and not self.sharded:
            bad = self._grad_scaler(loss, step)
        else:
            bad = self._clipped(loss, step)
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()
        return loss, bad

    def _grad_scaler(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """fp16 without sharding: torch's GradScaler on the averaged gradients, whole on every
        rank, so that each rank's own overflow check gives the same verdict."""
        grads = [p.grad for p in self.params if p.grad is not None]
        # Overflowing gradients are the scaler's to skip. A non-finite loss (agreed across
        # ranks) poisons the gradients so that the scaler skips that step too, on every rank
        # alike, without a host read.
        bad = self.guard.check(step, loss, grads, None, self.stop_asked())
        if grads:
            grads[0].add_(torch.where(bad, float("nan"), 0.0))
        if self.grad_clip > 0:
            self.scaler.unscale_(self.optimizer)  # clip true gradients, not scaled ones
            clip_grad_norm_(self.params, self.grad_clip, foreach=True)
        # GradScaler.step reads found-inf on the host unless the optimizer is fused (mgpu's
        # are): then no sync.
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return bad

    def _clipped(self, loss: torch.Tensor, step: int) -> torch.Tensor:
        """fp32 and bf16; and fp16 under dist.shard_optimizer, where the LossScaler unscales
        this rank's gradient shards and its overflow flag rides the norm's all-reduce, so that
        an overflow on any rank's shard skips the step (and lowers the scale) on every rank."""
        if not self.sharded:
            if self.replay is not None:  # the same work, replayed as one CUDA graph
                flags, bad = self.replay(loss, self.stop_asked())
            else:
                flags, bad = self.device_step(loss, self.stop_asked())
            self.guard.remember(step, flags)
            return bad
        grads = self.optimizer.shard_grads()  # this rank's averaged shards (comm.shard)
        overflow = self.scaler.unscale_(grads) if self.scaler.is_enabled() else None
        # One small all-reduce: the global norm, and the overflow flag agreed across ranks.
        norm, overflow = self.optimizer.grad_norm(overflow)
        scale = self._clip(grads, norm)
        # Under fp16 the agreement judges the loss only (scaler_owns_grads): an overflow is the
        # scaler's.
        bad = self.guard.check(step, loss, grads, norm, self.stop_asked())
        if overflow is None:
            self.guard.step(self.optimizer, bad, grad_scale=scale)
            return bad
        # fp16, sharded: skipped for a non-finite loss or an overflow on any rank, and the
        # scale lowered for either, as GradScaler does (a non-finite loss poisons its grads).
        skipped = bad | overflow
        self.guard.step(self.optimizer, skipped, grad_scale=scale)
        self.scaler.update(skipped)
        return bad

    def device_step(
        self, loss: torch.Tensor, stop: int | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Unsharded: the global norm, clipping, the ranks' agreement (one collective) and the
        optimizer step or its skip; returns the agreed flags and the verdict. Nothing in it
        reads a GPU value on the host, so that with a fused optimizer a CUDA graph can record
        it whole (mgpu.train.update_replay), `stop` then a device int."""
        grads = [p.grad for p in self.params if p.grad is not None]
        flat = self.grad_tensors() if self.grad_tensors is not None else None
        summed = flat or grads  # the same gradients, as few tensors where the wrapper has them
        norm = torch.nn.utils.get_total_norm(summed, foreach=True) if summed else None
        scale = self._clip(grads, norm)
        flags = self.guard.exchange(loss, norm, stop)  # every rank learns of a non-finite step
        bad = self.guard.verdict(flags)
        self.guard.step(self.optimizer, bad, grad_scale=scale)
        return flags, bad

    def _clip(self, grads: list[torch.Tensor], norm: torch.Tensor | None) -> torch.Tensor | None:
        """Clip to trainer.grad_clip: the factor a fused optimizer divides the gradients by as
        it reads them (returned), or, for any other optimizer, the gradients scaled in place."""
        if self.grad_clip <= 0 or norm is None:
            return None
        if fused(self.optimizer):
            # Clipping rides in the fused update: its kernel divides each gradient by
            # grad_scale as it reads it, so no pass over the gradients (and none of the host
            # time that launches it) is spent on scaling them first.
            return (norm + CLIP_EPS).div(self.grad_clip).clamp(min=1.0)
        clip_grads_with_norm_(grads, self.grad_clip, norm, foreach=True)
        return None
