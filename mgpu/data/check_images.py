"""`python -m mgpu.data.check_images DIR [DIR ...]`: every image of an image folder read and
decoded whole, before a run, so that an unreadable file is found in minutes rather than hours
into training (where `data.bad_files=error` stops the run at it, and `skip` replaces it).

A file counts as readable as data=image_folder reads it on the CPU: Pillow identifies it,
decodes all of it and converts it to RGB. Every DIR is checked; exit 0 when every file is
readable, 1 listing every one that is not, 2 where a DIR is not an image folder training takes
(an empty class folder, a single class: the other classes' images are still checked). It writes
nothing. On a terminal a progress line comes every few seconds; Ctrl-C stops it in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import nullcontext

from PIL import Image

from mgpu.data.folder_files import (
    FolderError,
    check_root,
    check_two_classes,
    class_folders,
    left_out_line,
    list_class,
    scan,
)
from mgpu.data.image_folder import UNREADABLE, eight_bits, unreadable_line
from mgpu.data.progress import Progress
from mgpu.data.quiet_pool import quiet_pool

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


def listing(root: str) -> tuple[list[str], list[str], list[str]]:
    """(`root`'s images, what training leaves out of it: scan's `skipped`, why training refuses
    it: a line for each class folder without images, and one for a single class). Listed a class
    at a time, so that an empty class folder does not keep the others' images from being
    checked; FolderError where `root` is no image folder at all."""
    skipped = check_root("DIR", root)
    classes = class_folders(root)
    if not classes:
        scan("DIR", root, classes)  # raises: no class folders
    files, refused = [], []
    for name in classes:
        try:
            images, left = list_class("DIR", root, name)
        except FolderError as err:
            refused.append(str(err))
            continue
        files += images
        skipped += left
    try:
        check_two_classes(root, classes, asked=False)
    except FolderError as err:
        refused.append(str(err))
    return files, sorted(skipped), refused


def check(root: str, files: list[str], workers: int) -> list[str]:
    """Why each unreadable one of `files` is, in their order."""
    workers = min(workers, len(files))
    progress = Progress(f"{root}: checked", len(files), "images")
    found = []
    # A Ctrl-C leaves the `with` through terminate(): the workers end at once.
    with quiet_pool(workers) if workers > 1 else nullcontext() as pool:
        results = pool.imap(unreadable, files, chunksize=64) if pool else map(unreadable, files)
        for why in results:
            found.append(why)
            progress.update(len(found))
    return [why for why in found if why is not None]


def report(root: str, workers: int) -> tuple[int, bool]:
    """Check `root` and say what it found: (its unreadable images, whether training refuses
    the folder itself)."""
    started = time.monotonic()
    try:
        files, skipped, refused = listing(root)
    except FolderError as err:
        files, skipped, refused = [], [], [str(err)]
    bad = check(root, files, workers) if files else []
    took = time.monotonic() - started
    if skipped:  # not unreadable images, so not a failure: training leaves them out too
        print(left_out_line("DIR", root, skipped))
    if files and not bad:
        print(f"{root}: all {len(files):,} images readable ({took:.0f} s)")
    elif bad:
        print(f"{root}: {len(bad):,} of {len(files):,} images unreadable ({took:.0f} s):")
        print("\n".join(f"  {why}" for why in bad))
    sys.stdout.flush()  # before the refusals on stderr, where both go to one terminal
    for line in refused:
        print(f"{PROG}: {line}", file=sys.stderr)
    return len(bad), bool(refused)


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
    failed, refused = 0, False
    for root in args.dirs:  # every folder, whatever an earlier one showed
        try:
            bad, refuses = report(root, args.workers)
        except KeyboardInterrupt:  # one line, as train.py says it; 128 + SIGINT, as a shell
            print(f"{PROG}: interrupted (Ctrl-C) while checking {root}", file=sys.stderr)
            sys.exit(130)
        failed, refused = failed + bad, refused or refuses
    if failed:
        print(
            f"{failed:,} unreadable image(s): remove them, or train with data.bad_files=skip "
            "to replace each with the next readable one",
            file=sys.stderr,
        )
    sys.exit(2 if refused else (1 if failed else 0))


if __name__ == "__main__":
    main()
