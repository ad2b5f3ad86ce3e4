"""Gradient communication across ranks, as `dist.engine` picks it: mgpu's own wrapper around its
reducer (mgpu.comm.reducer: buckets reduced on a communication stream during backward), torch's
DistributedDataParallel, or none; and the helpers that see through either wrapper.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel

from mgpu.comm.buckets import FlatBuffers
from mgpu.comm.reducer import GradReducer
from mgpu.config.schema import Compression, DistConfig, Engine
from mgpu.runtime.dist import Runtime

log = logging.getLogger(__name__)


class MgpuDataParallel(nn.Module):
    """`dist.engine=mgpu`: the user's module plus a GradReducer; `.module` is the module.
    `reducer_options`: GradReducer's measuring keywords."""

    def __init__(self, module: nn.Module, rt: Runtime, cfg: DistConfig, **reducer_options):
        super().__init__()
        self.module = module
        self.rt = rt
        # Every rank starts from rank 0's weights and buffers.
        if rt.distributed:
            FlatBuffers([*module.parameters(), *module.buffers()]).broadcast()
        self.reducer = GradReducer(module, rt, cfg, **reducer_options)
        # Which parameters train is fixed here (_same_trainable): kept as a list and flags, since
        # walking the module tree each forward took ~0.9 ms for ResNet-50 on a busy 2-core host,
        # reading its 161 flags ~30 us
        self._params = list(module.parameters())
        self._trainable = [p.requires_grad for p in self._params]

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.training:
            self._same_trainable()
            self.reducer.prepare()
        return self.module(*args, **kwargs)

    def _same_trainable(self) -> None:
        """The reducer averages the parameters that were trainable when it was built: one
        unfrozen since would train apart on each rank (its gradient never reduced, nor counted
        in the clipping norm over the buckets); one frozen since would be reported as unused,
        with advice (dist.find_unused) that does not fit.
        One read of each parameter's flag a forward, no GPU work."""
        now = [p.requires_grad for p in self._params]
        if now == self._trainable:
            return
        flags = list(zip(self._params, self._trainable, now, strict=True))
        unfrozen = [self.reducer.names[id(p)] for p, was, is_ in flags if is_ and not was]
        frozen = [self.reducer.names[id(p)] for p, was, is_ in flags if was and not is_]
        said = [f"now trainable: {', '.join(unfrozen)}"] if unfrozen else []
        said += [f"now frozen: {', '.join(frozen)}"] if frozen else []
        raise RuntimeError(
            "dist.engine=mgpu: parameters changed requires_grad after the model was wrapped for "
            f"data parallelism ({'; '.join(said)}); gradients are averaged across ranks for the "
            "parameters trainable when it was wrapped only. Set requires_grad on every "
            "parameter before training starts"
        )

    def use_large_buckets(self, whole: bool = False) -> None:
        """Buckets at dist.bucket_cap_mb's large size (DistConfig.bucket_cap), for a step
        replayed as CUDA graphs with the reductions inside (mgpu.train.graphs) or a model compiled
        `whole` that hands every gradient over at backward's end. Before any step."""
        self.reducer.use_large_buckets(whole)

    def grad_tensors(self) -> list[torch.Tensor] | None:
        """Every parameter's gradient exactly once, as the few tensors they live in (a bucket's
        flat tensor, or a parameter's own gradient), so that the step's global norm takes a
        handful of ops rather than a few per parameter (ResNet-50: 161 norms stacked, the
        largest host cost of its optimizer phase in the traces of bench/README.md, 2026-11-28
        12:44); None while any gradient is not in its bucket (before a step's backward), and
        under dist.shard_optimizer, whose buckets are padded (its own grad_norm sums shards)."""
        buckets = self.reducer.buckets
        if self.reducer.shards is not None or not all(b.is_attached() for b in buckets):
            return None
        return [b.tensor() for b in buckets]

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-steps inside accumulate into the buckets without communicating."""
        with self.reducer.no_sync():
            yield


def wrap_model(model: nn.Module, cfg: DistConfig, rt: Runtime) -> nn.Module:
    """Wrap for gradient averaging across ranks as `dist.engine` asks.

    A world of one has nothing to average, and `engine=none` trains each rank on its own (useful
    as the no-communication baseline of a scaling measurement). dist.shard_optimizer on a world
    of one still runs its sharded path, one shard per bucket (mgpu.comm.shard), so that its cost on
    one GPU can be measured and a one-process run trains the way its N-process run does.
    """
    if cfg.engine is Engine.none:
        return model
    if not rt.distributed:
        if cfg.engine is Engine.mgpu and cfg.shard_optimizer:
            log.info(
                "world of one process: dist.shard_optimizer=true has no one to shard with; its "
                "path runs with one shard per bucket and nothing communicated (only its overhead "
                "shows; set dist.shard_optimizer=false to train without it)"
            )
            return MgpuDataParallel(model, rt, cfg)
        log.info("world of one process: gradients are not communicated")
        return model
    if cfg.engine is Engine.mgpu:
        return MgpuDataParallel(model, rt, cfg)
    device_ids = [rt.device.index] if rt.device.type == "cuda" else None
    # DDP broadcasts rank 0's parameters and buffers here, so every rank starts identical.
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=cfg.bucket_cap(large=False),
        gradient_as_bucket_view=cfg.ddp_bucket_view,
        static_graph=cfg.ddp_static_graph,
        find_unused_parameters=cfg.find_unused,
        # Given only when off: syncing buffers is DDP's default, and torch 2.13 warns that the
        # argument is deprecated whenever it is given (its replacement, forward_sync_buffers,
        # still syncs at start when off, and torch 2.11 lacks it).
        **({} if cfg.broadcast_buffers else {"broadcast_buffers": False}),
    )
    if cfg.compression is Compression.powersgd:
        # The hook counts its own calls: one per optimizer step (no_sync micro-steps skip it).
        state = powerSGD.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank,
            start_powerSGD_iter=cfg.powersgd_start_step,
        )
        ddp.register_comm_hook(state, powerSGD.powerSGD_hook)
    return ddp


def local_module(model: nn.Module) -> nn.Module:
    """The module this rank runs, without the data-parallel wrapper (compiled if it was)."""
    if isinstance(model, (DistributedDataParallel, MgpuDataParallel)):
        return model.module
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module under the data-parallel and torch.compile wrappers."""
    while True:
        if isinstance(model, (DistributedDataParallel, MgpuDataParallel)):
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        else:
            return model


def sync_gradients(model: nn.Module, enabled: bool) -> AbstractContextManager:
    """Enter around forward AND backward of a micro-step; `enabled=False` skips the all-reduce.

    Forward must be inside too: DDP decides during forward whether the coming backward reduces.
    """
    if enabled or not isinstance(model, (DistributedDataParallel, MgpuDataParallel)):
        return nullcontext()
    return model.no_sync()
