"""The model group's schemas (`model=...`): one per built-in model, plus a user's own."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING

from mgpu.config.checks import (
    ConfigError,
    auto_or_positive_int,
    positive,
    positive_fields,
    require,
)
from mgpu.models.gpt import (  # the choices live with the model
    ATTENTION,
    HEAD_LOSS,
    RESIDUAL,
    checkpointed_blocks,
)

VOCAB_MULTIPLE = 64  # model.vocab_size=auto rounds the data's vocabulary up to a multiple of this


@dataclass
class ModelConfig:
    _target_: str = MISSING  # import path of an nn.Module class built as Cls(**kwargs)

    def model_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_target_"}


@dataclass
class GPTModelConfig(ModelConfig):
    _target_: str = "mgpu.models.GPT"
    # Rows of the embedding and the head: auto (the data's vocabulary, data.vocab_size, rounded
    # up to a multiple of 64 for faster matrix multiplies; the run's config.yaml records the
    # number) or a number at least data.vocab_size.
    vocab_size: Any = "auto"
    block_size: int = 64  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    # Attention kernel: auto (cuDNN first, then torch's order), torch (torch's own choice), or
    # only one of cudnn, flash, efficient, math.
    attention: str = "auto"
    # The head's loss: fused (its matrix multiply and the cross-entropy in one step that never
    # keeps the logits, a value per token and vocabulary entry), logits (through them, as
    # F.cross_entropy takes them), auto (fused on a GPU).
    head_loss: str = "auto"
    # Activation checkpointing of transformer blocks: none, blocks (every block), or a number N
    # (the first N blocks). A checkpointed block keeps only its input and runs its forward
    # again in backward: less activation memory (a bigger batch fits) for about a third more
    # compute in those blocks.
    activation_checkpointing: Any = "none"
    # The residual stream's dtype between blocks: fp32 (as autocast leaves it: the embeddings'
    # dtype) or autocast (trainer.precision's bf16 / fp16 from the embeddings on: half the
    # memory traffic of the LayerNorms and residual adds, and half their saved activations).
    residual: str = "fp32"

    def __post_init__(self) -> None:
        require(
            self.residual in RESIDUAL,
            "model.residual",
            self.residual,
            f"must be one of {', '.join(RESIDUAL)}",
        )
        require(
            self.head_loss in HEAD_LOSS,
            "model.head_loss",
            self.head_loss,
            f"must be one of {', '.join(HEAD_LOSS)}",
        )
        require(
            self.attention in ATTENTION,
            "model.attention",
            self.attention,
            f"must be one of {', '.join(ATTENTION)}",
        )
        auto_or_positive_int("model.vocab_size", self.vocab_size, "follows data.vocab_size")
        positive_fields(self, "model", ("block_size", "n_layer", "n_head", "n_embd"))
        if self.n_embd % self.n_head:  # the nearest head count that divides it, the larger
            divisors = [h for h in range(1, self.n_embd + 1) if self.n_embd % h == 0]
            heads = min(divisors, key=lambda h: (abs(h - self.n_head), -h))
            raise ConfigError(
                "model.n_embd",
                self.n_embd,
                f"must be divisible by model.n_head ({self.n_head}), e.g. model.n_head={heads}",
            )
        require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")
        try:
            checkpointed_blocks(self.activation_checkpointing, self.n_layer)
        except ValueError:
            raise ConfigError(
                "model.activation_checkpointing",
                self.activation_checkpointing,
                f"must be none, blocks (all model.n_layer={self.n_layer} blocks) or a number "
                f"of blocks from 0 to {self.n_layer}",
            ) from None

    def follow_data(self, data_vocab: int | None, data_name: str) -> None:
        """Resolve vocab_size=auto from the data's vocabulary (None: the data gives none), and
        check that every token id of the data has a row."""
        if self.vocab_size == "auto":
            why = (
                f"follows the data's vocabulary (data.vocab_size; data.kwargs.vocab_size for "
                f"data=custom), which {data_name} does not give; set model.vocab_size to its "
                "number of token ids"
            )
            require(data_vocab is not None, "model.vocab_size", "auto", why)
            self.vocab_size = -(-data_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        elif data_vocab is not None:
            require(
                self.vocab_size >= data_vocab,
                "model.vocab_size",
                self.vocab_size,
                f"is smaller than data.vocab_size ({data_vocab}): token ids up to "
                f"{data_vocab - 1} would have no row; set model.vocab_size=auto (follows the "
                f"data) or at least {data_vocab}",
            )

    def resolved(self) -> dict[str, Any]:
        """What follow_data decided, for the run's saved config."""
        return {"vocab_size": self.vocab_size}


# What a classifier's auto input settings follow, as their errors name it.
CHANNELS = (
    "the data's channels (data.channels of data=images, 3 for data=image_folder and "
    "image_shards, data.kwargs.channels for data=custom)"
)
PIXELS = "the data's values per image (channels * image_size**2)"


@dataclass
class ClassifierConfig(ModelConfig):
    """A model that scores classes: its head's size follows the data's classes."""

    # Outputs of the head: auto (the data's classes: data.num_classes, data=image_folder's class
    # folders, data.kwargs.num_classes for data=custom; the run's config.yaml records the
    # number) or a number at least that.
    num_classes: Any = "auto"

    def follow_classes(self, data_classes: int | None, data_name: str) -> None:
        """Resolve num_classes=auto from the data's classes (None: the data gives none), and
        check that every label of the data has an output."""
        if self.num_classes == "auto":
            why = (
                f"follows the data's classes (data.num_classes, the class folders of "
                f"data=image_folder, data.kwargs.num_classes for data=custom), which "
                f"{data_name} does not give; set model.num_classes"
            )
            require(data_classes is not None, "model.num_classes", "auto", why)
            self.num_classes = data_classes
        elif data_classes is not None:
            require(
                self.num_classes >= data_classes,
                "model.num_classes",
                self.num_classes,
                f"is smaller than the data's {data_classes} classes; set model.num_classes=auto "
                f"(follows the data) or at least {data_classes}",
            )

    def follow_inputs(self, channels: int | None, side: int | None, data_name: str) -> None:
        """Resolve the input settings that are auto from the data's images: their channels and
        side (None where the data does not say)."""

    def _follow(self, key: str, data_value: int | None, what: str, data_name: str) -> None:
        """This config's `key` resolved (auto: `data_value`) and checked against the data."""
        value = getattr(self, key)
        if value == "auto":
            why = f"follows {what}, which {data_name} does not give; set model.{key}"
            require(data_value is not None, f"model.{key}", "auto", why)
            setattr(self, key, data_value)
        elif data_value is not None:
            why = f"must equal {what} ({data_value}); set model.{key}=auto (follows the data)"
            require(value == data_value, f"model.{key}", value, why)

    def resolved(self) -> dict[str, Any]:
        """What follow_classes and follow_inputs decided, for the run's saved config."""
        return {"num_classes": self.num_classes}


@dataclass
class ResNetModelConfig(ClassifierConfig):
    _target_: str = "mgpu.models.ResNet"
    block: str = "basic"  # basic | bottleneck
    layers: list[int] = field(default_factory=lambda: [1, 1, 1, 1])  # blocks per stage
    width: int = 16  # channels of the first stage
    in_channels: Any = "auto"  # the data's channels (CHANNELS below)
    stem: str = "cifar"  # cifar (3x3, no pool, for small images) | imagenet (7x7 + pool)
    # none only: activation checkpointing is GPT's (its transformer blocks); a key here so that
    # asking a ResNet for it says so, rather than that the key is unknown.
    activation_checkpointing: Any = "none"

    def model_kwargs(self) -> dict[str, Any]:
        kwargs = super().model_kwargs()
        del kwargs["activation_checkpointing"]
        return kwargs

    def follow_inputs(self, channels: int | None, side: int | None, data_name: str) -> None:
        self._follow("in_channels", channels, CHANNELS, data_name)

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "in_channels": self.in_channels}

    def __post_init__(self) -> None:
        require(
            self.activation_checkpointing in ("none", 0),
            "model.activation_checkpointing",
            self.activation_checkpointing,
            "is implemented for GPT's transformer blocks only, not for ResNet's residual "
            "stages; set model.activation_checkpointing=none",
        )
        auto_or_positive_int("model.num_classes", self.num_classes, "the data's classes")
        auto_or_positive_int("model.in_channels", self.in_channels, "the data's channels")
        positive("model.width", self.width, "64")
        require(
            self.block in ("basic", "bottleneck"),
            "model.block",
            self.block,
            "must be basic or bottleneck",
        )
        require(
            self.stem in ("cifar", "imagenet"), "model.stem", self.stem, "must be cifar or imagenet"
        )
        require(
            len(self.layers) > 0 and all(n > 0 for n in self.layers),
            "model.layers",
            self.layers,
            "must be a non-empty list of positive block counts",
        )


@dataclass
class MLPModelConfig(ClassifierConfig):
    _target_: str = "mgpu.models.MLP"
    in_features: Any = "auto"  # the data's values per image (PIXELS below)
    hidden: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.0

    def follow_inputs(self, channels: int | None, side: int | None, data_name: str) -> None:
        pixels = channels * side**2 if channels is not None and side is not None else None
        self._follow("in_features", pixels, PIXELS, data_name)

    def resolved(self) -> dict[str, Any]:
        return {**super().resolved(), "in_features": self.in_features}

    def __post_init__(self) -> None:
        auto_or_positive_int("model.in_features", self.in_features, "the data's pixel values")
        auto_or_positive_int("model.num_classes", self.num_classes, "the data's classes")
        require(
            all(h > 0 for h in self.hidden),
            "model.hidden",
            self.hidden,
            "must be positive layer widths, e.g. [256,256]",
        )


@dataclass
class CustomModelConfig(ModelConfig):
    """A user's module: `model=custom model._target_=pkg.MyNet +model.kwargs.width=64`."""

    kwargs: dict[str, Any] = field(default_factory=dict)

    def model_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)
