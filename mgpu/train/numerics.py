"""How a step computes, for the Trainer and the benchmarks alike: the autocast dtype of
`trainer.precision`, the training loss (compiled where trainer.compile is on), and the TF32 and
cuDNN modes train.py and the benchmarks share."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from mgpu.config.schema import Precision, TrainerConfig
from mgpu.models.loss import cross_entropy


def autocast_dtype(precision: Precision, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for `trainer.precision`, or None for plain fp32. fp8 is bf16 autocast
    around the linear layers that mgpu.train.fp8 converted (they cast to fp8 themselves)."""
    if precision is Precision.auto:
        if device.type != "cuda":
            return None
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    bf16 = torch.bfloat16
    return {Precision.bf16: bf16, Precision.fp8: bf16, Precision.fp16: torch.float16}.get(precision)


def autocast(device: torch.device, dtype: torch.dtype | None) -> AbstractContextManager:
    """torch.autocast to `dtype` (autocast_dtype's answer) on `device`; off for None."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)


def training_loss(cfg: TrainerConfig, device: torch.device, mode: str | None) -> Callable:
    """The training loss, compiled where trainer.compile is on. Eager, the fp32 upcast, log-softmax
    and their backward each make a pass over the logits; over GPT-2's 16x1024x50304 logits that
    is ~30 GB of memory traffic, about 10 ms a step on an H100. Compiled, they fuse into a pass or
    two. The loss region holds no parameters, so gradient buckets still launch as before."""
    if not cfg.compiles(device.type):
        return cross_entropy
    return torch.compile(cross_entropy, backend=cfg.compile_backend, mode=mode)


def set_math_modes(cfg: TrainerConfig, device: torch.device) -> None:
    """trainer.tf32, trainer.cudnn_benchmark and trainer.deterministic, for this process (torch
    keeps them globally); before the first matrix multiply, which creates cuBLAS's workspace."""
    if cfg.deterministic:
        # cuBLAS repeats its results only with a fixed workspace; torch refuses a matrix
        # multiply under deterministic algorithms without one of these two settings.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Called only to change it: the call imports torch's inductor (~1.7 s of a CPU a process).
    if torch.are_deterministic_algorithms_enabled() != cfg.deterministic:
        torch.use_deterministic_algorithms(cfg.deterministic)
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
    torch.backends.cudnn.allow_tf32 = cfg.tf32
    torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
