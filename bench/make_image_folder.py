"""Write a class-per-folder tree of ImageNet-like JPEGs for data=image_folder benchmarks.

Each image is smooth random structure at a few scales plus fine noise, so that it compresses
and decodes like a photograph (about 80 KB at quality 90; ImageNet's JPEGs average about
110 KB), not like noise (several times that), in ImageNet's typical size: 500x375, one in four
turned portrait (375x500).

    python bench/make_image_folder.py /scratch/folder --images 5000 --classes 100
    python bench/input_pipeline.py --models resnet50_folder --folder /scratch/folder
"""

from __future__ import annotations

import argparse
import os
from multiprocessing import Pool
from pathlib import Path

import numpy as np
from PIL import Image


def photo_like(seed: int, width: int, height: int) -> np.ndarray:
    """uint8 [height, width, 3]: random blobs at 5 scales, then pixel noise."""
    rng = np.random.default_rng(seed)
    out = np.zeros((height, width, 3), np.float32)
    for cells, weight in ((4, 60.0), (12, 30.0), (40, 15.0), (120, 10.0), (250, 10.0)):
        low = rng.normal(0, 1, (max(2, cells * height // width), cells, 3)).astype(np.float32)
        for c in range(3):
            layer = Image.fromarray(low[..., c], mode="F").resize(
                (width, height), Image.Resampling.BICUBIC
            )
            out[..., c] += weight * np.asarray(layer)
    out += rng.normal(128, 9, (height, width, 3)).astype(np.float32)
    return np.clip(out, 0, 255).astype(np.uint8)


# --mix realistic: of every 100 images, what kind each is (the rest are plain RGB JPEGs of the
# --width x --height size): a photo-sized JPEG of 2400x1800, a grayscale JPEG, a CMYK JPEG (as
# print workflows leave them; nvJPEG refuses these) and a PNG, as a crawled data set holds them.
REALISTIC = {"large": range(0, 3), "gray": range(3, 6), "cmyk": range(6, 7), "png": range(7, 9)}
LARGE = (2400, 1800)


def kind_of(i: int, mix: str) -> str:
    if mix == "plain":
        return "jpeg"
    return next((kind for kind, slots in REALISTIC.items() if i % 100 in slots), "jpeg")


def write_one(job: tuple[str, int, int, int, int, str]) -> int:
    path, seed, width, height, quality, kind = job
    image = Image.fromarray(photo_like(seed, width, height))
    if kind == "png":
        image.save(path, format="PNG")
    else:
        mode = {"gray": "L", "cmyk": "CMYK"}.get(kind, "RGB")
        image.convert(mode).save(path, format="JPEG", quality=quality)
    return os.path.getsize(path)


def write_folder(
    root: Path,
    images: int,
    classes: int,
    *,
    size: tuple[int, int] = (500, 375),
    quality: int = 90,
    seed: int = 0,
    processes: int | None = None,
    mix: str = "plain",
) -> dict:
    """`images` JPEGs (and with mix=realistic, some PNGs) spread over `classes` folders under
    `root`; returns what was written."""
    jobs = []
    for i in range(images):
        folder = root / f"class{i % classes:04d}"
        folder.mkdir(parents=True, exist_ok=True)
        kind = kind_of(i, mix)
        width, height = LARGE if kind == "large" else size
        width, height = (width, height) if i % 4 else (height, width)
        name = f"img{i:07d}.{'png' if kind == 'png' else 'jpg'}"
        jobs.append((str(folder / name), seed * 1_000_003 + i, width, height, quality, kind))
    with Pool(processes or os.cpu_count()) as pool:
        sizes = pool.map(write_one, jobs, chunksize=16)
    kinds = {k: sum(kind_of(i, mix) == k for i in range(images)) for k in ("jpeg", *REALISTIC)}
    return {
        "images": images,
        "classes": classes,
        "mean_kb": sum(sizes) / len(sizes) / 1024,
        "kinds": kinds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("root", type=Path, help="the folder to write (class subfolders inside)")
    p.add_argument("--images", type=int, default=5000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--mix",
        choices=("plain", "realistic"),
        default="plain",
        help="plain: every image a --width x --height RGB JPEG; realistic: of every 100, 3 "
        "photo-sized (2400x1800), 3 grayscale and 1 CMYK JPEGs, 2 PNGs",
    )
    args = p.parse_args()
    if args.images < 1 or args.classes < 1 or args.images < args.classes:
        p.error("--images and --classes must be >= 1, with at least one image per class")
    made = write_folder(
        args.root,
        args.images,
        args.classes,
        size=(args.width, args.height),
        quality=args.quality,
        seed=args.seed,
        mix=args.mix,
    )
    print(
        f"wrote {made['images']} images ({made['mean_kb']:.0f} KB on average) in "
        f"{made['classes']} class folders under {args.root}: {made['kinds']}"
    )


if __name__ == "__main__":
    main()
