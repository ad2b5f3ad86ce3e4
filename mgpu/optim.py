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
    if cfg.name is OptimizerName.adamw:
        # The fused kernel updates all parameters in a few launches; it exists on CUDA only.
        return torch.optim.AdamW(
            groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=device.type == "cuda"
        )
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum)


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
