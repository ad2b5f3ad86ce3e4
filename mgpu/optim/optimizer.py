"""Optimizer and learning-rate schedule from `optim.*`: AdamW or SGD, decoupled weight decay on
matrices only, linear warmup then cosine decay, stepped once per optimizer step; and a resumed
run's optimizer and schedule, which keep this run's hyperparameters over the checkpoint's.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from mgpu.config.checks import ConfigError
from mgpu.config.schema import OptimConfig, OptimizerName


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices and embeddings; biases and norm scales (1-D) keep their size."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(cfg: OptimConfig, model: nn.Module, device: torch.device):
    groups = param_groups(model, cfg.weight_decay)
    if not any(group["params"] for group in groups):  # else autograd's words at the first step
        why = "has no parameters that require grad, so nothing to train; give it some, or "
        raise ConfigError("model", type(model).__name__, why + "unfreeze those it has")
    # Fused kernels update all parameters in a few launches and can skip an update on a device
    # flag (mgpu.train.guard): a non-finite step costs no host sync. CPU and CUDA run the same path.
    if cfg.name is OptimizerName.adamw:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    _zero_momentum(optimizer)
    return optimizer


def _zero_momentum(optimizer: torch.optim.Optimizer) -> None:
    """SGD with momentum: a zero buffer for every parameter that has none. The fused kernel
    fills the buffers it creates on the first step only if that step is not skipped; a skipped
    first step would leave them uninitialised. Zeros give the same first update (dampening 0:
    buffer = gradient)."""
    for group in optimizer.param_groups:
        if group.get("momentum"):
            for p in group["params"]:
                optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))


def lr_factor(step: int, warmup_steps: int, max_steps: int, min_ratio: float) -> float:
    """Multiplier of optim.lr before optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    span = max(1, max_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_schedule(cfg: OptimConfig, optimizer: torch.optim.Optimizer, max_steps: int) -> LambdaLR:
    return LambdaLR(
        optimizer, lambda s: lr_factor(s, cfg.warmup_steps, max_steps, cfg.min_lr_ratio)
    )


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings, everything but its parameters: taken from the optimizer
    as built from this run's config, before a checkpoint's state is loaded into it."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def keep_hyperparameters(
    optimizer: torch.optim.Optimizer, schedule: LambdaLR, built: list[dict]
) -> None:
    """After a checkpoint's optimizer and schedule state were loaded: this run's settings
    (`built`, hyperparameters() before the load) replace the checkpoint's, and the next step's
    rate is the schedule's at the checkpoint's step from this run's optim.lr. The checkpoint
    keeps the moments, the step counts and the schedule's step; the schedule's shape (warmup,
    decay, min lr, trainer.max_steps) was this run's already. With unchanged settings every
    value equals the one loaded, bit for bit (the same product LambdaLR computes)."""
    for group, own in zip(optimizer.param_groups, built, strict=True):
        group.update(own)
    base = [group["initial_lr"] for group in optimizer.param_groups]
    rates = [b * f(schedule.last_epoch) for b, f in zip(base, schedule.lr_lambdas, strict=True)]
    # Through the schedule's own state format: get_last_lr() is what the next step logs.
    schedule.load_state_dict({**schedule.state_dict(), "base_lrs": base, "_last_lr": rates})
    for group, rate in zip(optimizer.param_groups, rates, strict=True):
        group["lr"] = rate
    _zero_momentum(optimizer)  # optim.momentum turned on: its buffers start at zero
