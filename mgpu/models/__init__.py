"""Model zoo for mgpu: GPT (language), ResNet and MLP (vision), and their training-FLOP counts."""

from collections import Counter

from torch import nn

from mgpu.config import ModelConfig, build_from_target
from mgpu.models.flops import count_training_flops
from mgpu.models.gpt import GPT
from mgpu.models.mlp import MLP
from mgpu.models.resnet import ResNet

__all__ = [
    "GPT",
    "MLP",
    "ResNet",
    "build_model",
    "compile_model",
    "count_training_flops",
    "repeated_blocks",
]


def build_model(cfg: ModelConfig) -> nn.Module:
    """`cfg._target_(**kwargs)`: a built-in model or the user's own, by import path."""
    return build_from_target("model", cfg._target_, cfg.model_kwargs())


def _is_block(module: nn.Module) -> bool:
    """A composite module with parameters: a single layer is not a block worth compiling alone."""
    return next(module.children(), None) is not None and next(module.parameters(), None) is not None


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks, outermost first: the children of every nn.ModuleList or
    nn.Sequential that holds two or more blocks (composite modules with parameters) of one
    class, such as GPT's transformer blocks and ResNet's residual blocks. A block's own insides
    are not searched again."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.ModuleList, nn.Sequential)):
            kinds = Counter(type(c) for c in module.children() if _is_block(c))
            if any(n >= 2 for n in kinds.values()):
                found.extend(c for c in module.children() if _is_block(c))
                return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def compile_model(model: nn.Module, backend: str = "inductor") -> nn.Module:
    """torch.compile that keeps gradient communication overlapped with backward.

    A whole-model compile runs backward as one graph that hands every gradient over at its end,
    so no bucket could be reduced while backward runs. Compiling each repeated block instead
    (see repeated_blocks) yields gradients block by block; what lies between the blocks (GPT's
    embeddings and head, ResNet's stem and classifier) stays eager. Models without repeated
    blocks are compiled whole. Module.compile works in place, so parameter names (and
    checkpoints) stay as they were.
    """
    blocks = repeated_blocks(model)
    for block in blocks or [model]:
        # Static shapes: blocks of one class with different shapes (ResNet's stages) each get
        # their own graph rather than one graph with symbolic sizes.
        block.compile(backend=backend, dynamic=False if blocks else None)
    return model
