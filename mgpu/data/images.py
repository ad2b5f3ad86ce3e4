"""Class-conditional synthetic uint8 images, and the on-device uint8 -> float normalization.

A sample is its class's fixed low-res random template, upsampled, plus gaussian pixel noise and a
brightness shift: learnable by a small CNN in a few hundred steps, at chance before training.
Made in integer arithmetic from a bank of noise drawn once, so a 224x224 sample costs a DataLoader
worker a fraction of a millisecond: the built-in data never bounds a GPU's training speed.
"""

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

SPLIT_IDS = {"train": 0, "eval": 1}
TEMPLATE_STREAM = 2  # rng stream id of the class templates; never a split id
TEMPLATE_RES = 8  # templates are random at this resolution, then upsampled
# Contrast of a template around mid-gray 128. This sets the difficulty: at the default noise=48
# and 32x32, a small CNN goes from chance to ~90% eval accuracy over ~200 steps of batch 64 (at
# 40 it is ~100% by step 25). Bigger images average more pixels per template cell: easier.
TEMPLATE_STD = 4.0
BRIGHTNESS = 16  # per-sample brightness shift is a whole number in [-BRIGHTNESS, BRIGHTNESS]
NOISE_STREAM = 3  # rng stream id of the noise bank
# Noise bank length in images' worth of pixels: a sample's noise is the bank's window at a random
# offset, so two samples share noise only where their windows happen to overlap.
NOISE_BANK_IMAGES = 32


def normalize_uint8(x: Tensor) -> Tensor:
    """uint8 [B, C, H, W] on any device -> float32, roughly zero-mean and unit-std."""
    # Images cross host->device as uint8 (a quarter of float32's bytes); convert after the copy.
    # (x / 255 - 0.5) / 0.25 as two passes: the multiply reads uint8 and writes float32 in one
    # kernel, instead of a conversion and three in-place passes over the float batch.
    return x.mul(1.0 / 63.75).sub_(2.0)


def _make_templates(seed: int, num_classes: int, channels: int, size: int) -> np.ndarray:
    """[num_classes, C, H, W] templates, whole numbers in 0..255 (int16), fixed by seed alone."""
    rng = np.random.default_rng([seed, TEMPLATE_STREAM, 0])
    low = rng.standard_normal((num_classes, channels, TEMPLATE_RES, TEMPLATE_RES))
    low = torch.from_numpy(low.astype(np.float32))
    # Bilinear upsampling gives smooth blobs, so a conv net has local structure to pick up.
    up = F.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    up = up / up.std(dim=(1, 2, 3), keepdim=True)  # same contrast for every class
    return (128.0 + TEMPLATE_STD * up).clamp_(0, 255).round_().numpy().astype(np.int16)


def _make_noise(seed: int, split_id: int, noise: float, pixels: int) -> np.ndarray:
    """Gaussian pixel noise of std `noise`, rounded to whole numbers (int16), fixed by seed and
    split: evaluation never sees the noise that training could have memorised."""
    rng = np.random.default_rng([seed, NOISE_STREAM, split_id])
    bank = rng.standard_normal(pixels * (NOISE_BANK_IMAGES + 1), dtype=np.float32)
    bank *= noise
    return np.rint(bank).clip(-255, 255).astype(np.int16)


class SyntheticImages(Dataset):
    """Noisy class templates; sample i is a pure function of (args, split, i)."""

    # The trainer applies this to inputs once they are on the device.
    device_transform = staticmethod(normalize_uint8)

    def __init__(
        self,
        split: str,
        num_classes: int = 10,
        image_size: int = 32,
        channels: int = 3,
        num_samples: int = 50_000,
        eval_samples: int = 1_000,
        noise: float = 48.0,
        seed: int = 1234,
    ):
        if split not in SPLIT_IDS:
            raise ValueError(f"split={split!r} is not a known split; use 'train' or 'eval'")
        sizes = dict(
            num_classes=num_classes,
            image_size=image_size,
            channels=channels,
            num_samples=num_samples,
            eval_samples=eval_samples,
        )
        for name, value in sizes.items():
            if value <= 0:
                raise ValueError(f"{name}={value} must be a positive integer")
        if noise < 0:
            raise ValueError(f"noise={noise} is a standard deviation; use noise >= 0")
        self.split = split
        self.num_classes = num_classes
        self.image_size = image_size
        self.channels = channels
        self.noise = float(noise)
        self.seed = seed
        self.tokens_per_sample = None
        self.sample_shape = (channels, image_size, image_size)  # an input's shape (for FLOPs)
        self._split_id = SPLIT_IDS[split]
        self._len = num_samples if split == "train" else eval_samples
        # Tensors, not arrays: sent to a DataLoader worker, torch moves them to shared memory
        # (once) and each worker gets a handle, not the banks pickled whole (ResNet-50's 1000
        # classes at 224: 297 MB a worker; every evaluation's 14 workers on an H200 host took
        # over 10 s to give their first batch). Without workers nothing is shared.
        templates = _make_templates(seed, num_classes, channels, image_size)
        self.templates = torch.from_numpy(templates)
        self._pixels = templates[0].size
        self._noise = torch.from_numpy(_make_noise(seed, self._split_id, self.noise, self._pixels))

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        i = int(i)
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for {self.split} split of {self._len}")
        rng = np.random.default_rng([self.seed, self._split_id, i])
        label = int(rng.integers(self.num_classes))
        shift = int(rng.integers(-BRIGHTNESS, BRIGHTNESS + 1))
        noise, templates = self._noise.numpy(), self.templates.numpy()  # views, no copies
        start = int(rng.integers(len(noise) - self._pixels + 1))
        x = noise[start : start + self._pixels].reshape(templates.shape[1:])
        x = x + templates[label]  # a new array: the bank stays as it is
        x += shift
        np.clip(x, 0, 255, out=x)
        return torch.from_numpy(x.astype(np.uint8)), torch.tensor(label, dtype=torch.int64)
