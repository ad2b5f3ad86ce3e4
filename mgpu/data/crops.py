"""The crops of data=image_folder and data=image_shards, on the CPU: the training box (random
area and aspect ratio, torchvision's RandomResizedCrop rule), evaluation's center square, the
crop and resize a DataLoader worker does, and JPEG's DCT-scaled decode for a large box. The GPU
path (gpu_decode, gpu_resize) resizes the same boxes.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch import Tensor


def random_resized_crop(
    width: int, height: int, rng: np.random.Generator, scale: tuple, ratio: tuple
) -> tuple[int, int, int, int]:
    """(left, top, w, h): a box of random area (a `scale` fraction of the image's) and aspect
    ratio (log-uniform in `ratio`), at a random place; after 10 tries that do not fit, the
    center box of the nearest allowed aspect ratio. torchvision's RandomResizedCrop rule."""
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = round(math.sqrt(target * aspect))
        h = round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return left, top, w, h
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, round(width / ratio[0])
    elif aspect > ratio[1]:
        w, h = round(height * ratio[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def center_crop(width: int, height: int, fraction: float) -> tuple[int, int, int, int]:
    """(left, top, w, h): the centered square whose side is `fraction` of the shorter side
    (0.875 crops what resize-to-256-then-center-crop-224 keeps)."""
    side = max(1, round(min(width, height) * fraction))
    return (width - side) // 2, (height - side) // 2, side, side


def crop_resize(image: Image.Image, box: tuple, flip: bool, size: int) -> Tensor:
    """The box cut out, resized to size x size (bilinear, antialiased when shrinking) and
    mirrored if `flip`: a [3, size, size] uint8 tensor. Crop, then resize: the GPU path
    (gpu_decode) does the same, so both filter only pixels inside the box.

    The resize is torch's uint8 antialiased bilinear on the crop as a channels-last view (its
    vectorised CPU kernel): 2.4x Pillow's resize on one core, within two levels of it
    (Pillow's filter and weights, other rounding; bench/README.md, real images)."""
    left, top, w, h = box
    pixels = torch.from_numpy(np.array(image))  # [H, W, 3]; a writable copy out of Pillow
    crop = pixels[top : top + h, left : left + w].permute(2, 0, 1)[None]
    out = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)[0]
    return (out.flip(-1) if flip else out).contiguous()


# JPEG's DCT scaling: libjpeg decodes at 1/2, 1/4 or 1/8 of the size for little more than the
# entropy decoding, skipping most of the IDCT and colour work. Used when the crop box is at least
# this many times the output size on its shorter side, so the reduced box is still shrunk.
DCT_FACTORS = (8, 4, 2)


def dct_factor(box: tuple, size: int) -> int:
    """How much smaller (8, 4, 2, or 1: not at all) a JPEG may be decoded for this crop box."""
    return next((f for f in DCT_FACTORS if min(box[2], box[3]) >= f * size), 1)


def draft_for_crop(image: Image.Image, box: tuple, size: int) -> tuple[int, int, int, int]:
    """Ask Pillow (before decoding) for the smallest DCT-scaled decode of a JPEG whose crop box
    still covers `size` pixels on each side; `box` mapped onto that decode (rounded to whole
    pixels, so its edges move by under half a reduced pixel). Other formats: `box` as it is."""
    left, top, w, h = box
    factor = dct_factor(box, size)
    if factor == 1 or image.format != "JPEG":
        return box
    width, height = image.size
    image.draft(image.mode, (width // factor, height // factor))
    sx, sy = width / image.size[0], height / image.size[1]
    x0, y0 = round(left / sx), round(top / sy)
    x1, y1 = round((left + w) / sx), round((top + h) / sy)
    return x0, y0, x1 - x0, y1 - y0
