"""The data group's schemas (`data=...`): one per built-in dataset, plus a user's own; the loader
keys (batch size, workers, prefetching) are shared by all of them in DataConfig."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING

from mgpu.config_checks import _non_negative, _positive, _require


@dataclass
class DataConfig:
    _target_: str = MISSING  # import path of a Dataset class built as Cls(split=..., **kwargs)
    batch_size: int = 32  # per device, per micro-step
    # DataLoader worker processes per rank: a number, or auto (this node's CPUs shared out per
    # local process, less two for the training process's own threads; mgpu.loader.worker_count).
    num_workers: Any = "auto"
    pin_memory: bool = True  # page-locked host batches; applies when training on CUDA
    prefetch_factor: int = 2  # batches each DataLoader worker prepares ahead (with workers > 0)
    prefetch_depth: int = 2  # batches copied to the GPU ahead of use, on the loader's side stream
    device_transform: str = "auto"  # auto: the dataset's `device_transform`; none: leave inputs

    def __post_init__(self) -> None:
        _positive("data.batch_size", self.batch_size, "32")
        if self.num_workers != "auto":
            ok = isinstance(self.num_workers, int) and not isinstance(self.num_workers, bool)
            why = "must be auto or a number of worker processes >= 0, e.g. data.num_workers=8"
            _require(ok and self.num_workers >= 0, "data.num_workers", self.num_workers, why)
        _positive("data.prefetch_factor", self.prefetch_factor, "2")
        _positive("data.prefetch_depth", self.prefetch_depth, "2")
        _require(
            self.device_transform in ("auto", "none"),
            "data.device_transform",
            self.device_transform,
            "must be auto (the dataset's own, if it has one) or none",
        )

    def dataset_kwargs(self) -> dict[str, Any]:
        """The fields a Dataset's constructor receives: everything but the loader keys."""
        loader_keys = {f.name for f in fields(DataConfig)}
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in loader_keys}


@dataclass
class NgramDataConfig(DataConfig):
    _target_: str = "mgpu.data.NgramTokens"
    vocab_size: int = 256
    seq_len: int = 64
    order: int = 1  # tokens of context that decide the next token's successor set
    branching: int = 4  # successors per context; the source's entropy is ln(branching) nats/token
    num_samples: int = 100_000
    eval_samples: int = 1024
    seed: int = 1234  # fixes the source and the samples (independent of trainer.seed)

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("vocab_size", "seq_len", "order", "branching", "num_samples", "eval_samples"):
            _positive(f"data.{key}", getattr(self, key), "a positive integer")
        _require(
            self.branching <= self.vocab_size,
            "data.branching",
            self.branching,
            f"must be <= data.vocab_size ({self.vocab_size})",
        )


@dataclass
class ImageDataConfig(DataConfig):
    _target_: str = "mgpu.data.SyntheticImages"
    num_classes: int = 10
    image_size: int = 32
    channels: int = 3
    num_samples: int = 50_000
    eval_samples: int = 1_000
    noise: float = 48.0  # pixel noise std around each class template (uint8 scale)
    seed: int = 1234

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("num_classes", "image_size", "channels", "num_samples", "eval_samples"):
            _positive(f"data.{key}", getattr(self, key), "a positive integer")
        _non_negative("data.noise", self.noise, "48")


@dataclass
class TokenFileDataConfig(DataConfig):
    _target_: str = "mgpu.data.TokenFile"
    path: str = MISSING  # uint16 tokens, nanoGPT .bin layout (`python -m mgpu.data.prepare`)
    seq_len: int = 1024
    eval_samples: int = 256  # the file's last windows, held out for evaluation
    vocab_size: int = 50304  # every token in the file must be below this

    def __post_init__(self) -> None:
        super().__post_init__()
        for key in ("seq_len", "eval_samples", "vocab_size"):
            _positive(f"data.{key}", getattr(self, key), "a positive integer")


@dataclass
class CustomDataConfig(DataConfig):
    """A user's Dataset: `data=custom data._target_=pkg.MyDataset +data.kwargs.root=/data`."""

    kwargs: dict[str, Any] = field(default_factory=dict)

    def dataset_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)
