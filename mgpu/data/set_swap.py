"""How a prepared image set replaces what its folder (prepare_images' DST) held, with nothing
half-written and nothing lost: the new set is written whole into DST/.prepare.tmp, its index
last, then swapped in; a run killed on the way leaves what the next run tidies; one run at a
time writes a DST (a lock on the folder)."""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

from mgpu.data.image_shards import INDEX_NAME
from mgpu.runtime.durable import sync_folder

# What a run writes into DST, finished or not (the last two by runs before .prepare.tmp):
# replaced by a new set, and nothing else in DST is touched.
OURS = re.compile(r"(shard-\d{6}\.tar|\.shard-\d{6}\.tar\.tmp|\.index\.json\.tmp)")
TEMP = ".prepare.tmp"  # in DST: the set being written; complete once its index.json is there


@contextmanager
def writing(dst: str) -> Iterator[bool]:
    """Whether this run holds DST for the block: a lock on the folder itself (nothing written
    into a DST that is then refused), False where another run holds it (two runs into one DST
    would tidy each other's temporary set away). The lock goes with the process."""
    fd = os.open(dst, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        except OSError as err:  # NFS, Lustre without flock: no lock on a folder there
            print(
                f"warning: DST={dst!r}: its file system takes no lock on a folder "
                f"({err.strerror}), so another prepare_images writing it at the same time "
                "would not be refused; run one at a time",
                file=sys.stderr,
            )
        yield True
    finally:
        os.close(fd)


@contextmanager
def held():
    """SIGINT and SIGTERM blocked until the block ends, then acted on: a swap or a clean-up cut
    in two would leave DST half-replaced. (The pool's threads, which could take them, are gone.)"""
    signals = {signal.SIGINT, signal.SIGTERM}
    signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)


def write_index(dst: str, header: dict, shards: list[dict], rows: list[list]) -> None:
    """index.json, atomically: a shard or a sample a line, so that it reads as a table."""
    lines = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in header.items()]
    for name, items in (("shards", shards), ("samples", rows)):
        body = ",\n".join(f"  {json.dumps(item)}" for item in items)
        lines.append(f' "{name}": [\n{body}\n ]')
    text = "{\n" + ",\n".join(lines) + "\n}\n"
    temp = os.path.join(dst, f".{INDEX_NAME}.tmp")
    with open(temp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(dst, INDEX_NAME))
    sync_folder(dst)  # the index's name too: tidy() trusts a set whose index it finds


def swap(dst: str, temp: str, shards: list[str]) -> None:
    """Put the complete set in `temp` in place of whatever set DST holds. DST's index goes
    first: from then on DST is no set until the new index lands, never an index over another
    set's shards. A run killed on the way leaves temp's index, and tidy() finishes the swap."""
    index = os.path.join(dst, INDEX_NAME)
    if os.path.exists(index):
        os.remove(index)
    for name in shards:
        if os.path.exists(os.path.join(temp, name)):  # not yet moved by a swap cut short
            os.replace(os.path.join(temp, name), os.path.join(dst, name))
    for name in os.listdir(dst):  # the old set's other shards, and older runs' leftovers
        if OURS.fullmatch(name) and name not in shards:
            os.remove(os.path.join(dst, name))
    sync_folder(dst)  # the shards' renames on disk before the index that names them
    os.replace(os.path.join(temp, INDEX_NAME), index)
    sync_folder(dst)
    shutil.rmtree(temp)


def tidy(dst: str) -> bool:
    """What a run killed outright (SIGKILL, power loss) left in DST: a set whose swap was cut
    short is put in place (True); an unfinished one is removed. Under writing()'s lock."""
    temp = os.path.join(dst, TEMP)
    if os.path.isfile(os.path.join(temp, INDEX_NAME)):
        with open(os.path.join(temp, INDEX_NAME), encoding="utf-8") as f:
            shards = [shard["name"] for shard in json.load(f)["shards"]]
        swap(dst, temp, shards)
        return True
    if os.path.isdir(temp):
        shutil.rmtree(temp)
    return False
