"""Model zoo for mgpu: GPT (language), ResNet and MLP (vision), and their training-FLOP counts."""

from torch import nn

from mgpu.config import ModelConfig, build_from_target
from mgpu.models.flops import count_training_flops
from mgpu.models.gpt import GPT
from mgpu.models.mlp import MLP
from mgpu.models.resnet import ResNet

__all__ = ["GPT", "MLP", "ResNet", "build_model", "count_training_flops"]


def build_model(cfg: ModelConfig) -> nn.Module:
    """`cfg._target_(**kwargs)`: a built-in model or the user's own, by import path."""
    return build_from_target("model", cfg._target_, cfg.model_kwargs())
