"""data=image_shards: an image folder prepared once by `python -m mgpu.data.prepare_images` into
WebDataset-layout tar shards and an index of where each JPEG's bytes lie; the index format (read
here, written there). The tars are memory-mapped and a sample is a slice at its recorded offset:
no tar parsing and no file opened per sample. Crops, labels, the holdout, decode=cpu|gpu and
bad_files are ImageFolder's: this class changes only how samples are listed and read.
"""

from __future__ import annotations

import json
import mmap
import os
from dataclasses import dataclass

import numpy as np

from mgpu.data.folder_files import FolderError, class_folders, split_indices
from mgpu.data.image_folder import ImageFolder

INDEX_NAME = "index.json"  # written last by prepare_images: without it a folder is not a set
FORMAT, VERSION = "mgpu-image-shards", 1
# One row of the index's "samples" per image: its shard (a position in "shards"), where its
# JPEG's bytes start in that tar file and how many there are, its label (a position in
# "classes") and its path relative to the source folder.
SAMPLE_FIELDS = ["shard", "offset", "length", "label", "path"]


def shard_name(number: int) -> str:
    return f"shard-{number:06d}.tar"


def not_prepared(root: str) -> str:
    if os.path.isdir(root) and class_folders(root):  # a user's image folder itself
        shards = os.path.normpath(root) + "-shards"
        return (
            f"an image folder (class subfolders), not a prepared set (no {INDEX_NAME}): train "
            f"on it with data=image_folder, or prepare it once into a new folder: python -m "
            f"mgpu.data.prepare_images {root} {shards} --max-side N, then data.path={shards}"
        )
    return (
        f"not a prepared image set (no {INDEX_NAME}): run python -m mgpu.data.prepare_images "
        f"SRC {root} --max-side N on an image folder SRC"
    )


@dataclass
class ShardIndex:
    """A prepared set's index.json, its samples as columns."""

    root: str
    classes: list[str]
    shards: list[str]  # file names in root
    shard: np.ndarray  # [N] int64, a position in `shards`
    offset: np.ndarray  # [N] int64, the JPEG's first byte in its tar file
    length: np.ndarray  # [N] int64
    label: np.ndarray  # [N] int64, a position in `classes`
    path: list[str]  # relative to the folder it was prepared from

    def labels_for(self, key: str, classes: list[str], some: bool = False) -> np.ndarray:
        """Each sample's label as a position in `classes` (the run's class list, which may
        order or choose the classes otherwise than this index), -1 for a class not among
        them. Every one of `classes` must have images here (with `some`, an evaluation set, at
        least one)."""
        missing = [name for name in classes if name not in self.classes]
        if missing and (not some or len(missing) == len(classes)):
            raise FolderError(
                key,
                self.root,
                f"holds no images of the classes {missing[:5]}{' ...' if missing[5:] else ''}; "
                "prepare it from a folder that has them, or leave them out of data.classes",
            )
        position = {name: k for k, name in enumerate(classes)}
        lookup = np.array([position.get(name, -1) for name in self.classes], dtype=np.int64)
        return lookup[self.label]


def load_index(key: str, root: str) -> ShardIndex:
    """`root`'s index, checked against its shard files (present, and as long as written); a
    FolderError naming `key` if it is not a complete prepared set."""
    file = os.path.join(root, INDEX_NAME)
    if not os.path.isfile(file):
        gone = "" if os.path.exists(root) else "does not exist; "
        raise FolderError(key, root, gone + not_prepared(root))
    try:
        with open(file, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT or doc.get("version") != VERSION:
            raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
        if doc["fields"] != SAMPLE_FIELDS:
            raise ValueError(f"fields {doc['fields']}")
        columns = list(zip(*doc["samples"], strict=True)) or [()] * len(SAMPLE_FIELDS)
        shard, offset, length, label = (np.array(c, dtype=np.int64) for c in columns[:4])
        shards = [s["name"] for s in doc["shards"]]
        sizes = [s["bytes"] for s in doc["shards"]]
        classes = list(doc["classes"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise FolderError(
            key,
            root,
            f"{file} is not a readable {FORMAT} v{VERSION} index ({err}); prepare it again",
        ) from None
    for name, size in zip(shards, sizes, strict=True):
        path = os.path.join(root, name)
        found = os.path.getsize(path) if os.path.isfile(path) else None
        if found != size:
            what = "is missing" if found is None else f"holds {found} bytes, not {size}"
            raise FolderError(key, root, f"its shard {path} {what}; prepare the set again")
    return ShardIndex(root, classes, shards, shard, offset, length, label, list(columns[4]))


class ImageShards(ImageFolder):
    """ImageFolder's samples from a prepared set (`path`: prepare_images' DST; `eval_path`:
    another prepared set, or empty for `eval_samples` held out of `path`). `files[i]` names a
    sample as SHARD.tar:ORIGINAL/PATH.jpg, for errors and logs."""

    choice = "image_shards"

    def __init__(self, split: str, path: str, eval_path: str = "", classes=(), **kwargs):
        # Without a class list, the index's (the source folder's class folders, sorted).
        classes = list(classes) or load_index("data.path", path).classes
        self._maps: dict[int, mmap.mmap] = {}  # shard -> its map, in the process that opened it
        self._maps_pid = -1
        super().__init__(split, path, eval_path, classes, **kwargs)

    def _split_files(self, path: str, eval_path: str, eval_samples: int | str):
        key, root = ("data.path", path)
        if eval_path and not self.train:
            key, root = ("data.eval_path", eval_path)
        index = load_index(key, root)
        labels = index.labels_for(key, self.classes, some=key == "data.eval_path")
        taken = np.flatnonzero(labels >= 0)
        if not eval_path:
            taken = taken[split_indices(len(taken), eval_samples, self.train)]
        self._shards = [os.path.join(root, name) for name in index.shards]
        self._shard, self._offset = index.shard[taken], index.offset[taken]
        self._length = index.length[taken]
        files = [f"{self._shards[index.shard[i]]}:{index.path[i]}" for i in taken]
        return files, labels[taken].tolist()

    # The memory-map rule: a process reads only through maps it opened itself, lazily, on its
    # first read of a shard. DataLoader workers get this dataset forked (the parent's maps in
    # the copy) or pickled (spawn, forkserver: an mmap cannot be pickled); either way the maps
    # are dropped (the pid check, __getstate__) and each worker maps the shards it reads.
    def read_bytes(self, i: int) -> bytes:
        """Sample i's JPEG: a slice of its shard's map (shorter than recorded if the file was
        cut short since; decoding it then fails naming files[i])."""
        if self._maps_pid != os.getpid():
            self._maps, self._maps_pid = {}, os.getpid()
        shard = int(self._shard[i])
        if shard not in self._maps:
            with open(self._shards[shard], "rb") as f:
                self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        start = int(self._offset[i])
        return self._maps[shard][start : start + int(self._length[i])]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}, "_maps_pid": -1}
