"""The classification loss every model trains and evaluates with: cross-entropy over the last
dim, in fp32 (GPT's fused head computes the same loss its own way: mgpu.models.fused_loss)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"):
    """Classification loss over the last dim: [B, C] (images) and [B, T, V] (tokens) alike."""
    return F.cross_entropy(logits.flatten(0, -2).float(), targets.flatten(), reduction=reduction)
