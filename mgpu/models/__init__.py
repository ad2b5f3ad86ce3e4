"""Model zoo for mgpu: GPT (language), ResNet and MLP (vision), and their training-FLOP counts."""

from torch import nn

from mgpu.config import ModelConfig, build_from_target
from mgpu.models.flops import count_training_flops
from mgpu.models.gpt import GPT
from mgpu.models.mlp import MLP
from mgpu.models.resnet import ResNet

__all__ = ["GPT", "MLP", "ResNet", "build_model", "compile_model", "count_training_flops"]


def build_model(cfg: ModelConfig) -> nn.Module:
    """`cfg._target_(**kwargs)`: a built-in model or the user's own, by import path."""
    return build_from_target("model", cfg._target_, cfg.model_kwargs())


def compile_model(model: nn.Module) -> nn.Module:
    """torch.compile that keeps gradient communication overlapped with backward.

    A whole-model compile runs backward as one graph that hands every gradient over at its end,
    so no bucket could be reduced while backward runs. Compiling each repeated block (every
    element of an nn.ModuleList, e.g. GPT's transformer blocks) instead yields gradients block
    by block. Models without a ModuleList are compiled whole. Module.compile works in place, so
    parameter names (and checkpoints) stay as they were.
    """
    blocks = [b for m in model.modules() if isinstance(m, nn.ModuleList) for b in m]
    for block in blocks or [model]:
        block.compile()
    return model
