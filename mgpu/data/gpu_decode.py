"""data.decode=gpu: the prefetcher's step that turns a batch of JPEG bytes (mgpu.data.image_folder's
EncodedBatch) into uint8 [B, 3, S, S] images on the GPU, with torchvision's nvJPEG decode, and
which mode data.decode=auto picks.

torchvision is imported here only, lazily: it is optional, and CPU hosts do without it.
"""

from __future__ import annotations

import functools
import io
import logging
import os
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from mgpu.config.checks import ConfigError  # what train.py reports in one line
from mgpu.data.encoded import REMOVE_OR_SKIP, BadImageFile, EncodedBatch
from mgpu.runtime.launch import CUDA_CONNECTIONS, cuda_connections_warning

log = logging.getLogger(__name__)


def gpu_decode_unavailable() -> str | None:
    """Why JPEGs cannot be decoded on a GPU here, or None if they can be tried. Creates no CUDA
    context (config validation runs this in every process before any device is pinned)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as err:  # ImportError, or a torchvision built for another torch
        return f"torchvision cannot be imported ({type(err).__name__}: {err})"
    try:
        import triton  # noqa: F401 - the batched crops (gpu_resize)
    except ImportError as err:
        return f"triton cannot be imported ({err})"
    return None


def resolve_decode(mode: str) -> str:
    """data.decode: cpu and gpu as they are; auto is gpu wherever the GPU can decode, else cpu,
    and the log says which and why.

    Why gpu wherever it can: Pillow in the workers takes 2-7 ms of a core per ImageNet-sized
    image, so a compiled ResNet-50 on one H100 or H200 (5,300-6,800 images/s) would need more
    cores than a GPU server has per GPU; the GPU path (nvJPEG through torchvision, the batched
    crops of gpu_resize) costs the step about 1 ms a batch of 128. How many JPEGs the otherwise
    idle workers take beside it is measured on the host at start-up (data.cpu_decode_share=auto,
    mgpu.data.decode_split). Measured through train.py: 0.93-0.96 of the batches-ready rate
    under auto against 0.19-0.42 with every image on the CPU (bench/README.md, real_images).
    """
    if mode not in ("cpu", "gpu", "auto"):
        raise ValueError(f"decode={mode!r}: use cpu, gpu or auto")
    if mode == "cpu":
        return mode
    why = gpu_decode_unavailable() if mode == "auto" else None
    if why is None:
        if mode == "auto":
            log.info(
                "data.decode=auto: JPEGs decoded on the GPU (nvJPEG) and by the workers as "
                "data.cpu_decode_share says, PNG and CMYK on the CPU: a GPU that decodes JPEGs "
                "feeds the step faster than the host's cores can (bench/README.md, real_images)"
            )  # fmt: skip
        _warn_crowded_queues(os.environ.get(CUDA_CONNECTIONS))
        return "gpu"
    log.info("data.decode=auto: images decoded on the CPU, in the workers (%s)", why)
    return "cpu"


@functools.cache  # once a process and value: the train and eval datasets both resolve theirs
def _warn_crowded_queues(value: str | None) -> None:
    crowded = cuda_connections_warning({} if value is None else {CUDA_CONNECTIONS: value})
    if crowded is not None:
        log.warning("data.decode=gpu: %s", crowded)


def _probe_jpeg() -> Tensor:
    """A tiny JPEG, to try the GPU decode once before training starts."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 100, 50)).save(buf, format="JPEG")
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


class DecodedSet(Protocol):
    """What the decode step needs of its image set (ImageFolder and ImageShards have it): the
    crops' side, the files (to name a bad one), the bad-file policy and its counter."""

    image_size: int
    files: list[str]
    bad_files: str

    def count_replaced(self, why: str) -> None: ...


JpegDecode = Callable[[list[Tensor]], list[Tensor]]  # JPEG bytes -> [3, H, W] uint8 images
# (out, images, boxes, flips, slots): each image's box resized into out[slot] (gpu_resize)
Resize = Callable[[Tensor, list[Tensor], list[tuple], list[bool], list[int]], None]


def resize_each(
    out: Tensor,
    images: list[Tensor],
    boxes: list[tuple[int, int, int, int]],
    flips: list[bool],
    slots: list[int],
) -> None:
    """What gpu_resize.resize_into does, image by image with torch's antialiased bilinear
    resize (the same filter, float between the passes): a few kernels per image. The reference
    the batched kernels are tested against, and the resize of BatchDecoder on a CPU in tests."""
    size = out.shape[-1]
    for image, (left, top, w, h), flip, slot in zip(images, boxes, flips, slots, strict=True):
        crop = F.interpolate(
            image[None, :, top : top + h, left : left + w].float(),
            size=(size, size),
            mode="bilinear",
            antialias=True,
            align_corners=False,
        )[0]
        crop = crop.flip(-1) if flip else crop
        out[slot] = (crop + 0.5).floor_().clamp_(0, 255).to(torch.uint8)


def gpu_decoder(dataset: DecodedSet, device: torch.device | str) -> BatchDecoder:
    """data.decode=gpu's step for `device`, with torchvision's nvJPEG, tried once on a tiny
    JPEG: a GPU decode that cannot work stops the run before training, naming the key."""
    why = gpu_decode_unavailable()
    if why is not None:
        raise ConfigError("data.decode", "gpu", f"{why}; use data.decode=cpu")
    from torchvision.io import ImageReadMode, decode_jpeg

    device = torch.device(device)

    def nvjpeg(data: list[Tensor]) -> list[Tensor]:
        return decode_jpeg(data, mode=ImageReadMode.RGB, device=device)

    try:
        nvjpeg([_probe_jpeg()])
        from mgpu.data.gpu_resize import resize_into
    except (RuntimeError, ImportError) as err:  # ImportError: Triton, for the batched crops
        why = f"JPEGs cannot be decoded and cropped on {device} ({err}); use data.decode=cpu"
        raise ConfigError("data.decode", "gpu", why) from None
    return BatchDecoder(dataset, device, nvjpeg, resize_into)


class BatchDecoder:
    """Decodes and crops an EncodedBatch on `device` with `decode` (nvJPEG, gpu_decoder);
    DeviceLoader calls it on its side stream.

    Stream rule: torchvision decodes on a stream of its own, waits for it on the host, and makes
    the current stream (the loader's side stream) wait for it too; the crops below run on the
    side stream, so the batch's `ready` event covers all of it. The host wait is why
    mgpu.data.loader runs this step on its copy thread, where it overlaps the training loop.
    """

    def __init__(
        self, dataset: DecodedSet, device: torch.device, decode: JpegDecode, resize: Resize
    ):
        self.dataset, self.device, self.size = dataset, device, dataset.image_size
        self._decode, self._resize = decode, resize

    def __call__(self, batch: EncodedBatch) -> tuple[Tensor, Tensor]:
        """(images [B, 3, S, S] uint8, labels [B]) on the device."""
        size, device = self.size, self.device
        labels = batch.labels
        if not batch.lengths:  # every sample decoded by the workers (decode_switch's move): the
            # pixels are the batch, in order; nothing to place or to read from pageable memory
            return batch.pixels.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        out = torch.empty(len(labels), 3, size, size, dtype=torch.uint8, device=device)
        if len(batch.pixels_at):
            # pinned (EncodedBatch.pin_memory): from pageable memory the copy thread would wait
            # for the side stream's earlier work before the copy
            at = batch.pixels_at.to(device, non_blocking=True)
            out[at] = batch.pixels.to(device, non_blocking=True)
        if batch.lengths:
            images, boxes, flips, labels = self._decoded(batch)
            # Every crop of the batch in at most 6 launches (gpu_resize.resize_into), whatever
            # the images' sizes: the same filter as the workers' Pillow resize.
            self._resize(out, images, boxes, flips.tolist(), batch.jpeg_at.tolist())
        return out, labels.to(device, non_blocking=True)

    def _decoded(self, batch: EncodedBatch):
        """The batch's JPEGs decoded, with their boxes, flips and the batch's labels. A batch
        that fails is decoded file by file, to name (error) or replace (skip) the bad ones."""
        jpegs = batch.jpegs
        try:
            return self._decode(jpegs), batch.boxes, batch.flips, batch.labels
        except RuntimeError as err:
            first = err
        images: list[Tensor | None] = []
        bad = []
        for data, index in zip(jpegs, batch.jpeg_index, strict=True):
            try:
                images.append(self._decode([data])[0])
            except RuntimeError as err:
                bad.append(f"{self.dataset.files[index]}: cannot be decoded on the GPU ({err})")
                images.append(None)
        if bad and self.dataset.bad_files == "error":  # every bad file of the batch, in one line
            if len(bad) == 1:
                raise BadImageFile(f"{bad[0]}; {REMOVE_OR_SKIP}") from first
            fix = "remove them, or set data.bad_files=skip to replace them"
            raise BadImageFile(
                f"{len(bad)} JPEGs of one batch cannot be decoded: {'; '.join(bad)}; {fix}"
            ) from first
        for why in bad:
            self.dataset.count_replaced(why)
        good = [k for k, image in enumerate(images) if image is not None]
        if not good:
            raise BadImageFile(f"no JPEG of a batch could be decoded on the GPU ({first})")
        # skip: a bad JPEG's place takes the next good one of the batch, crop and label too.
        take = [next((g for g in good if g >= k), good[0]) for k in range(len(images))]
        labels = batch.labels.clone()
        labels[batch.jpeg_at] = batch.labels[batch.jpeg_at[take]]
        return [images[t] for t in take], [batch.boxes[t] for t in take], batch.flips[take], labels
