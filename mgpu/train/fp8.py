"""`trainer.precision=fp8`: whether this device and install can run it, and the conversion of a
model's linear layers to torchao's float8 training (bf16 autocast everywhere else).

torchao is optional: it is imported only here, only when fp8 is asked for. A converted layer
keeps its `weight` and `bias` under their names, so a checkpoint saved under fp8 loads into the
same model under bf16 and back.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

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


def _ends_with(name: str, pattern: str) -> bool:
    """`pattern` names the layer or its last parts, whole parts only: attn.c_proj matches
    blocks.3.attn.c_proj, c_proj matches attention's and the MLP's, proj matches neither."""
    return name == pattern or name.endswith("." + pattern)


def check_skip(model: nn.Module, skip: Sequence[str]) -> None:
    """Stop, naming the key, at a trainer.fp8_skip entry that names none of `model`'s linear
    layers (a model built on the meta device will do: only the names are read)."""
    linear = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    for pattern in skip:
        if not any(_ends_with(n, pattern) for n in linear):
            ends = sorted({".".join(n.split(".")[-2:]) for n in linear})
            raise ConfigError(
                "trainer.fp8_skip",
                pattern,
                f"names no linear layer of this model; its linear layers' names end in "
                f"{', '.join(ends)}",
            )


def convert(model: nn.Module, recipe: str = "tensorwise", skip: Sequence[str] = ()) -> nn.Module:
    """The model's linear layers (but a tied head, and those `skip` names by the end of their
    names: trainer.fp8_skip) as torchao Float8Linear under torchao's scaling `recipe`
    (trainer.fp8_recipe), in place; check_fp8 has said that this device can run them.
    tensorwise casts each layer's input, weight and output gradient to fp8 with one scale per
    tensor; tensorwise_with_gw_hp as tensorwise, with the weight gradient's matrix multiply in
    bf16; rowwise with a scale per row; rowwise_with_gw_hp as rowwise, with the weight
    gradient's matrix multiply in bf16. Scales are computed on the device each step (no host
    sync). A `skip` entry that names no linear layer stops the run (a misspelt name would
    otherwise leave every layer in fp8 without a word)."""
    from torchao.float8 import convert_to_float8_training

    check_skip(model, skip)

    def chosen(module: nn.Module, name: str) -> bool:
        return _convertible(module, name) and not any(_ends_with(name, p) for p in skip)

    return convert_to_float8_training(model, config=_config(recipe), module_filter_fn=chosen)


def _config(recipe: str):
    """torchao's Float8LinearConfig for trainer.fp8_recipe: torchao's named recipes, and
    tensorwise_with_gw_hp, tensorwise scaling whose weight-gradient matrix multiply takes the
    input and output gradient in bf16 (no fp8 copies of them laid out for it)."""
    from torchao.float8 import CastConfig, Float8LinearConfig, ScalingType

    if recipe == "tensorwise_with_gw_hp":
        # one CastConfig each: torchao's config sets each one's dtype (input and gradient differ)
        return Float8LinearConfig(
            cast_config_input_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
            cast_config_grad_output_for_grad_weight=CastConfig(scaling_type=ScalingType.DISABLED),
        )
    return Float8LinearConfig.from_recipe_name(recipe)
