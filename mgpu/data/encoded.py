"""What an image set's DataLoader workers hand the training process under data.decode=gpu,
and the error both decode paths raise for an image that cannot be read.

Encoded is one sample (a JPEG's bytes and its crop, or pixels the worker made), EncodedBatch a
batch of them as collate_encoded packs it; mgpu.data.gpu_decode turns it into images on the
GPU. BadImageFile is an unreadable image, from Pillow in a worker or from nvJPEG on the GPU;
REMOVE_OR_SKIP says what to do about one. Owned here, below both image_folder and gpu_decode,
so neither imports the other's module for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from mgpu.runtime.dist import BAD_INPUT, RunStopped


class BadImageFile(ValueError, RunStopped):
    """An image file that cannot be decoded. One message argument only: a DataLoader worker's
    exception is rebuilt in the training process from its message (with the worker's traceback
    before it, which report() leaves out). Bad input: exit 2, said by the rank that read it."""

    exit_code = BAD_INPUT
    every_rank = False

    def report(self) -> str:
        last = str(self).strip().splitlines()[-1]  # a rebuilt one ends "...BadImageFile: why"
        return last.split(f"{type(self).__name__}: ", 1)[-1]


# What to do about an unreadable file under bad_files=error. A run that stops on one may have
# checkpoints, and removing the file changes the training set that their resume checks.
REMOVE_OR_SKIP = (
    "remove the file, or set data.bad_files=skip to replace it (to resume from a checkpoint, "
    "keep the file in place and use skip: a resume needs the images the run started with)"
)


@dataclass
class Encoded:
    """One sample for the GPU: a JPEG's bytes and its crop, or (files nvJPEG does not take:
    PNG, CMYK JPEG) the pixels the worker decoded and cropped itself."""

    label: int
    index: int
    data: bytes | None = None  # the file's bytes
    box: tuple[int, int, int, int] = (0, 0, 0, 0)
    flip: bool = False
    pixels: Tensor | None = None  # [3, S, S] uint8


@dataclass
class EncodedBatch:
    """A batch of Encoded samples: the JPEGs to decode on the GPU, and the rest as pixels.

    The JPEGs travel as one tensor: each tensor a worker returns crosses to the training process
    as shared memory with a file descriptor of its own, and a tensor per file would take
    thousands of descriptors at once (workers x prefetch x batch)."""

    data: Tensor  # the batch's JPEG files one after another, uint8
    lengths: list[int]  # bytes of each
    boxes: list[tuple[int, int, int, int]]  # its crop in the decoded image
    flips: Tensor  # [J] bool
    jpeg_at: Tensor  # [J] its position in the batch
    jpeg_index: list[int]  # its dataset index (to name a file that fails to decode)
    pixels: Tensor  # [P, 3, S, S] uint8, decoded by the workers
    pixels_at: Tensor  # [P]
    labels: Tensor  # [B]

    def pin_memory(self) -> EncodedBatch:
        """What DataLoader(pin_memory=True) calls: every tensor that crosses to the GPU, the
        JPEG bytes included, so that nvJPEG's copies of them are DMA without a staging pass
        through pageable memory (a batch of 128 decoded 17k images/s instead of 13.7k on one
        H100)."""
        self.pixels, self.labels = self.pixels.pin_memory(), self.labels.pin_memory()
        self.flips, self.data = self.flips.pin_memory(), self.data.pin_memory()
        self.pixels_at = self.pixels_at.pin_memory()
        return self

    @property
    def jpegs(self) -> list[Tensor]:
        """Each JPEG's bytes: a view of `data` (contiguous, as nvJPEG wants)."""
        return list(torch.split(self.data, self.lengths))


def collate_encoded(items: list[Encoded]) -> EncodedBatch:
    jpeg = [k for k, item in enumerate(items) if item.data is not None]
    done = [k for k, item in enumerate(items) if item.data is None]
    size = items[done[0]].pixels.shape if done else (3, 1, 1)
    files = b"".join(items[k].data for k in jpeg)
    return EncodedBatch(
        data=torch.frombuffer(bytearray(files), dtype=torch.uint8) if files else torch.empty(0),
        lengths=[len(items[k].data) for k in jpeg],
        boxes=[items[k].box for k in jpeg],
        flips=torch.tensor([items[k].flip for k in jpeg], dtype=torch.bool),
        jpeg_at=torch.tensor(jpeg, dtype=torch.int64),
        jpeg_index=[items[k].index for k in jpeg],
        pixels=torch.stack([items[k].pixels for k in done]) if done else torch.empty(0, *size),
        pixels_at=torch.tensor(done, dtype=torch.int64),
        labels=torch.tensor([item.label for item in items], dtype=torch.int64),
    )
