"""Typed configuration: the dataclass schemas behind `conf/` and their validation.

Every key a user can set is a field here with a docstring-comment; a bad value fails before any
process group or run directory exists, with one line naming the key, the value and how to fix it.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from hydra.core.config_store import ConfigStore
from hydra.experimental.callback import Callback
from hydra.utils import get_object
from omegaconf import MISSING, DictConfig, OmegaConf, read_write
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from mgpu import dist
from mgpu.data.gpu_decode import gpu_decode_unavailable, resolve_decode
from mgpu.data.image_folder import FolderError, check_layout, check_root, class_folders

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key, the value and the fix."""

    def __init__(self, key: str, value: Any, why: str):
        super().__init__(f"{key}={value!r}: {why}")


def _require(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(key, value, why)


def _positive(key: str, value: float, example: str) -> None:
    _require(value > 0, key, value, f"must be > 0, e.g. {key}={example}")


def _non_negative(key: str, value: float, example: str) -> None:
    _require(value >= 0, key, value, f"must be >= 0, e.g. {key}={example}")


def _auto_or_bool(key: str, value: Any) -> bool | str:
    """A key that takes auto, true or false (as typed, or as Hydra parsed it): auto or a bool."""
    text = str(value).lower()
    _require(text in ("auto", "true", "false"), key, value, "must be auto, true or false")
    return "auto" if text == "auto" else text == "true"


# Enum member names are what users type (`trainer.precision=bf16`); OmegaConf rejects any other
# value at composition time with the allowed list.
class Precision(Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


class Engine(Enum):
    mgpu = "mgpu"
    torch_ddp = "torch_ddp"
    none = "none"


class ReduceDtype(Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Backend(Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class NonFinite(Enum):
    stop = "stop"
    skip = "skip"


class Decode(Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class BadFiles(Enum):
    error = "error"
    skip = "skip"


class OptimizerName(Enum):
    adamw = "adamw"
    sgd = "sgd"


COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps to train for
    grad_accum_steps: int = 1  # micro-batches per optimizer step; gradients sync on the last only
    precision: Precision = Precision.auto  # auto: bf16 autocast on CUDA, fp32 on CPU
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    log_every: int = 10  # steps between TensorBoard/console records
    eval_every: int = 100  # steps between evaluations (also one at the end); 0: only at the end
    seed: int = 0  # model init, sampler shuffle and dropout all derive from it
    # torch.compile before wrapping for data parallelism (mgpu.models.compile_model says what is
    # compiled, and the loss with it): true, false, or auto (on for CUDA, off on CPU, where
    # compiling costs more than it saves on the small models a CPU trains).
    compile: Any = "auto"
    # torch.compile's backend for the model and the loss: inductor generates fused GPU kernels;
    # aot_eager captures the same graphs without generating code (checks compile on any host).
    compile_backend: str = "inductor"
    # torch.compile's mode for the model and the loss (inductor only): default, reduce-overhead
    # (each compiled region replayed as a CUDA graph: one launch instead of one per kernel, for
    # steps bound by the host's launches), max-autotune-no-cudagraphs, max-autotune; auto:
    # mgpu.models.compile_mode decides (CUDA graphs for a model compiled whole on a GPU).
    compile_mode: str = "auto"
    # CUDA math modes, set once per process before the model is built. tf32: float32 matrix
    # multiplies and convolutions (what autocast leaves in fp32) on TF32 tensor cores.
    # cudnn_benchmark: cuDNN times its convolution algorithms for each new input shape and keeps
    # the fastest (the first steps of each shape are slower; results may differ in the last bits
    # from one process to the next, so set it false for bitwise repeatable convolutions).
    tf32: bool = True
    cudnn_benchmark: bool = True
    # A step whose loss or gradients are NaN/inf, on any rank: stop before the optimizer step,
    # or skip that step on every rank (at most max_consecutive_skips in a row, then stop).
    nonfinite: NonFinite = NonFinite.stop
    max_consecutive_skips: int = 5
    # fp16 only: the loss scale to start from; overflowing steps halve it, 2000 clean ones
    # double it (torch's GradScaler). Lower it if the first steps of a run all overflow.
    loss_scale_init: float = 65536.0
    # Seconds a rank may make no progress (a data loader that never yields, a stuck evaluation,
    # a host blocked behind a hung NCCL collective) before it fails naming the phase and the
    # rank behind; 0 turns it off. Below dist.timeout_s, so that on NCCL it reports before the
    # NCCL watchdog ends the process without a word about the other ranks.
    stall_timeout_s: float = 300.0
    # torch.profiler traces per rank (into <run dir>/profile/) for profile_steps steps from
    # step profile_start; NVTX ranges mark the phases of each step for Nsight Systems.
    profile: bool = False
    profile_start: int = 10
    profile_steps: int = 5
    # The device's peak dense TFLOP/s for MFU at the training precision; 0: from mgpu's table
    # of common GPUs (MFU is not reported on a device the table lacks, unless set here).
    peak_tflops: float = 0.0

    def __post_init__(self) -> None:
        _positive("trainer.max_steps", self.max_steps, "1000")
        _positive("trainer.max_consecutive_skips", self.max_consecutive_skips, "5")
        _positive("trainer.loss_scale_init", self.loss_scale_init, "65536")
        _non_negative("trainer.stall_timeout_s", self.stall_timeout_s, "300 (0 turns it off)")
        _positive("trainer.profile_start", self.profile_start, "10")
        _positive("trainer.profile_steps", self.profile_steps, "5")
        _non_negative("trainer.peak_tflops", self.peak_tflops, "989 (0: mgpu's table)")
        _positive("trainer.grad_accum_steps", self.grad_accum_steps, "4")
        _non_negative("trainer.grad_clip", self.grad_clip, "1.0 (0 turns clipping off)")
        _positive("trainer.log_every", self.log_every, "10")
        _non_negative("trainer.eval_every", self.eval_every, "500 (0: only at the end)")
        _non_negative("trainer.seed", self.seed, "0")
        self.compile = _auto_or_bool("trainer.compile", self.compile)
        _require(
            self.compile_mode in COMPILE_MODES,
            "trainer.compile_mode",
            self.compile_mode,
            f"must be one of {', '.join(COMPILE_MODES)}",
        )
        _require(
            self.compile_mode in ("auto", "default") or self.compile_backend == "inductor",
            "trainer.compile_mode",
            self.compile_mode,
            f"needs trainer.compile_backend=inductor (it is {self.compile_backend}); "
            "or set trainer.compile_mode=default",
        )
        _require(
            bool(self.compile_backend),
            "trainer.compile_backend",
            self.compile_backend,
            "must name a torch.compile backend, e.g. inductor",
        )

    def compiles(self, device_type: str) -> bool:
        """Whether `trainer.compile` means compiling on this device ("cuda", "cpu")."""
        return device_type == "cuda" if self.compile == "auto" else self.compile


@dataclass
class DistConfig:
    engine: Engine = Engine.mgpu  # how gradients are averaged across processes
    backend: Backend = Backend.auto  # auto: nccl when CUDA GPUs are visible, else gloo
    timeout_s: float = 600.0  # a collective that waits longer than this fails instead of hanging
    bucket_cap_mb: float = 25.0  # gradient bucket size (mgpu and torch_ddp)
    first_bucket_mb: float = 1.0  # mgpu: the first bucket is small so communication starts early
    reduce_dtype: ReduceDtype = ReduceDtype.fp32  # mgpu: bf16 halves the bytes on the wire
    find_unused: bool = False  # reduce zeros for parameters that get no gradient in a step
    # Buffers (BatchNorm running statistics) follow rank 0's at the start of every optimizer
    # step. false: each rank keeps its own statistics (one collective less per step; rank 0's
    # are the ones checkpointed and evaluated).
    broadcast_buffers: bool = True
    # Each worker (and its DataLoader workers) on its own equal block of the node's CPUs, so
    # launch threads of the ranks do not compete or migrate; for launch-bound models.
    cpu_affinity: bool = False
    # mgpu: at most this many SMs for NCCL's kernels (on a communicator of mgpu's own), leaving
    # the rest to the backward kernels they overlap with; 0: NCCL's own choice
    nccl_max_ctas: int = 0
    ddp_bucket_view: bool = False  # torch_ddp: gradient_as_bucket_view
    ddp_static_graph: bool = False  # torch_ddp: static_graph

    def __post_init__(self) -> None:
        _positive("dist.timeout_s", self.timeout_s, "600")
        _positive("dist.bucket_cap_mb", self.bucket_cap_mb, "25")
        _positive("dist.first_bucket_mb", self.first_bucket_mb, "1")
        _non_negative("dist.nccl_max_ctas", self.nccl_max_ctas, "4 (0: NCCL's choice)")


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-3  # peak learning rate, reached after warmup
    weight_decay: float = 0.1  # applied to matrices and embeddings only, not to biases and norms
    warmup_steps: int = 20  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = 0.1  # cosine decay ends at optim.lr * min_lr_ratio at trainer.max_steps
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.9  # sgd

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr, "3e-4")
        _non_negative("optim.weight_decay", self.weight_decay, "0.1")
        _non_negative("optim.warmup_steps", self.warmup_steps, "100")
        ok = 0 <= self.min_lr_ratio <= 1
        _require(ok, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1], e.g. 0.1")
        ok = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        _require(ok, "optim.betas", self.betas, "must be two numbers in [0, 1), e.g. [0.9,0.95]")
        _positive("optim.eps", self.eps, "1e-8")
        ok = 0 <= self.momentum < 1
        _require(ok, "optim.momentum", self.momentum, "must be in [0, 1), e.g. 0.9")


@dataclass
class CheckpointConfig:
    every: int = 100  # steps between checkpoints; 0: only the final one at the end of training
    keep_last: int = 3  # newest valid checkpoints kept in <run dir>/checkpoints/; older deleted
    # auto: the newest valid one in the run dir, if any; never: start at step 0; or a step dir.
    # After a torchrun restart the newest valid one in the run dir comes first, whatever this is.
    resume: str = "auto"

    def __post_init__(self) -> None:
        _non_negative("ckpt.every", self.every, "100 (0: only the final checkpoint)")
        _positive("ckpt.keep_last", self.keep_last, "3")
        ok = self.resume in ("auto", "never") or os.path.isdir(self.resume)
        why = "must be auto, never, or an existing <run dir>/checkpoints/step-NNNNNNNN directory"
        _require(ok, "ckpt.resume", self.resume, why)


# ---- data: one schema per built-in dataset; the loader keys are shared ----


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
class ImageFolderDataConfig(DataConfig):
    """Your own images: `data=image_folder data.path=DIR`, one subfolder of images per class."""

    _target_: str = "mgpu.data.ImageFolder"
    path: str = MISSING  # DIR/<class>/<image>.jpg|.jpeg|.png: the training images
    # The same layout for evaluation; empty: eval_samples images of data.path are held out
    # (spread evenly over its sorted file list) and not trained on.
    eval_path: str = ""
    eval_samples: int = 1000
    # The class folders, in label order. Empty: every subfolder of data.path, sorted by name;
    # the run's config.yaml records the list, so a later evaluation keeps the same labels.
    classes: list[str] = field(default_factory=list)
    image_size: int = 224  # training crops and evaluation crops are image_size x image_size
    # Where JPEGs are decoded: cpu (Pillow, in the DataLoader workers), gpu (torchvision's
    # nvJPEG, in the prefetcher; PNGs stay on the CPU), auto (mgpu.data.gpu_decode says which).
    decode: Decode = Decode.auto
    # An unreadable image: error stops the run naming the file; skip replaces it by the next
    # readable one, names it in the rank's log and counts it (data/bad_files_replaced).
    bad_files: BadFiles = BadFiles.error
    # Training crops: a random box of scale x the image's area and an aspect ratio log-uniform
    # in ratio, resized to image_size, flipped half the time (drawn from trainer.seed, the
    # epoch and the sample). Evaluation: the center square of eval_crop x the shorter side.
    scale: list[float] = field(default_factory=lambda: [0.08, 1.0])
    ratio: list[float] = field(default_factory=lambda: [3 / 4, 4 / 3])
    eval_crop: float = 0.875

    def __post_init__(self) -> None:
        super().__post_init__()
        # Built in code (tests, benchmarks) these may come as the names users type.
        self.decode = Decode(getattr(self.decode, "value", self.decode))
        self.bad_files = BadFiles(getattr(self.bad_files, "value", self.bad_files))
        _positive("data.image_size", self.image_size, "224")
        _positive("data.eval_samples", self.eval_samples, "1000")
        ok = len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] <= 1
        _require(ok, "data.scale", self.scale, "must be [min,max] in (0, 1], e.g. [0.08,1.0]")
        ok = len(self.ratio) == 2 and 0 < self.ratio[0] <= self.ratio[1]
        _require(ok, "data.ratio", self.ratio, "must be [min,max] > 0, e.g. [0.75,1.3333]")
        ok = 0 < self.eval_crop <= 1
        _require(ok, "data.eval_crop", self.eval_crop, "must be in (0, 1], e.g. 0.875")
        if self.decode is Decode.gpu:
            why = gpu_decode_unavailable()
            _require(why is None, "data.decode", "gpu", f"{why}; use data.decode=cpu")
        self._check_folders()

    def _check_folders(self) -> None:
        """The image tree: missing paths, no class folders, empty ones. A folder listing per
        class, before any process group exists."""
        try:
            check_root("data.path", self.path)
            discovered = class_folders(self.path)
            if not self.classes:
                self.classes = discovered
            check_layout("data.path", self.path, self.classes)
            if self.eval_path:
                check_layout("data.eval_path", self.eval_path, self.classes)
                extra = sorted(set(class_folders(self.eval_path)) - set(self.classes))
                _require(
                    not extra,
                    "data.eval_path",
                    self.eval_path,
                    f"has class folders {extra} that are not among the classes; remove them "
                    "or add them to data.path",
                )
        except FolderError as err:
            raise ConfigError(err.key, err.value, err.why) from None

    def resolved(self) -> dict[str, Any]:
        """Values found on disk, for the run's saved config: the class list."""
        return {"classes": list(self.classes)}

    def dataset_kwargs(self) -> dict[str, Any]:
        kwargs = super().dataset_kwargs()
        kwargs["decode"] = resolve_decode(self.decode.value)
        kwargs["bad_files"] = self.bad_files.value
        return kwargs


@dataclass
class CustomDataConfig(DataConfig):
    """A user's Dataset: `data=custom data._target_=pkg.MyDataset +data.kwargs.root=/data`."""

    kwargs: dict[str, Any] = field(default_factory=dict)

    def dataset_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)


# ---- models ----


@dataclass
class ModelConfig:
    _target_: str = MISSING  # import path of an nn.Module class built as Cls(**kwargs)

    def model_kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "_target_"}


@dataclass
class GPTModelConfig(ModelConfig):
    _target_: str = "mgpu.models.GPT"
    vocab_size: int = 256
    block_size: int = 64  # longest sequence the position embedding covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False
    # Attention kernel: auto (cuDNN first, then torch's order), torch (torch's own choice), or
    # only one of cudnn, flash, efficient, math.
    attention: str = "auto"

    def __post_init__(self) -> None:
        from mgpu.models.gpt import ATTENTION  # the kernels live with the model

        _require(
            self.attention in ATTENTION,
            "model.attention",
            self.attention,
            f"must be one of {', '.join(ATTENTION)}",
        )
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            _positive(f"model.{key}", getattr(self, key), "a positive integer")
        _require(
            self.n_embd % self.n_head == 0,
            "model.n_embd",
            self.n_embd,
            f"must be divisible by model.n_head ({self.n_head})",
        )
        _require(0 <= self.dropout < 1, "model.dropout", self.dropout, "must be in [0, 1)")


@dataclass
class ResNetModelConfig(ModelConfig):
    _target_: str = "mgpu.models.ResNet"
    num_classes: int = 10
    block: str = "basic"  # basic | bottleneck
    layers: list[int] = field(default_factory=lambda: [1, 1, 1, 1])  # blocks per stage
    width: int = 16  # channels of the first stage
    in_channels: int = 3
    stem: str = "cifar"  # cifar (3x3, no pool, for small images) | imagenet (7x7 + pool)

    def __post_init__(self) -> None:
        _positive("model.num_classes", self.num_classes, "10")
        _positive("model.width", self.width, "64")
        _require(
            self.block in ("basic", "bottleneck"),
            "model.block",
            self.block,
            "must be basic or bottleneck",
        )
        _require(
            self.stem in ("cifar", "imagenet"), "model.stem", self.stem, "must be cifar or imagenet"
        )
        _require(
            len(self.layers) > 0 and all(n > 0 for n in self.layers),
            "model.layers",
            self.layers,
            "must be a non-empty list of positive block counts",
        )


@dataclass
class MLPModelConfig(ModelConfig):
    _target_: str = "mgpu.models.MLP"
    in_features: int = 3 * 32 * 32
    num_classes: int = 10
    hidden: list[int] = field(default_factory=lambda: [256, 256])
    dropout: float = 0.0

    def __post_init__(self) -> None:
        _positive("model.in_features", self.in_features, "3072")
        _positive("model.num_classes", self.num_classes, "10")
        _require(
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


@dataclass
class Config:
    model: Any = MISSING  # one of the model schemas above, chosen by `model=...`
    data: Any = MISSING  # one of the data schemas above, chosen by `data=...`
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        _check_model_fits_data(self.model, self.data)


def _check_model_fits_data(model: ModelConfig, data: DataConfig) -> None:
    """Catch a model/data pairing that would only fail deep inside the first step."""
    if isinstance(data, ImageFolderDataConfig):
        _check_model_fits_folder(model, data)
    if isinstance(model, GPTModelConfig):
        if isinstance(data, ImageDataConfig):
            raise ConfigError("data", "images", "a GPT model needs token data, e.g. data=ngram")
        if isinstance(data, (NgramDataConfig, TokenFileDataConfig)):
            _require(
                data.vocab_size <= model.vocab_size,
                "model.vocab_size",
                model.vocab_size,
                f"is smaller than data.vocab_size ({data.vocab_size}); raise it",
            )
            _require(
                data.seq_len <= model.block_size,
                "data.seq_len",
                data.seq_len,
                f"exceeds model.block_size ({model.block_size}); lower it or raise that",
            )
    if isinstance(model, (ResNetModelConfig, MLPModelConfig)):
        if isinstance(data, (NgramDataConfig, TokenFileDataConfig)):
            raise ConfigError("data", "tokens", "an image model needs image data: data=images")
        if isinstance(data, ImageDataConfig):
            _require(
                data.num_classes <= model.num_classes,
                "model.num_classes",
                model.num_classes,
                f"is smaller than data.num_classes ({data.num_classes})",
            )
    if isinstance(model, ResNetModelConfig) and isinstance(data, ImageDataConfig):
        _require(
            model.in_channels == data.channels,
            "model.in_channels",
            model.in_channels,
            f"must equal data.channels ({data.channels})",
        )
    if isinstance(model, MLPModelConfig) and isinstance(data, ImageDataConfig):
        pixels = data.channels * data.image_size**2
        _require(
            model.in_features == pixels,
            "model.in_features",
            model.in_features,
            f"must equal data.channels * data.image_size**2 = {pixels}",
        )


def _check_model_fits_folder(model: ModelConfig, data: ImageFolderDataConfig) -> None:
    classes = len(data.classes)
    if isinstance(model, GPTModelConfig):
        raise ConfigError("data", "image_folder", "a GPT model needs token data, e.g. data=tokens")
    if isinstance(model, (ResNetModelConfig, MLPModelConfig)):
        _require(
            model.num_classes >= classes,
            "model.num_classes",
            model.num_classes,
            f"is smaller than the {classes} classes of data.path; set model.num_classes={classes}",
        )
    if isinstance(model, ResNetModelConfig):
        _require(model.in_channels == 3, "model.in_channels", model.in_channels, "must be 3 (RGB)")
    if isinstance(model, MLPModelConfig):
        pixels = 3 * data.image_size**2
        _require(
            model.in_features == pixels,
            "model.in_features",
            model.in_features,
            f"must equal 3 * data.image_size**2 = {pixels}",
        )


def build_from_target(key: str, target: str, kwargs: dict[str, Any], **extra: Any) -> Any:
    """`target(**extra, **kwargs)` for a `_target_` import path, naming the key if it fails."""
    try:
        factory = get_object(target)
    except Exception as err:
        raise ConfigError(f"{key}._target_", target, f"cannot be imported: {err}") from err
    return factory(**extra, **kwargs)


def to_config(cfg: DictConfig) -> Config:
    """Composed Hydra config -> validated typed Config (runs every __post_init__ check)."""
    _reject_unknown_keys(cfg)
    # Converting group by group leaves out Hydra's own `hydra` node, and building Config last
    # runs the cross-group checks in Config.__post_init__.
    parts = {f.name: OmegaConf.to_object(cfg[f.name]) for f in fields(Config)}
    config = Config(**parts)
    _record_resolved(cfg, config)
    return config


def _record_resolved(cfg: DictConfig, config: Config) -> None:
    """Write what a data schema found on disk (data=image_folder's class list) into the composed
    config, so that the run's config.yaml, made from it, records it (the labels must not
    change when a folder is added later)."""
    resolved = getattr(config.data, "resolved", None)
    if resolved is None:
        return
    with read_write(cfg):
        for key, value in resolved().items():
            cfg.data[key] = value


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """`+optim.lrr=1` adds a key the schema lacks; OmegaConf would drop it without a word."""
    top = {f.name for f in fields(Config)} | {"hydra"}
    for key in cfg.keys():
        _require(key in top, str(key), cfg[key], f"is not an mgpu setting; known: {sorted(top)}")
    for group in top - {"hydra"}:
        schema = OmegaConf.get_type(cfg[group])
        known = {f.name for f in fields(schema)}
        for key in cfg[group].keys():
            _require(
                key in known,
                f"{group}.{key}",
                cfg[group][key],
                f"is not a key of {group} ({schema.__name__}); known: {sorted(known)}",
            )


def describe_error(err: Exception) -> str:
    """One line for a config error, whether ours or OmegaConf's."""
    if isinstance(err, OmegaConfBaseException):
        key = getattr(err, "full_key", None)
        first = str(err).splitlines()[0]
        if isinstance(err, MissingMandatoryValue):
            return f"{key} is required and has no value: set it on the command line, {key}=..."
        return f"{key}: {first}" if key else first
    return str(err)


class ValidateOnRunStart(Callback):
    """Hydra calls this after composing the config and before it creates the run directory."""

    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            cfg = to_config(config)
            dist.check_launch(cfg.dist.backend.value)
            dist.check_sweep_launch(multirun=config.hydra.mode.name == "MULTIRUN")
        except (ConfigError, OmegaConfBaseException, dist.LaunchError) as err:
            # SystemExit passes through Hydra's error handler untouched, so the user sees
            # exactly one line and no traceback.
            print(f"mgpu: config error: {describe_error(err)}", file=sys.stderr)
            sys.exit(2)

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        self.on_run_start(config)


def register() -> None:
    """Put the schemas into Hydra's ConfigStore and the run-name resolver into OmegaConf."""
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    for group, name, node in [
        ("model", "gpt_schema", GPTModelConfig),
        ("model", "resnet_schema", ResNetModelConfig),
        ("model", "mlp_schema", MLPModelConfig),
        ("model", "custom_schema", CustomModelConfig),
        ("data", "ngram_schema", NgramDataConfig),
        ("data", "images_schema", ImageDataConfig),
        ("data", "tokens_schema", TokenFileDataConfig),
        ("data", "image_folder_schema", ImageFolderDataConfig),
        ("data", "custom_schema", CustomDataConfig),
    ]:
        cs.store(group=group, name=name, node=node)
    if not OmegaConf.has_resolver("mgpu_run_name"):
        OmegaConf.register_new_resolver("mgpu_run_name", dist.launch_run_name)


register()
