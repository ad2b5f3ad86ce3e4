"""Checkpoint files: the on-disk layout, the manifest of checksums that seals each and the checks
against it, and weights_only loading whose errors name the file and the failed check (`load` and
`Loaded`: one rank's view of a checkpoint, the model weights and the run's config among it).
Writing them crash-safely, and pruning, is mgpu.ckpt.write's. What the files hold, and how it is
put back into live objects, is mgpu.ckpt.state's; the data cursor a checkpoint records is
mgpu.data.sampler's; which checkpoint a launch resumes from and when one is saved,
mgpu.ckpt.resume's.

Layout (the run directory must be on a filesystem that every rank sees):

    <run dir>/checkpoints/step-00000300/state.pt       rank 0: model, optimizer, schedule, scaler,
                                                       step, data cursor, resolved config
                                       rank-<r>.pt     rank r: its RNG states
                                       manifest.json   written last: size + sha256 of every file
    <run dir>/checkpoints/step-00000400.tmp-<token>/   a save in progress (or a crashed one)
    <run dir>/checkpoints/step-00000200.invalid-<token>/  an invalid checkpoint whose step was
                                                       saved again, or that torch.load refused
                                                       on resume: kept as evidence

A directory without a valid manifest does not exist for resume. Saving (mgpu.ckpt.write), in this
order: every rank `write_rank_files`; barrier; rank 0 `finalize`; barrier; rank 0 `prune`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mgpu.runtime.dist import RunStopped

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SHARED = "state.pt"
STEP_NAME = re.compile(r"^step-(\d{8,})$")  # a checkpoint directory


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
    match = STEP_NAME.match(Path(path).name)
    if match is None:
        raise ValueError(f"{path}: not named step-NNNNNNNN")
    return int(match.group(1))


def rank_file(rank: int) -> str:
    return f"rank-{rank}.pt"


def named_dirs(root: Path, pattern: re.Pattern) -> list[tuple[int, Path]]:
    """(step, path) of the directories in root whose name matches, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := pattern.match(p.name))]
    return sorted((s, p) for s, p in found if p.is_dir())[::-1]


def newest_kept(root: Path) -> Path | None:
    """The newest checkpoint under `root` whose manifest and file sizes check (no hashing), for
    messages about a failed save: what a restart would resume from."""
    for _, path in named_dirs(Path(root), STEP_NAME):
        try:
            verify(path, checksums=False)
            return path
        except CheckpointError:
            continue
    return None


# ---- verifying and loading ----


def sha256_of(path: Path) -> str:
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
            digest = sha256_of(path)
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
    return named_dirs(Path(root), STEP_NAME)


def find_latest_valid(root: Path, below: int | None = None) -> tuple[Path | None, list[str]]:
    """The newest checkpoint under `root` (older than step `below`, when given) that verifies
    fully, and one line per newer checkpoint that did not (file and failed check). Staging
    directories are not checkpoints."""
    problems = []
    for step, path in named_dirs(Path(root), STEP_NAME):
        if below is not None and step >= below:
            continue
        try:
            verify(path)
            return path, problems
        except CheckpointError as err:
            problems.append(str(err))
    return None, problems
