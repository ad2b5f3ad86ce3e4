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
    """FLOPs of one training step per sample of shape `sample_shape`.

    `build` must construct a fresh model (e.g. `lambda: ResNet(**kwargs)`): it runs under
    torch.device("meta"), so parameters and activations only carry shapes. An integer `dtype`
    feeds token ids (zeros); a floating `dtype` feeds random values and casts the model to it.
    Only matmul-like ops (mm, bmm, conv, attention) are counted, as FlopCounterMode does.
    The input does not require grad, matching a real step: autograd skips the first layer's
    input-gradient, so that work is (correctly) not counted.
    """
    # Two samples, halved: batch norm in train mode needs more than one value per channel, and
    # a batch of one has one where a small image (CIFAR's 32 x 32 through ResNet-50) reaches a
    # 1 x 1 map. The counted ops are linear in the batch, so half is one sample's exactly.
    batch = 2
    shape = (batch, *sample_shape)
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
    return counter.get_total_flops() / batch
