"""The output head's matrix multiply and its cross-entropy as one autograd step
(`linear_cross_entropy`), with one Triton kernel for the loss and its gradient on CUDA.

Why: GPT-2's head scores 16x1024 positions against 50304 tokens, 1.65 GB of bf16 logits a step.
Compiled, the usual loss reads them once in forward, then reads them again and writes their
gradient in backward (~5 GB of traffic). Here one kernel reads each row of logits, takes its
log-sum-exp, and writes the row's gradient over a second read that L2 partly serves (eviction
hints keep the row there while the gradient streams out), during forward; backward is then
just the two matrix multiplies of the head, scaled by the incoming gradient, and the logits are
not kept for it. Measured in bench/README.md.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it add no loss and no gradient


def _loss_grad_reference(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's loss (fp32) and d(sum of row losses)/d(logits) = softmax - one_hot, in the
    logits' dtype; rows whose target is IGNORE_INDEX get 0 and 0. Plain torch: every device."""
    x = logits.float()
    lse = torch.logsumexp(x, dim=-1)
    keep = targets != IGNORE_INDEX
    safe = torch.where(keep, targets, 0)
    picked = x.gather(1, safe[:, None]).squeeze(1)
    loss = torch.where(keep, lse - picked, 0.0)
    grad = torch.exp(x - lse[:, None])
    grad.scatter_add_(1, safe[:, None], torch.full_like(picked[:, None], -1.0))
    grad *= keep[:, None]
    return loss, grad.to(logits.dtype)


def _triton_kernel():
    """The CUDA kernel, built on first use: triton ships with torch's CUDA builds, and a CPU
    install need not have it."""
    import triton
    import triton.language as tl

    @triton.jit
    def loss_grad_rows(
        logits_ptr,
        grad_ptr,
        loss_ptr,
        targets_ptr,
        n_rows,
        stride,
        n_cols,
        ignore,
        BLOCK: tl.constexpr,
        HINTS: tl.constexpr,
    ):
        # Each program takes rows program_id, program_id + programs, ...: how many programs
        # run decides how many rows are in flight at once, and so whether a row is still in
        # L2 when pass 2 reads it again.
        for row in range(tl.program_id(0), n_rows, tl.num_programs(0)):
            at = row + tl.zeros([], tl.int64)  # 64-bit offsets: rows x cols can pass 2**31
            src = logits_ptr + at * stride
            dst = grad_ptr + at * stride
            target = tl.load(targets_ptr + at)
            keep = target != ignore
            safe = tl.where(keep, target, 0)
            # Pass 1: an online log-sum-exp, block by block: the running max moves once
            # a block, so each value costs one exp.
            run_max = float("-inf")
            run_sum = 0.0
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                if HINTS:  # pass 2 reads the row again: keep it in L2 over the stores
                    x = tl.load(
                        src + cols,
                        mask=cols < n_cols,
                        other=float("-inf"),
                        eviction_policy="evict_last",
                    )
                else:
                    x = tl.load(src + cols, mask=cols < n_cols, other=float("-inf"))
                x = x.to(tl.float32)
                new_max = tl.maximum(run_max, tl.max(x, axis=0))
                block_sum = tl.sum(tl.exp(x - new_max), axis=0)
                run_sum = run_sum * tl.exp(run_max - new_max) + block_sum
                run_max = new_max
            lse = run_max + tl.log(run_sum)
            picked = tl.load(src + safe).to(tl.float32)
            tl.store(loss_ptr + at, tl.where(keep, lse - picked, 0.0))
            # Pass 2: the row's gradient, over a read that L2 serves while the row is
            # still there (100 KB a row for GPT-2).
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                mask = cols < n_cols
                if HINTS:  # last use of the row; the gradient is not read back here
                    x = tl.load(src + cols, mask=mask, other=0.0, eviction_policy="evict_first")
                else:
                    x = tl.load(src + cols, mask=mask, other=0.0)
                g = tl.exp(x.to(tl.float32) - lse) - tl.where(cols == safe, 1.0, 0.0)
                g = tl.where(keep, g, 0.0).to(dst.dtype.element_ty)
                if HINTS:
                    tl.store(dst + cols, g, mask=mask, eviction_policy="evict_first")
                else:
                    tl.store(dst + cols, g, mask=mask)

    return loss_grad_rows


_KERNEL = None


@torch.library.custom_op("mgpu::cross_entropy_loss_grad", mutates_args=())
def cross_entropy_loss_grad(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Each row's loss and the gradient of their sum: see _loss_grad_reference. An op of its
    own so torch.compile keeps the kernel whole (and CUDA graphs can capture it)."""
    return _loss_grad_reference(logits, targets)


class Launch(NamedTuple):
    """How the CUDA kernel runs: columns a block, warps a program, programs an SM (0: one
    program a row), and L2 eviction hints on its loads and stores."""

    block: int
    warps: int
    per_sm: int = 0
    hints: bool = False


# On one H100 over GPT-2's 16384 x 50304 bf16 logits (bench/head_loss.py --sweep, files
# bench/results/head_loss_sweep-NVIDIA_H100_80GB_HBM3-20261125-*.json):
# - without hints, 8192 x 16 warps, a program a row, was the fastest in every sweep, 1.664-1.670
#   ms: 1.98 TB/s of its read and write, against 3.0 TB/s for a plain copy, so pass 2 was
#   partly served from HBM; fewer rows in flight (a grid-stride loop of 1 to 4 programs an SM)
#   ran 1.71-2.94 ms;
# - with hints (pass 1's loads kept in L2, pass 2's loads and the gradient's stores evicted
#   first, so that the gradient streams out without pushing rows still to be read out of L2),
#   the same launch ran 1.458-1.459 ms, 2.26 TB/s;
# - a row kept in registers and read once (one block of 65536) ran 12.7-14.3 ms: 50304 fp32
#   values over 512-1024 threads spill.
LAUNCH = Launch(8192, 16, hints=True)
# The launches the sweep times and the GPU test checks, the default among them.
LAUNCH_SHAPES = [
    Launch(8192, 16),
    Launch(4096, 8),
    LAUNCH,
    Launch(8192, 8, hints=True),
    Launch(8192, 32, hints=True),
    Launch(16384, 16, hints=True),
    Launch(16384, 32, hints=True),
    Launch(8192, 16, 1, hints=True),
    Launch(8192, 16, 2, hints=True),
    Launch(8192, 16, 3, hints=True),
    Launch(8192, 8, 4, hints=True),
]


def loss_grad_cuda(
    logits: Tensor, targets: Tensor, launch: Launch = LAUNCH
) -> tuple[Tensor, Tensor]:
    """The op's CUDA kernel over `logits` [N, V] (any float dtype)."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _triton_kernel()
    logits = logits.contiguous()
    rows, cols = logits.shape
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    grad = torch.empty_like(logits)
    programs = rows
    if launch.per_sm and logits.is_cuda:
        sms = torch.cuda.get_device_properties(logits.device).multi_processor_count
        programs = min(rows, launch.per_sm * sms)
    _KERNEL[(programs,)](
        logits, grad, loss, targets.contiguous(), rows, cols, cols, IGNORE_INDEX,
        BLOCK=launch.block, HINTS=launch.hints, num_warps=launch.warps,
    )  # fmt: skip
    return loss, grad


def _loss_grad_kernel(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The op's CUDA implementation: the kernel at the default launch (the op's signature has
    no launch argument; the sweep and the tests call loss_grad_cuda with theirs)."""
    return loss_grad_cuda(logits, targets)


cross_entropy_loss_grad.register_kernel("cuda")(_loss_grad_kernel)


@cross_entropy_loss_grad.register_fake
def _loss_grad_shapes(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    return logits.new_empty(logits.shape[0], dtype=torch.float32), torch.empty_like(logits)


class _LinearCrossEntropy(torch.autograd.Function):
    """mean over kept targets of cross_entropy(h @ weight.T, targets), with the logits'
    gradient made in forward (it needs nothing from backward but a scalar) and the logits
    themselves dropped there."""

    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
        logits = h @ weight.t()
        row_loss, grad_logits = cross_entropy_loss_grad(logits, targets)
        kept = (targets != IGNORE_INDEX).sum()
        ctx.save_for_backward(h, weight, grad_logits, kept)
        return row_loss.sum() / kept

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        h, weight, grad_logits, kept = ctx.saved_tensors
        # The incoming gradient and the mean's 1/kept scale the two small products, not the
        # N x V gradient: one multiply over 12M and 39M values instead of 824M.
        scale = grad_loss / kept
        grad_h = (grad_logits @ weight) * scale
        grad_w = (grad_logits.t() @ h) * scale
        return grad_h, grad_w, None


def linear_cross_entropy(h: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """F.cross_entropy(F.linear(h, weight).float(), targets) over h [..., C], weight [V, C] and
    targets [...], without keeping the logits. Under autocast the product runs in the autocast
    dtype, as F.linear's would; the loss is taken in fp32 either way."""
    h = h.flatten(0, -2)
    if torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, weight = h.to(dtype), weight.to(dtype)
    else:
        weight = weight.to(h.dtype)
    # The casts above are outside the Function, so autograd returns fp32 gradients to fp32
    # parameters through them, as it does for F.linear under autocast.
    with torch.autocast(h.device.type, enabled=False):
        return _LinearCrossEntropy.apply(h, weight, targets.flatten())
