"""Counts a model's training FLOPs (forward + backward) for one sample with torch's FlopCounterMode.

The model is built on the meta device, so counting costs no memory and no arithmetic.
"""

from collections.abc import Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode


def count_training_flops(
    build: Callable[[], nn.Module],
    sample_shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> float:
    """FLOPs of one training step on a batch of one sample of shape `sample_shape`.

    `build` must construct a fresh model (e.g. `lambda: ResNet(**kwargs)`): it runs under
    torch.device("meta"), so parameters and activations only carry shapes. An integer `dtype`
    feeds token ids (zeros); a floating `dtype` feeds random values and casts the model to it.
    Only matmul-like ops (mm, bmm, conv, attention) are counted, as FlopCounterMode does.
    The input does not require grad, matching a real step: autograd skips the first layer's
    input-gradient, so that work is (correctly) not counted.
    """
    shape = (1, *sample_shape)
    # Checked on torch 2.13: FlopCounterMode runs forward and backward on meta tensors,
    # including F.scaled_dot_product_attention, so no CPU fallback is needed.
    with torch.device("meta"):
        model = build()
        if dtype.is_floating_point:
            model = model.to(dtype)
            x = torch.randn(shape, dtype=dtype)
        else:
            x = torch.zeros(shape, dtype=dtype)
    model.train()
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        # sum() has a flop-free backward, so only the model's own ops are counted
        out.float().sum().backward()
    return float(counter.get_total_flops())


# Peak dense (no sparsity) TFLOP/s per GPU, looked up by a word of the name CUDA reports:
# (bf16/fp16 tensor cores, fp32 without TF32). Vendor data sheets; MFU divides by these.
PEAK_TFLOPS: list[tuple[str, float, float]] = [
    ("H200", 989.4, 66.9),
    ("H100 PCIe", 756.5, 51.2),
    ("H100 80GB HBM3", 989.4, 66.9),  # H100 SXM
    ("A100", 312.0, 19.5),
    ("L40S", 362.1, 91.6),
    ("L4", 121.0, 30.3),
    ("V100", 125.0, 15.7),  # fp16 only: no bf16 tensor cores
]


def peak_tflops(device_name: str, low_precision: bool) -> float | None:
    """The table's peak for this device at the training precision, or None if it lacks it."""
    words = f" {device_name} "
    for key, half, single in PEAK_TFLOPS:
        if f" {key} " in words:
            return half if low_precision else single
    return None
