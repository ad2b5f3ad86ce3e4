"""Images from a class-per-subfolder tree (JPEG and PNG), ImageNet's layout: the folder scan and
its checks, the crops (random-resized with flips for training, a center crop for evaluation),
and Pillow decoding in DataLoader workers. With decode=gpu the workers hand over JPEG bytes
instead, and mgpu.data.gpu_decode decodes and crops them on the GPU.

Every sample is a pure function of (file, seed, epoch, index): the training sampler hands the
dataset a SampleKey, and the crop and flip are drawn from it, so a resumed run sees the same
pixels as an uninterrupted one.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import Dataset, get_worker_info

from mgpu.data.crops import (
    center_crop,
    crop_resize,
    dct_factor,
    draft_for_crop,
    random_resized_crop,
)
from mgpu.data.encoded import (  # noqa: F401 - BadImageFile: users catch it here too
    REMOVE_OR_SKIP,
    BadImageFile,
    Encoded,
    collate_encoded,
)
from mgpu.data.folder_files import (
    class_folders,
    held_out_digest,
    left_out_line,
    scan,
    split_indices,
)
from mgpu.data.gpu_decode import gpu_decoder
from mgpu.data.images import normalize_uint8
from mgpu.data.sampler import SampleKey

log = logging.getLogger(__name__)

# Pillow's errors for a file that is not a readable image: unidentified (OSError), truncated
# (OSError), broken headers (SyntaxError, ValueError), absurd sizes (DecompressionBombError).
UNREADABLE = (OSError, SyntaxError, ValueError, Image.DecompressionBombError)
# checkpoint_state's keys: the decode shares, and workers_from (mgpu.data.decode_split's)
STATE_KEY, SCALED_KEY, WORKERS_KEY = "cpu_decode_share", "cpu_decode_share_scaled", "workers_from"
NEVER = 2**62  # workers_from while the shares hold for the whole run: past any position
# Slots of the shared replaced-files counter: slot 0 for the main process (the GPU decode), one
# per DataLoader worker after it, so that no two processes add to the same number.
COUNTER_SLOTS = 257


def eight_bits(image: Image.Image) -> Image.Image:
    """A 16-bit grayscale image (a PNG's: Pillow's mode I;16 or I) scaled to 8-bit "L", as
    conversions to RGB and L then take it; any other image as it is. Pillow's own conversion
    clips such values at 255, which turns most of an image white."""
    if image.mode not in ("I", "I;16", "I;16B", "I;16L"):
        return image
    values = np.clip(np.asarray(image, dtype=np.int64), 0, 65535)
    return Image.fromarray((values >> 8).astype(np.uint8))


def unreadable_line(path: str, err: BaseException) -> str:
    """What is said of a file Pillow cannot read: in training (BadImageFile) and by
    `python -m mgpu.data.check_images`."""
    why = "not a format Pillow knows" if isinstance(err, UnidentifiedImageError) else err
    return f"{path}: not a readable image ({why})"


# ---- the dataset ----


class ImageFolder(Dataset):
    """uint8 [3, image_size, image_size] images and int64 labels from a class-per-folder tree.

    split=train: the images of `path` (less the held-out ones when there is no `eval_path`),
    random-resized crops with horizontal flips; split=eval: `eval_path`'s images, or
    `eval_samples` of `path`'s held out, center crops. decode=gpu: items are Encoded (and
    `device_decoder` makes the prefetcher's decode step). reduced_decode: JPEGs decoded on the
    CPU use DCT scaling where the crop allows (draft_for_crop).
    """

    choice = "image_folder"  # the data group choice that builds it, for its log line

    # The trainer applies this to inputs once they are on the device.
    device_transform = staticmethod(normalize_uint8)
    # The training sampler hands this dataset SampleKeys (index, epoch, seed), not indices.
    sample_keys = True

    def __init__(
        self,
        split: str,
        path: str,
        eval_path: str = "",
        classes: list[str] | tuple[str, ...] = (),
        image_size: int = 224,
        decode: str = "cpu",
        bad_files: str = "error",
        eval_samples: int | str = "auto",
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (3 / 4, 4 / 3),
        eval_crop: float = 0.875,
        reduced_decode: bool = True,
        cpu_decode_share: float = 0.0,
    ):
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} is not a known split; use 'train' or 'eval'")
        if decode not in ("cpu", "gpu"):
            raise ValueError(f"decode={decode!r}: use 'cpu' or 'gpu' (config resolves auto)")
        if bad_files not in ("error", "skip"):
            raise ValueError(f"bad_files={bad_files!r}: use 'error' or 'skip'")
        self.classes = list(classes) or class_folders(path)
        self.split, self.train = split, split == "train"
        self.image_size, self.decode, self.bad_files = image_size, decode, bad_files
        self.scale, self.ratio, self.eval_crop = tuple(scale), tuple(ratio), eval_crop
        self.reduced_decode = reduced_decode
        # workers_from, in memory shared with the DataLoader workers: set while they run
        self._workers_from = torch.full((1,), NEVER, dtype=torch.int64).share_memory_()
        self.set_cpu_decode_share(cpu_decode_share)
        self.num_classes = len(self.classes)
        self.tokens_per_sample = None
        self.sample_shape = (3, image_size, image_size)  # an input's shape (for FLOPs)
        self.held_out: str | None = None  # held_out_digest, where data.path's split holds out
        self.files, self.labels = self._split_files(path, eval_path, eval_samples)
        # Files replaced under bad_files=skip, in memory shared with the DataLoader workers.
        self._replaced = torch.zeros(COUNTER_SLOTS, dtype=torch.int64).share_memory_()
        # decode=gpu hands batches over as EncodedBatch; decode=cpu uses the default collate.
        self.collate = collate_encoded if decode == "gpu" else None
        log.info(
            "data=%s %s: %d images of %d classes, decoded on the %s",
            self.choice,
            split,
            len(self.files),
            self.num_classes,
            "GPU (nvJPEG; PNGs on the CPU)" if decode == "gpu" else "CPU (Pillow, in the workers)",
        )

    def _split_files(self, path: str, eval_path: str, eval_samples: int | str):
        if eval_path and not self.train:
            listing = scan("data.eval_path", eval_path, self.classes, some=True)
            self._say_left_out("data.eval_path", eval_path, listing.skipped)
            return listing.files, listing.labels
        files, labels, skipped = scan("data.path", path, self.classes)
        if self.train:  # the folder's held-out images are the train split's folder's
            self._say_left_out("data.path", path, skipped)
        if eval_path:
            return files, labels
        keep = split_indices(len(files), eval_samples, self.train)
        held = split_indices(len(files), eval_samples, False) if self.train else keep
        self.held_out = held_out_digest(path, files, held)
        return [files[i] for i in keep], [labels[i] for i in keep]

    @staticmethod
    def _say_left_out(key: str, root: str, skipped: list[str]) -> None:
        if skipped:  # a warning once (rank 0), in every rank's log
            later_rank = torch.distributed.is_initialized() and torch.distributed.get_rank() > 0
            (log.info if later_rank else log.warning)(left_out_line(key, root, skipped))

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, key: SampleKey | int) -> tuple[Tensor, Tensor] | Encoded:
        """Sample `key.index` as drawn for (key.seed, key.epoch); a plain index is epoch 0 of
        seed 0. bad_files=skip: an unreadable file is replaced by the next readable one."""
        index, epoch, seed, position = key if isinstance(key, SampleKey) else (int(key), 0, 0, 0)
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {self.split} split of {len(self)}")
        for offset in range(len(self)):
            i = (index + offset) % len(self)
            try:
                return self._sample(i, epoch, seed, position=position)
            except BadImageFile as err:
                if self.bad_files == "error":
                    raise BadImageFile(f"{err}; {REMOVE_OR_SKIP}") from None
                self.count_replaced(str(err))
        raise BadImageFile(f"none of the {len(self)} {self.split} images can be read")

    def __getitems__(self, keys: list[SampleKey | int]) -> list:
        """A batch's samples (the DataLoader's fetch calls this for a whole batch): under
        bad_files=error, one error naming every unreadable file of the batch, not the first."""
        samples, bad = [], []
        for key in keys:
            try:
                samples.append(self[key])
            except BadImageFile as err:
                bad.append(str(err).removesuffix(f"; {REMOVE_OR_SKIP}"))
        if len(bad) == 1:
            raise BadImageFile(f"{bad[0]}; {REMOVE_OR_SKIP}")
        if bad:
            fix = "remove them, or set data.bad_files=skip to replace them"
            raise BadImageFile(
                f"{len(bad)} unreadable images in one batch: {'; '.join(bad)}; {fix}"
            )
        return samples

    def crop(self, i: int, width: int, height: int, epoch: int, seed: int):
        """(box, flip) of sample i: drawn from (seed, epoch, i) for training, fixed for eval."""
        if not self.train:
            return center_crop(width, height, self.eval_crop), False
        rng = np.random.default_rng([seed, epoch, i])
        box = random_resized_crop(width, height, rng, self.scale, self.ratio)
        return box, bool(rng.random() < 0.5)

    def _sample(self, i: int, epoch: int, seed: int, cpu: bool | None = None, position: int = 0):
        """`cpu`: decode a JPEG the GPU could take on this CPU (True) or not (False); None:
        as on_cpu draws it for a sample at `position` in the training order."""
        path, label = self.files[i], self.labels[i]
        try:
            data = self.read_bytes(i)
            image = Image.open(io.BytesIO(data))
            box, flip = self.crop(i, *image.size, epoch, seed)
            gpu = self.decode == "gpu" and image.format == "JPEG" and image.mode in ("RGB", "L")
            if cpu is None and gpu:
                cpu = self.on_cpu(i, epoch, seed, self.decodes_scaled(box), position)
            if gpu and not cpu:
                # nvJPEG's baseline and progressive YCbCr/gray JPEGs: the GPU decodes these.
                # Only the header was read here; a file broken further in fails on the GPU.
                return Encoded(label, i, data=data, box=box, flip=flip)
            if self.reduced_decode:
                box = draft_for_crop(image, box, self.image_size)
            pixels = crop_resize(eight_bits(image).convert("RGB"), box, flip, self.image_size)
        except UNREADABLE as err:
            raise BadImageFile(unreadable_line(path, err)) from None
        if self.decode == "gpu":
            return Encoded(label, i, pixels=pixels)
        return pixels, torch.tensor(label, dtype=torch.int64)

    def set_cpu_decode_share(self, share: float, scaled: float | None = None) -> None:
        """Under decode=gpu, the share of the JPEGs the workers decode (cpu_decode_share; auto's
        measured one, mgpu.data.decode_split): `share` of those decoded at full size and
        `scaled` (default: `share`) of those whose crop lets the CPU decode them DCT-scaled
        (decodes_scaled). Before the DataLoader's workers start: they take the data set as it
        is then."""
        scaled = share if scaled is None else scaled
        if not 0 <= share < 1:
            raise ValueError(f"cpu_decode_share={share}: use a share in [0, 1)")
        if not 0 <= scaled <= 1:
            raise ValueError(f"cpu_decode_share's scaled share {scaled}: use a share in [0, 1]")
        self.cpu_decode_share, self.cpu_decode_share_scaled = float(share), float(scaled)
        # Compared with a 32-bit hash of the sample (on_cpu), as integer thresholds.
        gpu = self.decode == "gpu"
        self._cpu_below = round(share * 2**32) if gpu else 0
        self._cpu_below_scaled = round(scaled * 2**32) if gpu else 0

    def checkpoint_state(self) -> dict:
        """What a checkpoint keeps of the data set (the Trainer saves it; build_run hands it to
        mgpu.data.decode_split on resume): the decode shares, and where JPEGs were decoded."""
        return {
            STATE_KEY: self.cpu_decode_share,
            SCALED_KEY: self.cpu_decode_share_scaled,
            WORKERS_KEY: self.workers_from(),
            "decode": self.decode,
            "held_out": self.held_out,  # which images its evaluations were of
        }

    def workers_from(self) -> int | None:
        """The place in the training order (SampleKey.position) from which the workers decode
        every JPEG (mgpu.data.decode_switch), or None while the shares hold for the whole run."""
        at = int(self._workers_from[0])
        return None if at == NEVER else at

    def workers_decode_from(self, position: int) -> None:
        """Under decode=gpu, the workers decode every JPEG of the samples at `position` and
        later in the training order: a place no worker has been handed a sample of yet, so each
        sample is decoded where its position says (a resumed run's checkpoint says it again)."""
        self._workers_from[0] = position

    def decodes_scaled(self, box: tuple) -> bool:
        """Whether a JPEG with this crop box is decoded DCT-scaled on the CPU (reduced_decode,
        a box at least twice image_size): such a JPEG costs the workers a fraction of its full
        decode, and the GPU all of it, so decode_split may send more of them to the workers."""
        return self.reduced_decode and dct_factor(box, self.image_size) > 1

    def probe_item(self, i: int, *, cpu: bool) -> Encoded | None:
        """Sample i of epoch 0 as decode=gpu hands it over, its JPEG decoded here (`cpu`) or left
        as bytes: what mgpu.data.decode_split times. None under decode=cpu."""
        return self._sample(i, 0, 0, cpu=cpu) if self.decode == "gpu" else None

    def on_cpu(self, i: int, epoch: int, seed: int, scaled=False, position: int = 0) -> bool:
        """Whether this worker decodes sample i's JPEG under decode=gpu (cpu_decode_share, or
        its scaled share for a JPEG decoded DCT-scaled): a hash of (seed, epoch, i), the same
        in every process and on every resume; every one from the run's workers_from on (its
        `position` in the training order, SampleKey's)."""
        if position >= self._workers_from[0] and self.decode == "gpu":
            return True
        below = self._cpu_below_scaled if scaled else self._cpu_below
        if not below:
            return False
        h = (i * 0x9E3779B1 + epoch * 0x85EBCA77 + seed * 0xC2B2AE3D) & 0xFFFFFFFF
        h = ((h ^ (h >> 16)) * 0x45D9F3B) & 0xFFFFFFFF  # mix: neighbours land apart
        return (h ^ (h >> 16)) < below

    def read_bytes(self, i: int) -> bytes:
        """Sample i's encoded file, as stored (a dataset of other storage overrides this and
        `_split_files`; `files[i]` stays the name that errors and logs give)."""
        with open(self.files[i], "rb") as f:
            return f.read()

    def count_replaced(self, why: str) -> None:
        """Count a replaced file (in this process's slot) and name it in the rank's log."""
        worker = get_worker_info()
        self._replaced[0 if worker is None else 1 + worker.id % (COUNTER_SLOTS - 1)] += 1
        log.warning("%s; replaced by another image (data.bad_files=skip)", why)

    def replaced(self) -> int:
        """Files replaced so far by this process and its DataLoader workers, counted as they
        read them: ahead of training by the batches in flight, into the next epoch too."""
        return int(self._replaced.sum())

    def counters(self) -> dict[str, float]:
        """Host counters for TensorBoard (mgpu.telemetry.metrics.Recorder): this rank's replaced
        files."""
        return {"data/bad_files_replaced": float(self.replaced())}

    def device_decoder(self, device: torch.device):
        """decode=gpu: the prefetcher's step that decodes and crops a batch on `device`."""
        if self.decode != "gpu":
            return None
        return gpu_decoder(self, device)
