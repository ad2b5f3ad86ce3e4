"""Command that writes an image folder once as a prepared set for data=image_shards: every image
at most --max-side on its shorter side, as a JPEG both Pillow and nvJPEG decode, in WebDataset-
layout tar shards (<key>.jpg, <key>.cls) with an index of each JPEG's offset in its shard.

python -m mgpu.data.prepare_images SRC DST --max-side N [--shard-mb M] [--workers K] [--quality Q]

Nothing half-written, nothing lost: the new set is written whole into DST/.prepare.tmp (its
index last, once every shard is on disk) and only then swapped in for what DST held, so a run
that fails or is stopped (Ctrl-C, SIGTERM) leaves DST as it was; the next run clears what a
killed one left. DST must be new, empty, or a prepared set (replaced with --overwrite).
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import signal
import sys
import tarfile
import time
from contextlib import nullcontext
from functools import partial

from PIL import Image

from mgpu.data.folder_files import FolderError, class_folders, left_out_line, scan
from mgpu.data.image_folder import UNREADABLE, eight_bits, unreadable_line
from mgpu.data.image_shards import FORMAT, INDEX_NAME, SAMPLE_FIELDS, VERSION, shard_name
from mgpu.data.progress import Progress
from mgpu.data.quiet_pool import quiet_pool
from mgpu.data.set_swap import OURS, TEMP, held, swap, tidy, write_index, writing

PROG = "python -m mgpu.data.prepare_images"


class PrepareError(Exception):
    """Why the command stops: one line, naming what to change."""


class UsageError(PrepareError):
    """A SRC or DST that cannot work, found before any image is read: exit 2, as argparse
    exits for a bad argument."""


class Stopped(KeyboardInterrupt):
    """SIGTERM, raised in the main thread as Ctrl-C raises KeyboardInterrupt: the same clean-up."""


def on_sigterm(_signum, _frame) -> None:
    raise Stopped


def target_size(width: int, height: int, max_side: int) -> tuple[int, int]:
    """The size stored: the shorter side brought down to max_side, the aspect ratio kept (to
    the nearest pixel); an image whose shorter side is within max_side keeps its size."""
    short = min(width, height)
    if short <= max_side:
        return width, height
    if width <= height:
        return max_side, max(1, round(height * max_side / width))
    return max(1, round(width * max_side / height)), max_side


def encode(path: str, max_side: int, quality: int) -> tuple[bytes, bool] | str:
    """(the JPEG to store for `path`, whether it is the file's own bytes), or why the file is
    not a readable image. A baseline YCbCr or grayscale JPEG that needs no resize is kept as
    it is; anything else (resized, progressive, CMYK, PNG, palette, alpha) is converted to RGB
    (grayscale stays grayscale), as data=image_folder converts it, and encoded as a baseline
    JPEG: what nvJPEG's batched decode takes, as Pillow does."""
    try:
        with open(path, "rb") as f:
            data = f.read()
        image = Image.open(io.BytesIO(data))
        image.load()  # the whole file decoded: one cut short fails here, not in training
        size = target_size(*image.size, max_side)
        baseline = image.format == "JPEG" and not image.info.get("progressive")
        if size == image.size and baseline and image.mode in ("RGB", "L"):
            return data, True
        image = eight_bits(image)
        image = image.convert("L" if image.mode == "L" else "RGB")
        if size != image.size:
            image = image.resize(size, Image.Resampling.LANCZOS)
        out = io.BytesIO()
        image.save(out, format="JPEG", quality=quality)  # baseline: Pillow's default
        return out.getvalue(), False
    except UNREADABLE as err:
        return unreadable_line(path, err)  # Pillow's own message names the BytesIO, not the file


class ShardWriter:
    """Samples appended in order to shard-NNNNNN.tar files in `dst` (the run's temporary folder)
    of about `limit` bytes, each one's JPEG offsets read back from the closed file with tarfile
    (the offsets the index records)."""

    def __init__(self, dst: str, limit: int):
        self.dst, self.limit = dst, limit
        self.shards: list[dict] = []  # name, bytes and samples of each finished shard
        self.rows: list[list] = []  # the index's sample rows, of the finished shards
        self._tar: tarfile.TarFile | None = None  # the shard being written
        self._pending: list[tuple[str, int, str]] = []  # its samples: key, label, path
        self._size = 0  # its bytes so far, with the end-of-archive blocks

    def add(self, jpeg: bytes, label: int, path: str) -> str | None:
        """Append one sample; the name of a shard this completed, if any."""
        # Two 512-byte headers, the JPEG padded to 512-byte blocks, one block for the label.
        member = 512 + -(-len(jpeg) // 512) * 512 + 2 * 512
        done = self.finish() if self._tar and self._size + member > self.limit else None
        if self._tar is None:
            shard = os.path.join(self.dst, shard_name(len(self.shards)))
            self._tar = tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT)
            self._size, self._pending = 1024, []  # the two end-of-archive blocks
        key = f"{len(self.rows) + len(self._pending):09d}"
        for suffix, payload in ((".jpg", jpeg), (".cls", str(label).encode())):
            # TarInfo's defaults (mtime 0, mode 0o644, no owner): the same bytes run to run
            info = tarfile.TarInfo(key + suffix)
            info.size = len(payload)
            self._tar.addfile(info, io.BytesIO(payload))
        self._pending.append((key, label, path))
        self._size += member
        return done

    def finish(self) -> str | None:
        """Close the open shard, make it durable, record its rows."""
        if self._tar is None:
            return None
        self._tar.close()
        self._tar = None
        number, name = len(self.shards), shard_name(len(self.shards))
        with open(os.path.join(self.dst, name), "rb") as f:
            os.fsync(f.fileno())  # on disk before the index that names it
            with tarfile.open(fileobj=f) as tar:
                where = {m.name: (m.offset_data, m.size) for m in tar}
            size = f.seek(0, os.SEEK_END)
        for key, label, path in self._pending:
            self.rows.append([number, *where[key + ".jpg"], label, path])
        self.shards.append({"name": name, "bytes": size, "samples": len(self._pending)})
        return name


def dst_path(src: str, dst: str) -> bool:
    """Refuse a DST that cannot be a set's folder: inside SRC, a file. Whether it is still to
    be created."""
    inside = os.path.realpath(dst) + os.sep
    if inside.startswith(os.path.realpath(src) + os.sep):
        raise UsageError(f"DST={dst!r} is inside SRC={src!r}; write it somewhere else")
    if os.path.exists(dst) and not os.path.isdir(dst):
        raise UsageError(f"DST={dst!r} is a file; name a folder (created if missing)")
    return not os.path.exists(dst)


def dst_contents(dst: str, overwrite: bool) -> None:
    """Refuse a DST that holds a prepared set without --overwrite, or anything else; first what
    a killed run left is tidied (under the lock: no other run is writing)."""
    if tidy(dst):
        print(f"{PROG}: put in place the set that a killed run had written into {dst}")
    prepared = os.path.exists(os.path.join(dst, INDEX_NAME))
    if prepared and not overwrite:
        raise UsageError(
            f"DST={dst!r} already holds a prepared image set ({INDEX_NAME}); pass "
            "--overwrite to replace it, or choose another folder"
        )
    # Hidden entries (.DS_Store) are not the user's data, as training does not read them.
    other = sorted(e.name + os.sep * e.is_dir() for e in os.scandir(dst) if e.name[0] != ".")
    other = [name for name in other if not OURS.fullmatch(name)]
    if other and not prepared:
        raise UsageError(
            f"DST={dst!r} is not empty and not a prepared image set (no {INDEX_NAME}): it holds "
            f"{', '.join(other[:5])}{', ...' * (len(other) > 5)}; name an empty or new folder, "
            "or an existing prepared set with --overwrite"
        )


def write_set(args: argparse.Namespace, listing, classes: list[str], temp: str):
    """Every image encoded into shards in `temp`, its index last: (the ShardWriter, the bad
    files as (path in SRC, why), how many kept their bytes). PrepareError, nothing written, for
    a bad file under --bad-files error."""
    (files, labels, _), src = listing, args.src
    writer = ShardWriter(temp, int(args.shard_mb * 2**20))
    bad, kept, start = [], 0, time.monotonic()
    # Between the shards' lines (a shard can take minutes), on a terminal only.
    done = Progress(f"{PROG}: encoded", len(files), "images")

    def progress(shard: str | None, k: int) -> None:  # a line a shard: modest at any size
        if shard:
            took = time.monotonic() - start
            print(f"  {shard}: {k + 1:,}/{len(files):,} images, {took:.0f} s", flush=True)

    work = partial(encode, max_side=args.max_side, quality=args.quality)
    # A Ctrl-C leaves the `with` through terminate(): the workers end at once.
    with quiet_pool(args.workers) if args.workers > 1 else nullcontext() as pool:
        results = pool.imap(work, files, chunksize=16) if pool else map(work, files)
        for k, result in enumerate(results):  # in file order
            done.update(k + 1)
            if isinstance(result, str):
                bad.append((os.path.relpath(files[k], src), result))
            if isinstance(result, str) or (bad and args.bad_files == "error"):
                continue  # under error, read on only to name every bad file
            kept += result[1]
            # a shard that adding sample k completed holds the samples before it
            progress(writer.add(result[0], labels[k], os.path.relpath(files[k], src)), k - 1)
    if bad and args.bad_files == "error":
        raise PrepareError(
            f"{len(bad)} unreadable image(s), nothing written: "
            + "; ".join(why for _, why in bad)
            + "; remove them, or pass --bad-files skip to leave them out"
        )
    progress(writer.finish(), len(files) - 1)
    if not writer.rows:
        raise PrepareError(f"SRC={src!r}: none of its {len(files)} images can be read")
    header = {
        "format": FORMAT,
        "version": VERSION,
        "source": src,
        "max_side": args.max_side,
        "quality": args.quality,
        "classes": classes,
        "skipped": [path for path, _ in bad],
        "fields": SAMPLE_FIELDS,
    }
    write_index(temp, header, writer.shards, writer.rows)
    return writer, bad, kept


def prepare(args: argparse.Namespace) -> None:
    src, dst = args.src, args.dst
    try:
        classes = class_folders(src) if os.path.isdir(src) else []
        listing = scan("SRC", src, classes)
    except FolderError as err:
        raise UsageError(str(err)) from None
    created = dst_path(src, dst)
    os.makedirs(dst, exist_ok=True)
    with writing(dst) as ours:
        if not ours:  # another run's DST, which it may have made: left to it
            raise UsageError(f"DST={dst!r}: another prepare_images is writing it; wait for it")
        temp = os.path.join(dst, TEMP)
        try:
            dst_contents(dst, args.overwrite)
            print(f"{PROG}: {len(listing.files):,} images of {len(classes)} classes in {src}")
            if listing.skipped:
                print(f"{PROG}: {left_out_line('SRC', src, listing.skipped)}", flush=True)
            os.makedirs(temp)
            writer, bad, kept = write_set(args, listing, classes, temp)
        except BaseException:  # a bad file under error, Ctrl-C, a full disk: DST as it was
            with held():
                shutil.rmtree(temp, ignore_errors=True)
                if created:
                    shutil.rmtree(dst, ignore_errors=True)
            raise
        with held():
            swap(dst, temp, [shard["name"] for shard in writer.shards])
    if bad:
        print(f"skipped {len(bad)} unreadable image(s) (--bad-files skip):")
        print("\n".join(f"  {why}" for _, why in bad))
    n = len(writer.rows)
    size = sum(s["bytes"] for s in writer.shards) / 2**20
    print(
        f"wrote {n:,} images ({kept:,} kept as they were, {n - kept:,} re-encoded) in "
        f"{len(writer.shards)} shard(s), {size:,.1f} MiB, and {os.path.join(dst, INDEX_NAME)}"
    )
    print(f"train on it with: data=image_shards data.path={dst}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Write an image folder (ImageNet's layout: SRC/<class>/<image>.jpg|.jpeg|"
        ".png) once as JPEGs of at most --max-side on the shorter side, in tar shards with an "
        "index, for data=image_shards data.path=DST. The default training path stays the "
        "original folder (data=image_folder, every pixel); training on DST trades the pixels "
        "beyond --max-side for less to read and decode.",
    )
    parser.add_argument("src", help="the image folder, one subfolder of images per class")
    parser.add_argument(
        "dst", help="a new or empty folder, or a prepared set to replace (with --overwrite)"
    )
    parser.add_argument(
        "--max-side",
        type=int,
        required=True,
        help="shrink images whose SHORTER side is larger to this (aspect kept; smaller ones "
        "stay as they are). Training crops then come from these pixels: 256 suits 224-pixel "
        "training, at a fraction of the bytes to read and decode; higher keeps more detail.",
    )
    parser.add_argument(
        "--shard-mb", type=float, default=256, help="about this many MiB a shard (default 256)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="encoding processes (default: every CPU)",
    )
    parser.add_argument(
        "--quality",
        type=int,
        default=90,
        help="JPEG quality of re-encoded images, 1-95 (default 90)",
    )
    parser.add_argument(
        "--bad-files",
        choices=["error", "skip"],
        default="error",
        help="an unreadable image: error (default) names every one and writes nothing; skip "
        "leaves them out and lists them",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a prepared set in DST")
    args = parser.parse_args(argv)
    for name, ok, fix in [
        ("--max-side", args.max_side > 0, "a positive number of pixels, e.g. 256"),
        ("--shard-mb", args.shard_mb > 0, "a positive size, e.g. 256"),
        ("--workers", args.workers > 0, "a positive number of processes"),
        ("--quality", 1 <= args.quality <= 95, "between 1 and 95, e.g. 90"),
    ]:
        if not ok:
            parser.error(f"{name}={getattr(args, name[2:].replace('-', '_'))}: must be {fix}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    before = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        prepare(args)
    except KeyboardInterrupt as stop:  # one line, as train.py says it; 128 + the signal
        sig = signal.SIGTERM if isinstance(stop, Stopped) else signal.SIGINT
        how = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
        print(f"{PROG}: interrupted ({how}); nothing half-written in {args.dst}", file=sys.stderr)
        sys.exit(128 + sig)
    except UsageError as err:
        print(f"{PROG}: {err}", file=sys.stderr)
        sys.exit(2)
    except PrepareError as err:  # images found unreadable: exit 1, as check_images does
        sys.exit(f"{PROG}: {err}")
    finally:  # the caller's handler back (a test calls main in its own process)
        signal.signal(signal.SIGTERM, before)


if __name__ == "__main__":
    main()
