"""The gradient buckets' memory layout: which parameters share one flat tensor (assign_buckets),
each parameter's slice of it (Bucket), and the flat per-dtype copies that buffers are broadcast
through (FlatBuffers). When and on which stream they are reduced is mgpu.comm.engine's."""

from __future__ import annotations

import torch
import torch.distributed as tdist
from torch import nn


class Bucket:
    """Parameters whose gradients live side by side in one flat tensor, reduced in one call; or
    one parameter whose gradient is reduced where it is (`own`)."""

    def __init__(
        self,
        index: int,
        params: list[nn.Parameter],
        reduce_dtype: torch.dtype | None,
        in_place: bool = True,
        pad_to: int = 1,
    ):
        self.index, self.params = index, params
        p0 = params[0]
        numel = sum(p.numel() for p in params)
        # A bucket of one row-major parameter is reduced in that parameter's own gradient, which
        # autograd makes row-major too: there is nothing to pack, and copying it in would read
        # and write what is often the model's largest gradient (GPT-2's tied embedding, 154 MB)
        # at the very end of backward, where nothing hides it.
        self.own = in_place and len(params) == 1 and p0.is_contiguous()
        # Padded with zeros to a multiple of `pad_to` (the world size, for mgpu.comm.shard's equal
        # reduce-scatter shards); the padding is never any parameter's and stays zero.
        padded = -(-numel // pad_to) * pad_to
        self.flat = None if self.own else torch.zeros(padded, dtype=p0.dtype, device=p0.device)
        # bf16 communication needs its own buffer: half the bytes on the wire, fp32 kept here.
        self.wire = None
        if reduce_dtype is not None and reduce_dtype != p0.dtype:
            self.wire = torch.empty(numel, dtype=reduce_dtype, device=p0.device)
        self.offsets, offset = [], 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self.pending = len(params)
        self.work = None
        # this step's fresh gradients, not yet copied into their slices (see GradReducer._flush)
        self.arrived: list[nn.Parameter] = []
        # Each parameter's slice, made once: _flush runs every step, and building 161 strided
        # views each time (ResNet-50) is host time on the step's critical path.
        self.views = (
            []
            if self.own
            else [slice_of(self.flat, p, off) for p, off in zip(params, self.offsets, strict=True)]
        )

    def tensor(self) -> torch.Tensor:
        """What the all-reduce averages: the flat bucket, or the one parameter's gradient."""
        return self.params[0].grad.view(-1) if self.own else self.flat

    def is_attached(self) -> bool:
        """Whether every .grad is where the all-reduce will read it: its slice of the bucket,
        or for a bucket of its own, any row-major gradient of the parameter's shape."""
        if self.own:
            grad = self.params[0].grad
            return grad is not None and grad.is_contiguous()
        base, size = self.flat.data_ptr(), self.flat.element_size()
        return all(
            p.grad is not None and p.grad.data_ptr() == base + off * size
            for p, off in zip(self.params, self.offsets, strict=True)
        )


def slice_of(flat: torch.Tensor, p: nn.Parameter, offset: int) -> torch.Tensor:
    """p's place in `flat` from `offset`, with the parameter's own strides (channels_last
    convolution weights included), as autograd's layout contract asks of gradients; any dense
    layout occupies exactly numel consecutive elements. Other layouts (a parameter that is a
    strided view of a bigger tensor) get contiguous slices, never ones that spill over."""
    dense = p.is_contiguous() or p.is_contiguous(memory_format=torch.channels_last)
    stride = p.stride() if dense else torch.empty(p.size(), device="meta").stride()
    return flat.as_strided(p.size(), stride, flat.storage_offset() + offset)


def assign_buckets(params: list[nn.Parameter], cap_bytes: int, first_cap_bytes: int):
    """Split params, in the order their gradients are expected, into buckets of at most
    `cap_bytes` (the first at most `first_cap_bytes`, so communication starts early in
    backward). A parameter larger than the cap gets a bucket of its own; a dtype change starts
    a new bucket, since a bucket is one flat tensor."""
    groups: list[list[nn.Parameter]] = []
    size = 0
    for p in params:
        nbytes = p.numel() * p.element_size()
        cap = first_cap_bytes if len(groups) == 1 else cap_bytes
        if not groups or groups[-1][0].dtype != p.dtype or size + nbytes > cap:
            if not groups or groups[-1]:
                groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return groups


class FlatBuffers:
    """Tensors (buffers every step; parameters too, once, at wrap time) packed into one flat
    tensor per dtype, kept, so that a broadcast is one collective per dtype with two
    multi-tensor copies around it and no allocation.

    Buffers (BatchNorm running statistics) follow rank 0's: with dist.broadcast_buffers they are
    broadcast on the communication stream right after the step's last gradient reduction, where the
    ranks have just met anyway, instead of at the next forward, which would add a second meeting
    point per step on the compute stream (one that waits for the slowest rank's host to launch it).
    The values the next forward sees are the ones a broadcast at its start would give; in addition,
    after the last step every rank holds rank 0's statistics."""

    def __init__(self, buffers: list[torch.Tensor]):
        self.buffers: list[list[torch.Tensor]] = []
        self.views: list[list[torch.Tensor]] = []
        self.flats: list[torch.Tensor] = []
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in buffers:
            by_dtype.setdefault(b.dtype, []).append(b)
        for group in by_dtype.values():
            flat = torch.empty(
                sum(b.numel() for b in group), dtype=group[0].dtype, device=group[0].device
            )
            views = torch.split(flat, [b.numel() for b in group])
            self.flats.append(flat)
            self.buffers.append([b.data for b in group])
            self.views.append([v.view(b.shape) for v, b in zip(views, group, strict=True)])

    def broadcast(self, group=None) -> None:
        """Rank 0's values into every rank's tensors, on the current stream."""
        for buffers, views, flat in zip(self.buffers, self.views, self.flats, strict=True):
            torch._foreach_copy_(views, buffers)
            tdist.broadcast(flat, src=0, group=group)
            # One multi-tensor copy back, not a kernel per tensor: ResNet-50 has 160 buffers.
            torch._foreach_copy_(buffers, views)
