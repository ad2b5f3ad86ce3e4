"""Writing checkpoints crash-safely, in the layout mgpu.ckpt.checkpoint describes: every rank's
file into a staging directory, then rank 0's shared state and the manifest of checksums last, the
directory renamed into place and verified; a failed save removes what it wrote and names the file;
pruning deletes old checkpoints and crashed saves, never an invalid checkpoint (evidence)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from mgpu.ckpt.checkpoint import (
    FORMAT_VERSION,
    MANIFEST,
    SHARED,
    STEP_NAME,
    CheckpointError,
    named_dirs,
    newest_kept,
    rank_file,
    sha256_of,
    staging_dir,
    step_dir,
    step_dirs,
    verify,
)
from mgpu.runtime.ctrl_c import ctrl_c_held
from mgpu.runtime.durable import sync_folder

log = logging.getLogger(__name__)

_SCRATCH = re.compile(r"^step-(\d{8,})\.(tmp|old)-.+$")  # a save in progress, or one being deleted


def _check_safe(obj: Any, where: str) -> None:
    """Refuse at save time what torch.load(weights_only=True) would refuse at resume time."""
    if isinstance(obj, torch.Tensor) or type(obj) in (str, int, float, bool, type(None)):
        return
    if type(obj) in (torch.dtype, torch.device):
        return
    if type(obj) in (dict, OrderedDict):
        for key, value in obj.items():
            _check_safe(key, f"{where} key {key!r}")
            _check_safe(value, f"{where}[{key!r}]")
    elif type(obj) in (list, tuple, torch.Size):
        for i, value in enumerate(obj):
            _check_safe(value, f"{where}[{i}]")
    else:
        raise TypeError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
            "torch.load(weights_only=True) refuses; store tensors, numbers, str, lists or dicts"
        )


class _HashingWriter:
    """A file wrapper that hashes the bytes torch.save produces as they go out, so the manifest
    records what was meant to be written and verification compares the disk against it."""

    def __init__(self, f):
        self.f, self.sha, self.size, self.error = f, hashlib.sha256(), 0, None

    def write(self, data) -> int:
        try:
            written = self.f.write(data)
        except OSError as err:
            self.error = err  # torch's zip writer replaces it with an opaque RuntimeError
            raise
        self.sha.update(data)
        self.size += len(data)
        return written

    def flush(self) -> None:
        self.f.flush()


def _write_torch(path: Path, obj: Any) -> dict:
    """torch.save to `path`, fsynced; returns its manifest entry."""
    # Cut short inside _HashingWriter.write, torch's zip writer either raises a RuntimeError of
    # its own (a periodic save logs it and training would go on past the Ctrl-C) or aborts the
    # process from its destructor: the Ctrl-C waits for the file (seconds at most).
    with ctrl_c_held(), open(path, "wb") as f:
        writer = _HashingWriter(f)
        try:
            torch.save(obj, writer)
        except Exception:
            if writer.error is not None:
                raise writer.error from None  # the real cause, e.g. ENOSPC
            raise
        f.flush()
        os.fsync(f.fileno())
    return {"name": path.name, "size": writer.size, "sha256": writer.sha.hexdigest()}


def _save_failed(root: Path, file: Path, err: BaseException) -> CheckpointError:
    previous = newest_kept(root)
    kept = f"previous checkpoint {previous} is intact" if previous else "none before it"
    return CheckpointError(file, f"save failed ({type(err).__name__}: {err}); {kept}")


def write_rank_files(root: Path, step: int, rank: int, state: dict, *, token: str) -> Path:
    """Every rank, first: write this rank's state to the staging directory; returns that
    directory. On failure removes what it wrote and raises CheckpointError (path + cause)."""
    _check_safe(state, f"rank {rank} state")
    staging = staging_dir(root, step, token)
    path = staging / rank_file(rank)
    try:
        staging.mkdir(parents=True, exist_ok=True)
        _write_torch(path, state)
    except Exception as err:
        path.unlink(missing_ok=True)
        raise _save_failed(root, path, err) from err
    return staging


def finalize(root: Path, step: int, world_size: int, shared: dict, *, token: str) -> Path:
    """Rank 0, after every rank's write_rank_files returned (barrier between): write the shared
    state, then the manifest last, rename the staging directory into place and verify it.

    Returns the checkpoint's path. On any failure the staging directory is removed, older
    checkpoints are untouched, and CheckpointError names the path and the cause.
    """
    _check_safe(shared, "shared state")
    staging, final = staging_dir(root, step, token), step_dir(root, step)
    try:
        entries = [_write_torch(staging / SHARED, shared)]
        entries += [_entry_from_disk(staging / rank_file(r)) for r in range(world_size)]
        names = {e["name"] for e in entries}
        for stray in [p for p in staging.iterdir() if p.name not in names]:
            stray.unlink()  # a same-token leftover (e.g. a larger world's rank file)
        manifest = {"version": FORMAT_VERSION, "step": step, "world_size": world_size}
        manifest |= {"saved_at": time.time(), "files": entries}
        with open(staging / MANIFEST, "w") as f:
            json.dump(manifest, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        sync_folder(staging)
        _publish(staging, final, token)
    except Exception as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise _save_failed(root, final, err) from err
    log.info("checkpoint saved: %s", final)
    return final


def abort(root: Path, step: int, *, token: str) -> None:
    """Rank 0, when any rank's write failed: remove the staging directory (older checkpoints
    are untouched; prune would also sweep it after the next successful save)."""
    shutil.rmtree(staging_dir(root, step, token), ignore_errors=True)


def _entry_from_disk(path: Path) -> dict:
    """A rank file's manifest entry, hashed by rank 0 (rank files are a few KB)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path.name} missing: every rank must write before finalize")
    return {"name": path.name, "size": path.stat().st_size, "sha256": sha256_of(path)}


def _publish(staging: Path, final: Path, token: str) -> None:
    """Rename the staging directory to its final name (atomic), then verify it there.

    A same-step checkpoint already in place (an earlier attempt's) moves aside, since os.replace
    cannot replace a non-empty directory: a valid one is deleted once the new one verified; an
    invalid one is kept as evidence, as prune keeps them, renamed step-N.invalid-<token> (out
    of resume's and prune's sight). On failure the new one goes back to its staging name and
    the old one back into place.
    """
    aside = final.with_name(f"{final.name}.old-{token}")
    if final.exists():
        try:
            verify(final)
            log.warning("%s exists (an earlier attempt at this step); replacing it", final)
        except CheckpointError as err:
            aside = evidence_name(final, token)
            log.warning("%s; kept as evidence in %s", err, aside.name)
        os.replace(final, aside)
    try:
        os.replace(staging, final)
        sync_folder(final.parent)
        sync_folder(final.parent.parent)  # the first save also created checkpoints/ itself
        verify(final)
    except Exception:
        if final.exists() and not staging.exists():
            os.replace(final, staging)  # out of resume's sight; the caller deletes it
        if aside.exists():
            os.replace(aside, final)
        raise
    except BaseException:
        # Ctrl-C (or an exit) while publishing. Once renamed into place, the checkpoint was
        # whole and fsynced, its manifest last: it stays, and resume verifies it in full. Before
        # the rename, the earlier one goes back into place. (Rolled back, the newest checkpoint
        # vanished with a Ctrl-C that reached this verification.)
        if not final.exists() and aside.exists():
            os.replace(aside, final)
        raise
    if _SCRATCH.match(aside.name):
        shutil.rmtree(aside, ignore_errors=True)


def evidence_name(path: Path, token: str) -> Path:
    """Where invalid checkpoint `path` is kept: step-N.invalid-<token>, a name that neither
    resume nor prune reads."""
    return path.with_name(f"{path.name}.invalid-{token}")


def keep_as_evidence(path: Path, token: str) -> Path | None:
    """Rank 0: move checkpoint `path`, found invalid in a way its manifest cannot show (refused
    by torch.load(weights_only=True) on some rank), to its evidence name; returns where it went,
    or None where it could not be moved (logged: the run goes on without it)."""
    aside = evidence_name(path, token)
    try:
        os.replace(path, aside)
        sync_folder(path.parent)
    except OSError as err:
        log.warning("could not move invalid checkpoint %s aside (%s)", path, err)
        return None
    log.warning("%s: kept as evidence in %s", path, aside.name)
    return aside


def _remove_dir(path: Path, token: str) -> None:
    """Rename out of the step-NNNNNNNN namespace first, then delete: a crash mid-delete leaves a
    scratch directory that prune sweeps, never a half-deleted checkpoint."""
    aside = path.with_name(f"{path.name}.old-{token}")
    os.replace(path, aside)
    shutil.rmtree(aside)


def prune(root: Path, keep_last: int) -> list[Path]:
    """Rank 0, after finalize returned: delete valid checkpoints older than the newest
    `keep_last`, and scratch directories of crashed saves; returns what was deleted.

    Validity here is the manifest and the file sizes (no hashing): the newest was fully verified
    by finalize a moment ago, and each older one was when it was written. Invalid checkpoints are
    never deleted: a failed check may be a transient read error, and they are the evidence of
    what went wrong; resume skips them, and a save at the same step moves one to
    step-N.invalid-<token> (finalize), where it stays. Scratch directories at or below the newest
    valid step are leftovers of a crashed writer (a live save always writes a newer step),
    whatever pid.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1 (the newest is always kept)")
    valid = []
    for step, path in step_dirs(root):
        try:
            verify(path, checksums=False)
            valid.append((step, path))
        except CheckpointError as err:
            log.warning("prune: leaving invalid checkpoint in place: %s", err)
    newest = valid[0][0] if valid else -1
    doomed = [path for _, path in valid[keep_last:]]
    doomed += [path for step, path in named_dirs(Path(root), _SCRATCH) if step <= newest]
    removed = []
    for path in doomed:
        try:  # a checkpoint that cannot be deleted costs disk space, not the run
            if STEP_NAME.match(path.name):
                _remove_dir(path, str(os.getpid()))
            else:
                shutil.rmtree(path)
            removed.append(path)
        except OSError as err:
            log.warning("prune: could not delete %s (%s)", path, err)
    return removed
