"""`python -m mgpu.data.check_images DIR [DIR ...]`: every image of an image folder read and
decoded whole, before a run, so that an unreadable file is found in minutes rather than hours
into training (where `data.bad_files=error` stops the run at it, and `skip` replaces it).

A file counts as readable as data=image_folder reads it on the CPU: Pillow identifies it,
decodes all of it and converts it to RGB. Every DIR is checked; exit 0 when every file is
readable, 1 listing every one that is not, 2 where a DIR is not an image folder. It writes
nothing. On a terminal a progress line comes every few seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext
from multiprocessing import Pool

from PIL import Image

from mgpu.data.folder_files import (
    FolderError,
    class_folders,
    left_out_line,
    scan,
)
from mgpu.data.image_folder import UNREADABLE, eight_bits, unreadable_line
from mgpu.data.progress import Progress

PROG = "python -m mgpu.data.check_images"


def unreadable(path: str) -> str | None:
    """Why `path` is not a readable image, or None."""
    try:
        with Image.open(path) as image:
            image.load()  # the whole file: one cut short fails here, not in the header
            eight_bits(image).convert("RGB")  # CMYK, 16 bits, palette, alpha: as training does
    except UNREADABLE as err:
        return unreadable_line(path, err)
    return None


def check(root: str, workers: int) -> tuple[int, list[str], list[str]]:
    """(images in `root`, why each unreadable one is, in the folder's order, and what the folder
    holds that training leaves out: scan's `skipped`)."""
    classes = class_folders(root) if os.path.isdir(root) else []
    files, _, skipped = scan("DIR", root, classes)  # FolderError, said as a usage error
    workers = min(workers, len(files))
    progress = Progress(f"{root}: checked", len(files), "images")
    found = []
    with Pool(workers) if workers > 1 else nullcontext() as pool:
        results = pool.imap(unreadable, files, chunksize=64) if pool else map(unreadable, files)
        for why in results:
            found.append(why)
            progress.update(len(found))
    return len(files), [why for why in found if why is not None], skipped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="an image folder (DIR/<class>/...)")
    parser.add_argument(
        "--workers",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="decoding processes (default: every CPU this process may use)",
    )
    args = parser.parse_args(argv)
    if args.workers < 1:
        parser.error(f"--workers={args.workers}: must be a positive number of processes")
    failed, code = 0, 0
    for root in args.dirs:  # every folder, whatever an earlier one showed
        started = time.monotonic()
        try:
            n, bad, skipped = check(root, args.workers)
        except FolderError as err:
            print(f"{PROG}: {err}", file=sys.stderr)
            code = 2
            continue
        took = time.monotonic() - started
        if skipped:  # not unreadable images, so not a failure: training leaves them out too
            print(left_out_line("DIR", root, skipped))
        if not bad:
            print(f"{root}: all {n:,} images readable ({took:.0f} s)")
            continue
        failed += len(bad)
        print(f"{root}: {len(bad):,} of {n:,} images unreadable ({took:.0f} s):")
        print("\n".join(f"  {why}" for why in bad))
    if failed:
        print(
            f"{failed:,} unreadable image(s): remove them, or train with data.bad_files=skip "
            "to replace each with the next readable one",
            file=sys.stderr,
        )
    sys.exit(code or (1 if failed else 0))


if __name__ == "__main__":
    main()
