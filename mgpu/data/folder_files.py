"""Which files an image folder holds (ImageNet's layout, one subfolder of images per class): the
class folders and their checks, the listing of images, what the listing leaves out, and the
images held out for evaluation when there is no data.eval_path. Shared by data=image_folder,
prepare_images and check_images."""

from __future__ import annotations

import hashlib
import os
from typing import NamedTuple

from mgpu.config.checks import ConfigError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")  # compared lower-cased


class FolderError(ValueError):
    """An image tree that cannot work: the key, its value, what is wrong and how to fix it."""

    def __init__(self, key: str, value: object, why: str):
        super().__init__(f"{key}={value!r}: {why}")
        self.key, self.value, self.why = key, value, why


def _is_image(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES) and not name.startswith(".")


def class_folders(root: str) -> list[str]:
    """The class folders of `root`, sorted by name: their order is the class index."""
    return sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))


def check_root(key: str, root: str) -> list[str]:
    """`root` is a folder, and none of its entries named like a folder is a link to nothing: a
    class folder linked from a share that is not mounted would be neither read nor said.
    Returns the files beside its class folders (hidden ones aside), which training leaves out."""
    if not os.path.isdir(root):
        what = "is not a folder" if os.path.exists(root) else "does not exist"
        raise FolderError(
            key,
            root,
            f"{what}; point it at a folder with one subfolder of images (.jpg, .jpeg, .png) "
            "per class",
        )
    beside = []
    with os.scandir(root) as entries:
        for e in entries:
            if e.name.startswith("."):
                continue
            # A link to nothing named like a folder (no extension) was meant for a class; one
            # named like a file is a file beside the class folders, left out as any is.
            dangling = e.is_symlink() and not os.path.exists(e.path)
            if dangling and not os.path.splitext(e.name)[1]:
                raise FolderError(
                    key,
                    root,
                    f"{e.name} is a link to {os.readlink(e.path)}, which does not exist (a share "
                    "not mounted?); mount it, or remove the link",
                )
            if e.is_file() or dangling:
                beside.append(e.name)
    return beside


def _no_classes(key: str, root: str) -> FolderError:
    if os.path.isfile(os.path.join(root, "index.json")):  # prepare_images' DST
        why = "holds a set prepared by mgpu.data.prepare_images, not class subfolders: train "
        return FolderError(key, root, why + "on it with data=image_shards")
    return FolderError(
        key,
        root,
        "has no class subfolders; put each class's images in a subfolder named after the "
        f"class, e.g. {os.path.join(root, 'cat', '001.jpg')}",
    )


def _no_folder(key: str, root: str, name: str, folder: str) -> FolderError:
    return FolderError(
        key,
        root,
        f"has no folder for class {name!r} ({folder}); add it, or train on the classes it holds "
        "with data.classes=[...]",
    )


def _no_images(key: str, root: str, folder: str) -> FolderError:
    return FolderError(
        key,
        root,
        f"the class folder {folder} holds no images (.jpg, .jpeg, .png); add some, or remove "
        "the folder",
    )


def missing_classes(key: str, root: str, classes: list[str], some: bool) -> list[str]:
    """The classes with no folder under `root`: a FolderError for the first, or with `some`
    (an evaluation folder, which may hold a part of the classes) only if none has one."""
    missing = [name for name in classes if not os.path.isdir(os.path.join(root, name))]
    if missing and not some:
        raise _no_folder(key, root, missing[0], os.path.join(root, missing[0]))
    if some and len(missing) == len(classes):
        raise FolderError(
            key,
            root,
            f"has a folder for none of data.path's {len(classes)} classes "
            f"({', '.join(classes[:3])}{', ...' * (len(classes) > 3)}); point it at a folder "
            "with one subfolder of images per class, named as data.path's",
        )
    return missing


def check_layout(key: str, root: str, classes: list[str], some: bool = False) -> None:
    """Each class has a folder under `root` holding at least one image (with `some`, each class
    that has a folder; missing_classes). Stops at the first image of each folder, so a
    million-image tree is checked in a directory listing per class (a run's config checks this
    before any process group exists; `scan` lists it all)."""
    check_root(key, root)
    if not classes:
        raise _no_classes(key, root)
    missing = missing_classes(key, root, classes, some)
    for name in classes:
        folder = os.path.join(root, name)
        if name in missing:
            continue
        with os.scandir(folder) as entries:
            if not any(e.is_file() and _is_image(e.name) for e in entries):
                raise _no_images(key, root, folder)


def list_class(key: str, root: str, name: str) -> tuple[list[str], list[str]]:
    """One class folder's images (sorted by file name) and what training leaves out of it (its
    sub-folders and files of other formats, relative to `root`), in one listing; a FolderError
    if it holds no images."""
    folder = os.path.join(root, name)
    images, skipped = [], []
    with os.scandir(folder) as entries:
        for e in entries:
            if e.name.startswith("."):
                continue
            if e.is_dir():
                skipped.append(os.path.join(name, e.name) + os.sep)
            elif _is_image(e.name):
                images.append(e.name)
            else:
                skipped.append(os.path.join(name, e.name))
    if not images:
        raise _no_images(key, root, folder)
    prefix = os.path.join(folder, "")  # os.path.join's result, at a million files' pace
    return [prefix + n for n in sorted(images)], skipped


ONE_FOLDER_FIX = "put each class's images in a subfolder of its own"


def check_two_classes(root: str, classes: list[str], asked: bool, fix: str = ONE_FOLDER_FIX):
    """A classifier of one class learns nothing (its loss is 0 from the first step). `fix`:
    what gives data.path more classes; `asked`: data.classes named them."""
    if len(classes) > 1:
        return
    key, value = ("data.classes", classes) if asked else ("data.path", root)
    why = f"gives one class ({classes[0]!r}), and a classifier learns nothing from one"
    raise FolderError(key, value, f"{why}; {'name two or more' if asked else fix}")


class Listing(NamedTuple):
    """An image folder's contents as training reads them."""

    files: list[str]  # every image of the classes' folders, sorted by class, then by name
    labels: list[int]  # each file's class index
    skipped: list[str]  # what training does not read, relative to the root (left_out_line)


def scan(key: str, root: str, classes: list[str], some: bool = False) -> Listing:
    """`root`'s images and what it leaves out, in one listing of each class folder (a
    million-image tree on network storage is listed once, not once per question), with
    check_layout's checks. Sorted by class, then by file name, so that the sample order is the
    same on every host. Left out: files beside the class folders, and in the classes' folders
    sub-folders (only a class folder's own images are read) and files of other formats; hidden
    entries (.DS_Store) are neither read nor said. `some`: as check_layout's."""
    skipped = check_root(key, root)
    if not classes:
        raise _no_classes(key, root)
    missing = missing_classes(key, root, classes, some)
    files, labels = [], []
    for label, name in enumerate(classes):
        if name not in missing:
            images, left = list_class(key, root, name)
            files += images
            labels += [label] * len(images)
            skipped += left
    return Listing(files, labels, sorted(skipped))


def left_out_line(key: str, root: str, skipped: list[str]) -> str:
    """What is said of a Listing's `skipped` entries: how many of each kind, with examples."""
    beside = [s for s in skipped if os.sep not in s]
    folders = [s for s in skipped if s.endswith(os.sep)]
    files = [s for s in skipped if os.sep in s and not s.endswith(os.sep)]
    parts = []
    for found, what in (
        (beside, "file(s) beside the class folders, in none of them"),
        (folders, "sub-folder(s) of class folders"),
        (files, "file(s) not .jpg, .jpeg or .png"),
    ):
        if found:
            parts.append(
                f"{len(found)} {what} ({', '.join(found[:3])}{', ...' * (len(found) > 3)})"
            )
    return (
        f"{key}={root}: not read: {'; '.join(parts)}. The images of a class are the JPEG and "
        "PNG files directly in its folder; move the others into one (as JPEG or PNG) to train "
        "on them"
    )


EVAL_SHARE = 0.02  # data.eval_samples=auto: this share of data.path's images is held out,
EVAL_FLOOR = 16  # but no fewer than this (a small folder's evaluation is not one batch),
EVAL_CEILING = 10_000  # nor more than this (ImageNet-sized folders: an evaluation stays short),
EVAL_MOST = 0.2  # nor, in a small folder, more than this share of it: the rest trains


def auto_eval_samples(n: int) -> int:
    """data.eval_samples=auto for a folder of `n` images with no data.eval_path."""
    share = min(max(round(EVAL_SHARE * n), EVAL_FLOOR), EVAL_CEILING)
    return max(1, min(share, int(EVAL_MOST * n)))


def count_images(root: str, classes: list[str]) -> int:
    """How many images the classes' folders under `root` hold (a listing per class), as
    list_class finds them (a sub-folder named like an image is none)."""
    total = 0
    for name in classes:
        with os.scandir(os.path.join(root, name)) as entries:
            total += sum(_is_image(e.name) and not e.is_dir() for e in entries)
    return total


def holdout(n: int, eval_samples: int) -> list[int]:
    """Indices of `eval_samples` of `n` sorted files, spread evenly over the list (so over the
    classes too), held out for evaluation."""
    return sorted({int((k + 0.5) * n / eval_samples) for k in range(eval_samples)})


def split_indices(n: int, eval_samples: int | str, train: bool) -> list[int]:
    """Which of `n` sorted images of data.path a split takes when there is no data.eval_path:
    the `holdout` for eval (eval_samples of them, or auto_eval_samples), the rest for training."""
    if eval_samples == "auto":
        eval_samples = auto_eval_samples(n)
    if eval_samples >= n:
        raise ConfigError(
            "data.eval_samples",
            eval_samples,
            f"data.path holds only {n} images, and some must be left to train on; "
            "lower it or set data.eval_path",
        )
    held = holdout(n, eval_samples)
    return sorted(set(range(n)) - set(held)) if train else held


def held_out_digest(root: str, files: list[str], held: list[int]) -> str:
    """sha256 of the held-out images' paths (`files[held]`, relative to `root`): a checkpoint
    keeps it, and an evaluation of the run compares, to know that the images it evaluates are
    the ones the run never trained on."""
    inside = len(os.path.join(root, ""))  # files[i] is os.path.join(root, class, name)
    names = "\n".join(files[i][inside:] for i in held)
    return hashlib.sha256(names.encode()).hexdigest()
