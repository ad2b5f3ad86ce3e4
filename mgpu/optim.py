"""Optimizer and learning-rate schedule from `optim.*`: AdamW or SGD, decoupled weight decay on
matrices only, linear warmup then cosine decay, stepped once per optimizer step.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from mgpu.config import OptimConfig, OptimizerName


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay weight matrices and embeddings; biases and norm scales (1-D) keep their size."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def build_optimizer(cfg: OptimConfig, model: nn.Module, device: torch.device):
    groups = param_groups(model, cfg.weight_decay)
    # Fused kernels update all parameters in a few launches and can skip an update on a device
    # flag (mgpu.guard): a non-finite step costs no host sync. CPU and CUDA run the same path.
    if cfg.name is OptimizerName.adamw:
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, fused=True)
    if cfg.momentum:
        # The fused kernel fills the momentum buffers it creates on the first step only if that
        # step is not skipped; a skipped first step would leave them uninitialised. Zeros give
        # the same first update (dampening 0: buffer = gradient).
        for p in (p for g in groups for p in g["params"]):
            optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p)
    return optimizer


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
