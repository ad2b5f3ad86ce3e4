"""Crash-safe checkpoint files: the on-disk layout, atomic writes sealed by a manifest of checksums,
weights_only loading whose errors name the file and the failed check (`load` and `Loaded`: one
rank's view of a checkpoint, the model weights and the run's config among it), and pruning. What
the files hold, and how it is put back into live objects, is mgpu.ckpt.state's; the data cursor a
checkpoint records is mgpu.data.sampler's; which checkpoint a launch resumes from and when one is
saved, mgpu.ckpt.resume's.

Layout (the run directory must be on a filesystem that every rank sees):

    <run dir>/checkpoints/step-00000300/state.pt       rank 0: model, optimizer, schedule, scaler,
                                                       step, data cursor, resolved config
                                       rank-<r>.pt     rank r: its RNG states
                                       manifest.json   written last: size + sha256 of every file
    <run dir>/checkpoints/step-00000400.tmp-<token>/   a save in progress (or a crashed one)
    <run dir>/checkpoints/step-00000200.invalid-<token>/  an invalid checkpoint whose step was
                                                       saved again: kept as evidence

A directory without a valid manifest does not exist for resume. Saving, in this order:
every rank `write_rank_files`; barrier; rank 0 `finalize`; barrier; rank 0 `prune`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mgpu.runtime.dist import RunStopped

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARED = "state.pt"
_STEP = re.compile(r"^step-(\d{8,})$")
_SCRATCH = re.compile(r"^step-(\d{8,})\.(tmp|old)-.+$")  # a save in progress, or one being deleted


class CheckpointError(RuntimeError, RunStopped):
    """A checkpoint that cannot be written or used; names the file and the check that failed."""

    def __init__(self, file: Path | str, check: str, *, read_error: bool = False):
        super().__init__(f"{file}: {check}")
        self.file, self.check = Path(file), check
        # The file could not be read now (an I/O error, the device out of memory), which says
        # nothing about whether it is valid: resume must stop, not fall back to an older one.
        self.read_error = read_error


# ---- layout ----


def checkpoint_root(run_dir: Path | str) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def staging_dir(root: Path, step: int, token: str) -> Path:
    """Where a save is assembled; `token` must be the same on every rank of one launch and differ
    between launches, so a crashed attempt's leftovers are never mixed into a new save."""
    return root / f"step-{step:08d}.tmp-{token}"


def step_number(path: Path) -> int:
    """The step of checkpoint directory `path` (step-NNNNNNNN), from its name."""
    match = _STEP.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: not named step-NNNNNNNN")
    return int(match.group(1))


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def _dirs(root: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(step, path) of the directories in root whose name matches, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name))]
    return sorted((s, p) for s, p in found if p.is_dir())[::-1]


# ---- writing ----


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
    with open(path, "wb") as f:
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


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created or renamed child) durable, not only its files."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def newest_kept(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose manifest and file sizes check (no hashing), for
    messages about a failed save: what a restart would resume from."""
    for _, path in _dirs(Path(root), _STEP):
        try:
            verify(path, checksums=False)
            return path
        except CheckpointError:
            continue
    return None


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
        _fsync_dir(staging)
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
    return {"name": path.name, "size": path.stat().st_size, "sha256": _sha256(path)}


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
            aside = final.with_name(f"{final.name}.invalid-{token}")
            log.warning("%s; kept as evidence in %s", err, aside.name)
        os.replace(final, aside)
    try:
        os.replace(staging, final)
        _fsync_dir(final.parent)
        _fsync_dir(final.parent.parent)  # the first save also created checkpoints/ itself
        verify(final)
    except BaseException:
        if final.exists() and not staging.exists():
            os.replace(final, staging)  # out of resume's sight; the caller deletes it
        if aside.exists():
            os.replace(aside, final)
        raise
    if _SCRATCH.match(aside.name):
        shutil.rmtree(aside, ignore_errors=True)


def _remove_dir(path: Path, token: str) -> None:
    """Rename out of the step-NNNNNNNN namespace first, then delete: a crash mid-delete leaves a
    scratch directory that prune sweeps, never a half-deleted checkpoint."""
    aside = path.with_name(f"{path.name}.old-{token}")
    os.replace(path, aside)
    shutil.rmtree(aside)


# ---- verifying and loading ----


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def read_manifest(path: Path) -> dict:
    """The manifest of checkpoint directory `path`, checked for shape; no file is hashed."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(path, "not a checkpoint directory (<run dir>/checkpoints/step-N)")
    file = path / MANIFEST
    if not file.is_file():
        raise CheckpointError(file, "missing manifest: the save never finished")
    try:
        manifest = json.loads(file.read_text())
        version, world = manifest["version"], int(manifest["world_size"])
        manifest["step"] = int(manifest["step"])
        manifest["files"] = [
            {"name": str(e["name"]), "size": int(e["size"]), "sha256": str(e["sha256"])}
            for e in manifest["files"]
        ]
        entries = {e["name"] for e in manifest["files"]}
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(file, f"unreadable manifest ({type(err).__name__}: {err})") from err
    if version != FORMAT_VERSION:
        raise CheckpointError(file, f"format version {version}, this mgpu reads {FORMAT_VERSION}")
    expected = {SHARED, *(rank_file(r) for r in range(world))}
    if entries != expected:
        # Also keeps a hand-edited manifest from pointing outside the directory.
        got = sorted(entries)
        raise CheckpointError(file, f"manifest lists {got}, expected {sorted(expected)}")
    return manifest


def _check_file(path: Path, entry: dict, checksums: bool) -> None:
    expected = entry["size"]
    try:
        size = path.stat().st_size
        if size == expected and checksums:
            digest = _sha256(path)
    except FileNotFoundError:
        raise CheckpointError(path, "missing file listed in the manifest") from None
    except OSError as err:
        raise CheckpointError(path, f"unreadable ({err})") from err
    if size == 0:
        raise CheckpointError(path, f"empty file (the manifest says {expected} bytes)")
    if size < expected:
        raise CheckpointError(path, f"truncated: {size} of {expected} bytes")
    if size != expected:
        raise CheckpointError(path, f"size mismatch: {size} bytes, the manifest says {expected}")
    if checksums and digest != entry["sha256"]:
        raise CheckpointError(
            path, f"checksum mismatch: sha256 {digest[:16]}..., manifest {entry['sha256'][:16]}..."
        )


def verify(path: Path, *, checksums: bool = True) -> dict:
    """Check every file of checkpoint `path` against its manifest (size, and sha256 unless
    checksums=False); returns the manifest or raises CheckpointError(file, check)."""
    manifest = read_manifest(path)
    for entry in manifest["files"]:
        _check_file(Path(path) / entry["name"], entry, checksums)
    return manifest


# torch's advice around its reasons: to load unsafely (weights_only=False), to allowlist what
# the file names, to file an issue, to read the docs. None of it is for a checkpoint, which mgpu
# writes with weights_only-loadable types only; following the first would run the file's code.
_ADVICE = re.compile(
    r"set to `?False|weights_only=False|default value of the `weights_only`|trusted source|"
    r"two options|Alternatively|safe_globals|file an issue|Check the documentation|"
    r"Weights only load failed",
    re.I,
)


def _without_advice(message: str) -> str:
    """torch's reason on one line, with every sentence of its advice left out."""
    plain = " ".join(re.sub(r"\033\[[0-9;]*m", "", message).split())
    kept = [s for s in re.split(r"(?<=\.)\s+", plain) if s and not _ADVICE.search(s)]
    return " ".join(kept) or "the file holds what weights_only loading does not allow"


def _load_torch(path: Path, map_location: Any) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        # No fallback to full unpickling: that would run whatever code the file names. torch
        # raises its own message `from None`, with the unpickler's plain reason as the context.
        inner = err.__context__
        reason = str(inner if isinstance(inner, pickle.UnpicklingError) else err)
        why = _without_advice(reason)
        raise CheckpointError(path, f"refused by torch.load(weights_only=True): {why}") from err
    except Exception as err:
        what = f"unreadable by torch.load ({type(err).__name__}: {_without_advice(str(err))})"
        transient = isinstance(err, torch.OutOfMemoryError) or (
            isinstance(err, OSError) and not isinstance(err, FileNotFoundError)
        )
        raise CheckpointError(path, what, read_error=transient) from err


@dataclass
class Loaded:
    """One rank's view of a checkpoint: the shared state, and its own state when the checkpoint
    was written by at least rank+1 processes (None when resuming on more processes)."""

    path: Path
    step: int
    world_size: int
    shared: dict
    rank_state: dict | None


def load(path: Path, *, rank: int, map_location: Any = "cpu") -> Loaded:
    """Verify the files this rank reads (size + sha256), then load them with weights_only.

    Rank state always loads to CPU: RNG states must be CPU byte tensors.
    """
    path = Path(path)
    manifest = read_manifest(path)
    entries = {e["name"]: e for e in manifest["files"]}
    world = int(manifest["world_size"])
    names = [SHARED] + ([rank_file(rank)] if rank < world else [])
    for name in names:
        _check_file(path / name, entries[name], checksums=True)
    shared = _load_torch(path / SHARED, map_location)
    own = _load_torch(path / rank_file(rank), "cpu") if rank < world else None
    return Loaded(path, int(manifest["step"]), world, shared, own)


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step-N directory under `root`, sealed or not, newest first."""
    return _dirs(Path(root), _STEP)


def find_latest_valid(root: Path, below: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` (older than step `below`, when given) that verifies
    fully, and one line per newer checkpoint that did not (file and failed check). Staging
    directories are not checkpoints."""
    problems = []
    for step, path in _dirs(Path(root), _STEP):
        if below is not None and step >= below:
            continue
        try:
            verify(path)
            return path, problems
        except CheckpointError as err:
            problems.append(str(err))
    return None, problems


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
    for step, path in _dirs(Path(root), _STEP):
        try:
            verify(path, checksums=False)
            valid.append((step, path))
        except CheckpointError as err:
            log.warning("prune: leaving invalid checkpoint in place: %s", err)
    newest = valid[0][0] if valid else -1
    doomed = [path for _, path in valid[keep_last:]]
    doomed += [path for step, path in _dirs(Path(root), _SCRATCH) if step <= newest]
    removed = []
    for path in doomed:
        try:  # a checkpoint that cannot be deleted costs disk space, not the run
            if _STEP.match(path.name):
                _remove_dir(path, str(os.getpid()))
            else:
                shutil.rmtree(path)
            removed.append(path)
        except OSError as err:
            log.warning("prune: could not delete %s (%s)", path, err)
    return removed
