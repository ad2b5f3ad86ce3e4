"""Gradient communication across ranks: how the model is wrapped for data parallelism
(`dist.engine`), and the switch that keeps non-final accumulation micro-steps local.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from mgpu.config import DistConfig, Engine
from mgpu.dist import Runtime

log = logging.getLogger(__name__)


def wrap_model(model: nn.Module, cfg: DistConfig, rt: Runtime) -> nn.Module:
    """Wrap for gradient averaging across ranks as `dist.engine` asks.

    A world of one has nothing to average, and `engine=none` trains each rank on its own (useful
    as the no-communication baseline of a scaling measurement).
    """
    if cfg.engine is Engine.none:
        return model
    if rt.world_size == 1 or not rt.has_process_group:
        log.info("world of one process: gradients are not communicated")
        return model
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    # DDP broadcasts rank 0's parameters and buffers here, so every rank starts identical.
    return DistributedDataParallel(model, device_ids=device_ids, bucket_cap_mb=cfg.bucket_cap_mb)


def local_module(model: nn.Module) -> nn.Module:
    """The module this rank runs, without the data-parallel wrapper (compiled if it was)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under the data-parallel and torch.compile wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def sync_gradients(model: nn.Module, enabled: bool) -> AbstractContextManager:
    """Enter around forward AND backward of a micro-step; `enabled=False` skips the all-reduce.

    Forward must be inside too: DDP decides during forward whether the coming backward reduces.
    """
    if enabled or not isinstance(model, DistributedDataParallel):
        return nullcontext()
    return model.no_sync()
