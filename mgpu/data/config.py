"""The data group's schemas (`data=...`): one per built-in dataset, plus a user's own; the loader
keys (batch size, workers, prefetching) are shared by all of them in DataConfig. A token file's
schema is mgpu.data.token_config's."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, fields
from enum import Enum
from typing import Any

from omegaconf import MISSING

from mgpu.config.checks import (
    ConfigError,
    auto_or_positive_int,
    non_negative,
    positive,
    positive_fields,
    require,
)
from mgpu.data.folder_files import (
    FolderError,
    auto_eval_samples,
    check_layout,
    check_root,
    check_two_classes,
    class_folders,
    count_images,
    missing_classes,
)
from mgpu.data.gpu_decode import gpu_decode_unavailable, resolve_decode
from mgpu.data.image_shards import load_index

log = logging.getLogger(__name__)


class Decode(Enum):
    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class BadFiles(Enum):
    error = "error"
    skip = "skip"


def short_of_a_batch(batch_size: int, world_size: int, per_rank: int) -> ConfigError:
    """A training split that gives each of `world_size` processes `per_rank` samples, fewer than
    data.batch_size: what the loader says once the data set is known, and a token file's config
    before the run directory exists."""
    return ConfigError(
        "data.batch_size",
        batch_size,
        f"each of the {world_size} processes gets only {per_rank} training samples, less than "
        "one batch; "
        + (f"lower data.batch_size (at most {per_rank} here), " if per_rank else "")
        + "run fewer processes, or train on more data",
    )


@dataclass
class DataConfig:
    _target_: str = MISSING  # import path of a Dataset class built as Cls(split=..., **kwargs)
    batch_size: int = 32  # per device, per micro-step
    # DataLoader worker processes per rank: a number, or auto (this node's CPUs shared out per
    # local process, less two for the training process's own threads;
    # mgpu.data.loader.worker_count).
    num_workers: Any = "auto"
    pin_memory: bool = True  # page-locked host batches; applies when training on CUDA
    prefetch_factor: int = 2  # batches each DataLoader worker prepares ahead (with workers > 0)
    prefetch_depth: int = 2  # batches copied to the GPU ahead of use, on the loader's side stream
    device_transform: str = "auto"  # auto: the dataset's `device_transform`; none: leave inputs
    # DataLoader workers stay off the first two CPUs of this process's share, which stay the
    # training process's own (its launching thread and the prefetcher's copy thread); without
    # it the scheduler lets busy workers take them (mgpu.data.loader.spare_cpus). Off until
    # measured: bench/real_images.py --variant keep=data.keep_trainer_cores=true.
    keep_trainer_cores: bool = False
    # DataLoader workers run this much nicer than the training process (os.nice, 0-19): where
    # the workers keep every core busy, a training thread that wakes (the launching thread, the
    # prefetcher's copy thread, NCCL's proxy) is then run before them instead of waiting for a
    # worker's time slice; on several GPUs one rank late by a slice holds up every rank's
    # all-reduce. 0, the trainer's own priority: on 2 H200s 10 and 19 ran 0.005-0.013 below it
    # (bench/README.md, 2026-11-28 12:28).
    worker_nice: int = 0

    def __post_init__(self) -> None:
        positive("data.batch_size", self.batch_size, "32")
        if self.num_workers != "auto":
            ok = isinstance(self.num_workers, int) and not isinstance(self.num_workers, bool)
            why = "must be auto or a number of worker processes >= 0, e.g. data.num_workers=8"
            require(ok and self.num_workers >= 0, "data.num_workers", self.num_workers, why)
        positive("data.prefetch_factor", self.prefetch_factor, "2")
        nice_ok = isinstance(self.worker_nice, int) and not isinstance(self.worker_nice, bool)
        require(
            nice_ok and 0 <= self.worker_nice <= 19,
            "data.worker_nice",
            self.worker_nice,
            "must be a niceness from 0 (the trainer's priority) to 19 (the lowest), "
            "e.g. data.worker_nice=10",
        )
        positive("data.prefetch_depth", self.prefetch_depth, "2")
        require(
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
        keys = ("vocab_size", "seq_len", "order", "branching", "num_samples", "eval_samples")
        positive_fields(self, "data", keys)
        require(
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
        keys = ("num_classes", "image_size", "channels", "num_samples", "eval_samples")
        positive_fields(self, "data", keys)
        non_negative("data.noise", self.noise, "48")
        # as an image folder of one class is refused: its loss is 0 from the first step
        why = "a classifier learns nothing from one class (its loss is 0); e.g. data.num_classes=10"
        require(self.num_classes > 1, "data.num_classes", self.num_classes, why)


def _some_classes_left_out(eval_path: str, missing: list[str], classes: int) -> None:
    """data.eval_path holds a part of the classes: its evaluations are of those alone."""
    if missing:
        log.warning(
            "data.eval_path=%s has no images of %d of the %d classes (%s%s): evaluations are of "
            "the others' images alone", eval_path, len(missing), classes, ", ".join(missing[:3]),
            ", ..." * (len(missing) > 3),
        )  # fmt: skip


def _no_extra_classes(eval_path: str, found, classes: list[str], what: str, fix: str) -> None:
    """data.eval_path holds no class that training lacks (its labels would not exist)."""
    extra = sorted(set(found) - set(classes))
    why = f"has {what} {extra} that are not among the classes; {fix} them or add them to data.path"
    require(not extra, "data.eval_path", eval_path, why)


@dataclass
class ImageFolderDataConfig(DataConfig):
    """Your own images: `data=image_folder data.path=DIR`, one subfolder of images per class."""

    _target_: str = "mgpu.data.ImageFolder"
    path: str = MISSING  # DIR/<class>/<image>.jpg|.jpeg|.png: the training images
    # The same layout for evaluation; empty: eval_samples images of data.path are held out
    # (spread evenly over its sorted file list) and not trained on.
    eval_path: str = ""
    # auto: 2 % of data.path's images, at least 16 and at most 10,000, and never more than a
    # fifth of a small folder (mgpu.data.image_folder.auto_eval_samples); the run's config.yaml
    # records the number. Unused with data.eval_path.
    eval_samples: Any = "auto"
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
    # JPEGs decoded on the CPU at 1/2, 1/4 or 1/8 size (libjpeg's DCT scaling) when the crop box
    # is that many times image_size: a 2400x1800 photo costs what a 600x450 one does. Pixels
    # differ from a full decode by about a level on average (tests/test_image_folder.py).
    reduced_decode: bool = True
    # Under data.decode=gpu: this share of the JPEGs (drawn per sample from trainer.seed, the
    # epoch and the sample, so a resumed run decodes each where it did) is decoded and cropped
    # by the DataLoader workers instead, which the GPU path otherwise leaves idle; the GPU
    # decodes the rest. 0: every JPEG nvJPEG takes goes to the GPU. Those samples' pixels are
    # decode=cpu's (within a level or two of the GPU's; DCT-scaled under reduced_decode),
    # evaluation's included. Under decode=cpu (or auto resolving to it) it does nothing. A fixed
    # share is a bet on the host's cores: 0.3 gained 0.025 on one H100 machine and lost 0.18 on
    # another whose cores decode a quarter slower (bench/README.md, "Real images"). auto (the
    # default): measured at start-up on this host and the run's own JPEGs, each side's share in
    # proportion to its rate, and the JPEGs whose crop the CPU decodes DCT-scaled (large photos,
    # under reduced_decode: a fraction of a core's full decode, all of the GPU's) given to the
    # workers first where that frees more GPU time (mgpu.data.decode_split); the log says the
    # rates and the shares, and checkpoints keep them, so a resumed run (and mgpu.evaluate of a
    # checkpoint) decodes each image where it was decoded before.
    cpu_decode_share: Any = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
        # Built in code (tests, benchmarks) these may come as the names users type.
        self.decode = Decode(getattr(self.decode, "value", self.decode))
        self.bad_files = BadFiles(getattr(self.bad_files, "value", self.bad_files))
        positive("data.image_size", self.image_size, "224")
        auto_or_positive_int("data.eval_samples", self.eval_samples, "a share of data.path")
        ok = len(self.scale) == 2 and 0 < self.scale[0] <= self.scale[1] <= 1
        require(ok, "data.scale", self.scale, "must be [min,max] in (0, 1], e.g. [0.08,1.0]")
        ok = len(self.ratio) == 2 and 0 < self.ratio[0] <= self.ratio[1]
        require(ok, "data.ratio", self.ratio, "must be [min,max] > 0, e.g. [0.75,1.3333]")
        ok = 0 < self.eval_crop <= 1
        require(ok, "data.eval_crop", self.eval_crop, "must be in (0, 1], e.g. 0.875")
        share = self.cpu_decode_share
        number = isinstance(share, int | float) and not isinstance(share, bool)
        ok = share == "auto" or (number and 0 <= share < 1)
        why = "must be auto or in [0, 1), e.g. 0.25 (every image on the CPU is data.decode=cpu)"
        require(ok, "data.cpu_decode_share", share, why)
        if self.decode is Decode.gpu:
            why = gpu_decode_unavailable()
            require(why is None, "data.decode", "gpu", f"{why}; use data.decode=cpu")
        self._check_folders()

    def _check_folders(self) -> None:
        """The image tree: missing paths, no class folders, empty ones. A folder listing per
        class, before any process group exists."""
        if self.classes and not os.path.isdir(self.path):
            # A saved config (its classes recorded) whose folder is gone or elsewhere from here:
            # mgpu.export and mgpu.sample never read it, and evaluate and train.py check it
            # where they read it (mgpu.run.cli.check_config for a run).
            return
        try:
            check_root("data.path", self.path)
            discovered = class_folders(self.path)
            asked = bool(self.classes)
            if not asked:
                self.classes = discovered
            check_layout("data.path", self.path, self.classes)
            check_two_classes(self.path, self.classes, asked)
            if self.eval_path:
                self._eval_path_apart()
                check_layout("data.eval_path", self.eval_path, self.classes, some=True)
                missing = missing_classes("data.eval_path", self.eval_path, self.classes, True)
                _some_classes_left_out(self.eval_path, missing, len(self.classes))
                found = class_folders(self.eval_path)
                _no_extra_classes(self.eval_path, found, self.classes, "class folders", "remove")
            else:
                self._hold_out(count_images(self.path, self.classes))
        except FolderError as err:
            raise ConfigError(err.key, err.value, err.why) from None

    def _eval_path_apart(self) -> None:
        if os.path.realpath(self.eval_path) == os.path.realpath(self.path):
            log.warning(
                "data.eval_path=%s is data.path itself: evaluations are of images the run "
                "trains on; leave it unset to hold some of them out", self.eval_path,
            )  # fmt: skip

    def _hold_out(self, images: int) -> None:
        """eval_samples of data.path's `images` held out: auto resolved, a number checked (too
        many would stop the run as it builds its data, after the run directory exists)."""
        self._train_images = images  # less the holdout: check_train_batches
        if self.eval_samples == "auto":
            self.eval_samples = auto_eval_samples(images)
        require(
            self.eval_samples < images,
            "data.eval_samples",
            self.eval_samples,
            f"data.path holds only {images} images, and some must be left to train on; set "
            f"data.eval_samples=auto ({auto_eval_samples(images)} here), a lower number, or "
            "data.eval_path",
        )

    def check_train_batches(self, world_size: int) -> None:
        """Training gets a whole batch on each of `world_size` processes from the images the
        holdout leaves: said before any run directory exists (the training loader would say it
        only after). Known where data.path's images were counted (no data.eval_path)."""
        found = getattr(self, "_train_images", None)
        if found is not None and (found - self.eval_samples) // world_size < self.batch_size:
            raise short_of_a_batch(
                self.batch_size, world_size, (found - self.eval_samples) // world_size
            )

    def resolved(self) -> dict[str, Any]:
        """Values found on disk, for the run's saved config: the class list and the holdout."""
        return {"classes": list(self.classes), "eval_samples": self.eval_samples}

    def dataset_kwargs(self) -> dict[str, Any]:
        kwargs = super().dataset_kwargs()
        kwargs["decode"] = resolve_decode(self.decode.value)
        share = self.cpu_decode_share
        if share and kwargs["decode"] == "cpu" and share != "auto":
            log.warning(
                "data.cpu_decode_share=%s does nothing: data.decode resolved to cpu, where the "
                "workers decode every image", share,
            )  # fmt: skip
        # auto: the data sets start at 0, and mgpu.data.decode_split gives them the measured
        # share before their workers start.
        kwargs["cpu_decode_share"] = 0.0 if share == "auto" else float(share)
        kwargs["bad_files"] = self.bad_files.value
        return kwargs


@dataclass
class CustomDataConfig(DataConfig):
    """A user's Dataset: `data=custom data._target_=pkg.MyDataset +data.kwargs.root=/data`."""

    kwargs: dict[str, Any] = field(default_factory=dict)

    def dataset_kwargs(self) -> dict[str, Any]:
        return dict(self.kwargs)


@dataclass
class ImageShardsDataConfig(ImageFolderDataConfig):
    """A prepared image set: `data=image_shards data.path=DST`, written once from an image folder
    by `python -m mgpu.data.prepare_images SRC DST --max-side N`. Every other key is
    data=image_folder's and means the same."""

    _target_: str = "mgpu.data.ImageShards"
    # prepare_images' DST: index.json and shard-NNNNNN.tar files. data.eval_path, if set, is
    # another prepared set (e.g. of the validation folder).
    path: str = MISSING

    def _check_folders(self) -> None:
        """The index of each set, its shard files, and the class list against it: before any
        process group exists. Empty classes: the index's (SRC's class folders, sorted)."""
        try:
            index = load_index("data.path", self.path)
            asked = bool(self.classes)
            self.classes = self.classes or list(index.classes)
            labels = index.labels_for("data.path", self.classes)
            fix = "prepare it again from a folder of two or more class subfolders"
            check_two_classes(self.path, self.classes, asked, fix)
            if not self.eval_path:
                self._hold_out(int((labels >= 0).sum()))
            if self.eval_path:
                self._eval_path_apart()
                evals = load_index("data.eval_path", self.eval_path)
                evals.labels_for("data.eval_path", self.classes, some=True)
                missing = [name for name in self.classes if name not in evals.classes]
                _some_classes_left_out(self.eval_path, missing, len(self.classes))
                _no_extra_classes(
                    self.eval_path, evals.classes, self.classes, "classes", "prepare it without"
                )
        except FolderError as err:
            raise ConfigError(err.key, err.value, err.why) from None
