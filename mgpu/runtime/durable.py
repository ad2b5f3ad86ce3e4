"""What makes a change on disk survive a power loss beyond a file's own fsync: a folder's
entries (a file created or renamed in it), for the checkpoint writer and the prepared image
sets' swap."""

from __future__ import annotations

import os


def sync_folder(folder: str | os.PathLike) -> None:
    """The entries of `folder` on disk (a file's fsync does not make its name durable)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
