"""data.decode=gpu: the prefetcher's step that turns a batch of JPEG bytes (mgpu.data.image_folder's
EncodedBatch) into uint8 [B, 3, S, S] images on the GPU, with torchvision's nvJPEG decode, and
which mode data.decode=auto picks.

torchvision is imported here only, lazily: it is optional, and CPU hosts do without it.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor

from mgpu.config_checks import ConfigError  # what train.py reports in one line
from mgpu.data.image_folder import BadImageFile, EncodedBatch, ImageFolder


def gpu_decode_unavailable() -> str | None:
    """Why JPEGs cannot be decoded on a GPU here, or None if they can be tried. Creates no CUDA
    context (config validation runs this in every process before any device is pinned)."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible"
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except Exception as err:  # ImportError, or a torchvision built for another torch
        return f"torchvision cannot be imported ({type(err).__name__}: {err})"
    return None


def resolve_decode(mode: str) -> str:
    """data.decode: cpu and gpu as they are; auto is cpu.

    Measured on one H100 with 16 cores (bench/results/input_pipeline-nvidia-h100-80gb-hbm3-x1-
    20261125-071918.json: ResNet-50, B=256, eager bf16, 3,000 ImageNet-sized JPEGs, 14 workers):
    Pillow in the workers fed 0.993 of the batch already on the GPU with 0.09 % data wait, while
    nvJPEG on the prefetcher's copy thread fed 0.906 (5 % data wait) and decoding inline in the
    training loop 0.686: torchvision's GPU decode waits on the host for its own work, and the
    decode kernels take the GPU from training. decode=gpu is for hosts with too few cores per
    GPU for Pillow to keep up (Pillow took 3.0-3.5 ms of a core a 500x375 sample).
    """
    return "cpu" if mode == "auto" else mode


def _probe_jpeg() -> Tensor:
    """A tiny JPEG, to try the GPU decode once before training starts."""
    buf = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 100, 50)).save(buf, format="JPEG")
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


JpegDecode = Callable[[list[Tensor]], list[Tensor]]  # JPEG bytes -> [3, H, W] uint8 images


def gpu_decoder(dataset: ImageFolder, device: torch.device | str) -> BatchDecoder:
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
    except RuntimeError as err:
        why = f"torchvision cannot decode JPEGs on {device} ({err}); use data.decode=cpu"
        raise ConfigError("data.decode", "gpu", why) from None
    return BatchDecoder(dataset, device, nvjpeg)


class BatchDecoder:
    """Decodes and crops an EncodedBatch on `device` with `decode` (nvJPEG, gpu_decoder);
    DeviceLoader calls it on its side stream.

    Stream rule: torchvision decodes on a stream of its own, waits for it on the host, and makes
    the current stream (the loader's side stream) wait for it too; the crops below run on the
    side stream, so the batch's `ready` event covers all of it. The host wait is why
    mgpu.loader runs this step on its copy thread, where it overlaps the training loop.
    """

    def __init__(self, dataset: ImageFolder, device: torch.device, decode: JpegDecode):
        self.dataset, self.device, self.size = dataset, device, dataset.image_size
        self._decode = decode

    def __call__(self, batch: EncodedBatch) -> tuple[Tensor, Tensor]:
        """(images [B, 3, S, S] uint8, labels [B]) on the device."""
        size, device = self.size, self.device
        labels = batch.labels
        out = torch.empty(len(labels), 3, size, size, dtype=torch.uint8, device=device)
        if len(batch.pixels_at):
            out[batch.pixels_at.to(device)] = batch.pixels.to(device, non_blocking=True)
        if batch.lengths:
            images, boxes, flips, labels = self._decoded(batch)
            # Two kernels an image (to float, resize) and one cat for the batch: the sizes
            # differ, so there is no batched resize. Bilinear with antialias is the filter
            # Pillow's resize uses (image_folder.crop_resize).
            crops = torch.cat(
                [
                    F.interpolate(
                        image[None, :, top : top + h, left : left + w].float(),
                        size=(size, size),
                        mode="bilinear",
                        antialias=True,
                        align_corners=False,
                    )
                    for image, (left, top, w, h) in zip(images, boxes, strict=True)
                ]
            )
            flips = flips.to(device, non_blocking=True)[:, None, None, None]
            crops = torch.where(flips, crops.flip(-1), crops)
            out[batch.jpeg_at.to(device)] = crops.round_().clamp_(0, 255).to(torch.uint8)
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
        for data, index in zip(jpegs, batch.jpeg_index, strict=True):
            try:
                images.append(self._decode([data])[0])
            except RuntimeError as err:
                why = f"{self.dataset.files[index]}: cannot be decoded on the GPU ({err})"
                if self.dataset.bad_files == "error":
                    raise BadImageFile(
                        f"{why}; remove the file, or set data.bad_files=skip to replace it"
                    ) from first
                self.dataset.count_replaced(why)
                images.append(None)
        good = [k for k, image in enumerate(images) if image is not None]
        if not good:
            raise BadImageFile(f"no JPEG of a batch could be decoded on the GPU ({first})")
        # skip: a bad JPEG's place takes the next good one of the batch, crop and label too.
        take = [next((g for g in good if g >= k), good[0]) for k in range(len(images))]
        labels = batch.labels.clone()
        labels[batch.jpeg_at] = batch.labels[batch.jpeg_at[take]]
        return [images[t] for t in take], [batch.boxes[t] for t in take], batch.flips[take], labels
