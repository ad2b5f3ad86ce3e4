"""`dist.shard_optimizer=true`: the optimizer sharded across data-parallel ranks (ZeRO-1) inside
mgpu's reducer. Each gradient bucket is reduce-scattered (averaged) instead of all-reduced, each
rank steps only its 1/N of every bucket with the user's optimizer (AdamW, Adam or SGD) on flat
shards and keeps optimizer state for those only, and the updated shards are all-gathered back
into the parameters, which live in flat per-bucket tensors from then on. Checkpoints hold the
optimizer state in the unsharded format (ShardedOptimizer.state_dict gathers it), so a run
saved on N processes resumes on M, sharded or not.

Stream rules (CUDA), added to mgpu.comm.engine's:
1. A bucket's reduce-scatter is launched where its all-reduce would be (comm rule 1): on the
   communication stream after an event of the compute stream. It reads the bucket and writes
   this rank's gradient shard; both are allocated once per layout and never freed while they
   may be in flight (the reducer's wait at the end of backward, comm rule 2, covers both).
2. ShardedOptimizer.step updates the parameter shards on the compute stream, then the
   communication stream waits on an event recorded after the update and all-gathers every
   bucket, last bucket first (the first layers' parameters are in the last buckets: the next
   forward needs them first). The all-gathers write the parameters' own memory.
3. The compute stream waits for all the all-gathers at once (not per bucket) before anything
   reads a parameter again: at the start of the next forward of the module (a forward pre-hook,
   so evaluation too), before its state_dict (a pre-hook) and before the next optimizer step,
   which writes the parameter shards the all-gathers read. The host does not wait on CUDA.
4. The layout is made once, at wrap time, in the reducer's assumed gradient order (reverse
   registration): under sharding the reducer does not rebuild its buckets in the observed order,
   so that a resumed run steps the same shards as an uninterrupted one (the CPU's fused kernels
   round a piece's vectorised body and its tail apart, and the clipping norm is summed shard by
   shard: another split is another rounding). A bucket that waits for a late gradient launches
   later; the results are the same.
On CPU (gloo) the same waits block the host instead.

A world of one (`python train.py`, or torchrun with one process) runs the same path with nothing
to communicate: its one shard of a bucket is the whole bucket, whose gradient is the bucket's
own memory (no reduce-scatter), and the updated parameters are already in place (no
all-gather). What is left is the path's own cost: every gradient packed into its bucket, the
optimizer stepping flat pieces, the hooks; bench/vs_plain.py with dist.shard_optimizer=true
measures it on one GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn

from mgpu.comm.buckets import Bucket, slice_of
from mgpu.runtime.dist import all_gather_single, reduce_scatter_single


class BucketShard:
    """One bucket's parameters in a flat tensor (padded like the bucket) and this rank's part:
    [lo, lo + size) of the flat, the parameter shard the optimizer steps, and the gradient shard
    the reduce-scatter writes."""

    def __init__(self, bucket: Bucket, rank: int, world: int, wire: torch.dtype | None):
        self.bucket, self.params, self.offsets = bucket, bucket.params, bucket.offsets
        p0 = self.params[0]
        self.full = torch.zeros_like(bucket.flat, dtype=p0.dtype)
        for p, off in zip(self.params, self.offsets, strict=True):
            view = slice_of(self.full, p, off)
            view.copy_(p.data)
            p.data = view  # the all-gather writes the parameters in place
        self.size = self.full.numel() // world
        self.lo = rank * self.size
        # A view: what the optimizer steps is the parameters' own memory, so a write to the
        # parameters (a checkpoint's load_state_dict) is what it steps next; the all-gather
        # is in place (this rank's input is its own part of the output).
        self.param = self.full[self.lo : self.lo + self.size]
        # A world of one averages nothing: its one gradient shard is the bucket itself.
        self.grad = bucket.flat
        if world > 1:
            self.grad = torch.zeros_like(self.param, dtype=bucket.flat.dtype)
        # bf16 on the wire: the bucket is copied into wire_in, the shard lands in wire_out
        self.wire_in = self.wire_out = None
        if world > 1 and wire is not None and wire != bucket.flat.dtype:
            self.wire_in = torch.empty_like(bucket.flat, dtype=wire)
            self.wire_out = torch.empty_like(self.grad, dtype=wire)


class _Landing:
    """A reduce-scatter in flight (None: a world of one, nothing in flight); wait() also copies
    a bf16 shard into the fp32 gradient shard (on the current stream: the communication stream,
    in the reducer's wait)."""

    def __init__(self, work, shard: BucketShard):
        self.work, self.shard = work, shard

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()
        if self.shard.wire_out is not None:
            self.shard.grad.copy_(self.shard.wire_out)


class Shards:
    """The reducer's side of sharding: the layout of every bucket's shards, the reduce-scatter
    of a bucket, and the all-gather of the updated parameters (stream rules: module docstring)."""

    def __init__(self, module: nn.Module, rt, group, stream, reduce_dtype: torch.dtype | None):
        self.rt, self.group, self.stream = rt, group, stream
        self.world, self.rank = rt.world_size, rt.rank
        self.op = tdist.ReduceOp.AVG if rt.backend == "nccl" else tdist.ReduceOp.SUM
        self.wire = reduce_dtype
        self.layout: list[BucketShard] = []
        self.gathers: list = []  # all-gathers in flight
        # Every reader of the parameters through the module waits for them (rule 3).
        self._hooks = [
            module.register_forward_pre_hook(lambda *_: self.wait_params()),
            module.register_state_dict_pre_hook(lambda *_: self.wait_params()),
        ]

    def build(self, buckets: list[Bucket]) -> None:
        """The layout for these buckets, once (rule 4); the parameters move into its flat tensors
        with their current values."""
        if self.layout:
            raise RuntimeError(
                "mgpu.comm.shard: the buckets of a sharded optimizer are laid out once"
            )
        self.layout = [BucketShard(b, self.rank, self.world, self.wire) for b in buckets]

    def reduce_scatter(self, bucket: Bucket) -> _Landing:
        """Launch the bucket's averaging into this rank's gradient shard (on the current
        stream); the reducer waits for the returned work at the end of backward."""
        shard = self.layout[bucket.index]
        if self.world == 1:
            return _Landing(None, shard)  # the gradient shard is the bucket: nothing to do
        src, dst = bucket.flat, shard.grad
        if shard.wire_in is not None:
            shard.wire_in.copy_(src)
            src, dst = shard.wire_in, shard.wire_out
        if self.op is tdist.ReduceOp.SUM:
            src.div_(self.world)  # gloo has no average: divide first, as the all-reduce does
        work = reduce_scatter_single(dst, src, op=self.op, group=self.group, async_op=True)
        return _Landing(work, shard)

    def gather(self) -> None:
        """Launch the all-gathers of the updated parameter shards (rule 2)."""
        if self.world == 1:
            return  # the one shard is the whole parameters, updated in place
        if self.stream is None:
            self.gathers = [self._all_gather(s) for s in reversed(self.layout)]
            return
        updated = torch.cuda.Event()
        updated.record()
        self.stream.wait_event(updated)
        with torch.cuda.stream(self.stream):
            self.gathers = [self._all_gather(s) for s in reversed(self.layout)]

    def _all_gather(self, shard: BucketShard):
        group = self.group
        return all_gather_single(shard.full, shard.param, group=group, async_op=True)

    def gather_flat(self, full: torch.Tensor, local: torch.Tensor) -> None:
        """Every rank's `local` (its part of a bucket-shaped tensor) into `full`, blocking: for
        checkpoints, not the training loop."""
        if self.world == 1:
            full.copy_(local)
        else:
            all_gather_single(full, local, group=self.group)

    def gather_object(self, obj) -> list:
        """Every rank's picklable `obj`, in rank order (a host sync; checkpoints only)."""
        everyone = [obj] * self.world
        if self.world > 1:
            tdist.all_gather_object(everyone, obj, group=self.group)
        return everyone

    def wait_params(self) -> None:
        """The current stream (CUDA) or the host (CPU) waits for the all-gathers (rule 3)."""
        if not self.gathers:
            return
        if self.stream is None:
            for work in self.gathers:
                work.wait()
        else:
            with torch.cuda.stream(self.stream):
                for work in self.gathers:
                    work.wait()
            torch.cuda.current_stream().wait_stream(self.stream)
        self.gathers = []

    def grad_norm(
        self, overflow: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The global L2 norm of the averaged gradients: each rank's shards' squared norm, summed
        across ranks in one small all-reduce (the same value on every rank). `overflow` (fp16: a
        device flag, nonzero where this rank's shards held inf/NaN) rides the same all-reduce;
        returned as a bool that is True on every rank if it was set on any, else None. Queued on
        the current stream; the host does not wait."""
        grads = [s.grad for s in self.layout]
        squares = torch.stack(torch._foreach_norm(grads)).float().square().sum()
        if overflow is None:
            if self.world > 1:
                tdist.all_reduce(squares, group=self.group)
            return squares.sqrt(), None
        both = torch.stack((squares, overflow.float().reshape(())))
        if self.world > 1:
            tdist.all_reduce(both, group=self.group)
        return both[0].sqrt(), both[1] > 0


def sharding(cfg, module: nn.Module, rt, group, stream, reduce_dtype) -> Shards | None:
    """The reducer's Shards where dist.shard_optimizer is on (cfg: the DistConfig), else None."""
    return Shards(module, rt, group, stream, reduce_dtype) if cfg.shard_optimizer else None
