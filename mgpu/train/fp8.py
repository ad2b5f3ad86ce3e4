"""`trainer.precision=fp8`: whether this device and install can run it, and the conversion of a
model's linear layers to torchao's float8 training (bf16 autocast everywhere else).

torchao is optional: it is imported only here, only when fp8 is asked for. A converted layer
keeps its `weight` and `bias` under their names, so a checkpoint saved under fp8 loads into the
same model under bf16 and back.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from mgpu.config.checks import ConfigError

# fp8 matrix multiplies (torch._scaled_mm) run on compute capability 8.9 (Ada) and 9.0 (Hopper)
# and later.
MIN_CAPABILITY = (8, 9)
KEY = "trainer.precision"


def check_fp8(device: torch.device) -> None:
    """Stop, in one line naming the key, the device and the fix, where fp8 cannot run."""
    fix = "set trainer.precision=bf16 (or auto)"
    if device.type != "cuda":
        raise ConfigError(
            KEY,
            "fp8",
            f"fp8 matrix multiplies need an NVIDIA GPU of compute capability 8.9 or later "
            f"(Ada, Hopper); this run's device is {device}; {fix}",
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            KEY,
            "fp8",
            f"fp8 matrix multiplies need compute capability 8.9 or later (Ada, Hopper); "
            f"{device} is a {name} of capability {capability[0]}.{capability[1]}; {fix}",
        )
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(
            KEY, "fp8", f"needs torchao, which is not installed: pip install torchao; or {fix}"
        )


def _convertible(module: nn.Module, name: str) -> bool:
    """torchao's filter: linear layers whose sides are multiples of 16 (what the fp8 matrix
    multiply takes), other than a head tied to an embedding (GPT's lm_head shares wte's weight,
    which the embedding lookup reads in full precision)."""
    if not isinstance(module, nn.Linear):
        return False
    if name.split(".")[-1] == "lm_head":
        return False
    return module.in_features % 16 == 0 and module.out_features % 16 == 0


def convert(model: nn.Module) -> nn.Module:
    """The model's linear layers (but a tied head) as torchao Float8Linear, in place; check_fp8
    has said that this device can run them. Float8Linear casts its input, weight and output
    gradient to fp8 with a scale per tensor, computed on the device each step (no host sync)."""
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=_convertible)
