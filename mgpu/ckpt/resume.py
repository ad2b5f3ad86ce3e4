"""Checkpointing policy: which checkpoint a launch resumes from (the same on every rank), when a
save is due, every rank saving one together, and the RNG states a resumed run starts with. What
is saved comes from Trainer.state_dict() (model, optimizer, schedule, loss scaler, step, data
cursor) and goes back through Trainer.load_state_dict(); the files and their checks are
mgpu.ckpt.checkpoint's, how state is put into live objects mgpu.ckpt.state's.

Saving is the training loop's one planned sync point: it reads everything back to the host.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from mgpu.ckpt.checkpoint import (
    MANIFEST,
    CheckpointError,
    Loaded,
    checkpoint_root,
    find_latest_valid,
    load,
    newest_kept,
    step_dir,
    step_dirs,
    step_number,
    verify,
)
from mgpu.ckpt.state import CheckpointMismatch, capture_rng, restore_rng
from mgpu.ckpt.write import abort, finalize, keep_as_evidence, prune, write_rank_files
from mgpu.config.schema import CheckpointConfig, OptimConfig
from mgpu.data.sampler import ShardedSampler
from mgpu.data.tokenizer import other_tokens
from mgpu.runtime.dist import Runtime, all_ok, broadcast_object, waiting

log = logging.getLogger(__name__)


@dataclass
class CheckpointPlan:
    """Where and when fit saves (ckpt.*), and what every save carries besides training state."""

    root: Path  # <run dir>/checkpoints
    every: int  # steps between saves; 0: only the final one (and a preemption's)
    keep_last: int
    token: str  # the same on every rank of one launch, new for each (checkpoint.staging_dir)
    config: str  # the resolved config, as YAML
    max_failed_saves: int = 3  # failed saves in a row before the run stops (ckpt.*)


def resume_point(cfg: CheckpointConfig, root: Path, rt: Runtime) -> tuple[Loaded | None, str]:
    """Where this launch starts, the same on every rank, and its checkpoint token.

    Rank 0 resolves ckpt.resume (after a torchrun restart, the newest valid checkpoint in the run
    directory comes first) and makes the token, new for every launch and restart; every rank
    then loads its part of that one checkpoint. One that a rank cannot load (torch.load with
    weights_only refuses it) is, when chosen as the run directory's newest, skipped like one
    that fails its checksums: every rank goes on to the next older valid one. A collective: an
    error stops every rank."""
    decision = None
    if rt.is_primary:
        token = f"{os.getpid()}-{secrets.token_hex(4)}"  # secrets: leaves the seeded RNGs alone
        restarted = rt.restart_count > 0
        try:
            path = resolve_resume(cfg.resume, root, restarted=restarted)
            newest = path is not None and (cfg.resume == "auto" or restarted)
            fallback = newest and path.parent.resolve() == Path(root).resolve()
            decision = (token, str(path) if path else None, fallback, None)
        except CheckpointError as err:
            decision = (token, None, False, (str(err.file), err.check))
    with waiting(rt.rank, "agreeing on the checkpoint to resume from"):
        token, path, fallback, error = broadcast_object(decision, rt)
    if error is not None:
        raise CheckpointError(*error)
    while path is not None:
        loaded, error = None, None
        try:
            loaded = load(Path(path), rank=rt.rank, map_location=rt.device)
        except CheckpointError as err:
            error = err
        with waiting(rt.rank, f"agreeing that every rank loaded {path}"):
            loaded_everywhere = all_ok(error is None, rt)
            # Every rank takes the same branch: the first answer was agreed.
            invalid = loaded_everywhere or all_ok(error is None or not error.read_error, rt)
        if loaded_everywhere:
            return loaded, token
        if not fallback or not invalid:
            # A read error (I/O, out of memory) says nothing of the file: falling back would
            # silently redo the steps since the older checkpoint.
            why = "unreadable on another rank (its log says why); not falling back to an older one"
            raise error or CheckpointError(path, why)
        why = error or f"{path}: unreadable on another rank (its log says why)"
        log.warning("resuming: skipping invalid checkpoint: %s", why)
        if rt.is_primary:
            # Its manifest checks, so neither prune nor a save at its step would take it for a
            # valid one and delete it: kept as evidence, out of resume's and prune's sight.
            keep_as_evidence(Path(path), token)
        older, error = None, None
        if rt.is_primary:
            try:
                older = _newest_valid(Path(root), below=step_number(Path(path)))
            except CheckpointError as err:  # none older: every rank stops, not rank 0 alone
                error = (str(err.file), err.check)
        with waiting(rt.rank, "agreeing on an older checkpoint to resume from"):
            path, error = broadcast_object((str(older) if older else None, error), rt)
        if error is not None:
            raise CheckpointError(*error)
    return None, token


def resolve_resume(setting: str, root: Path, *, restarted: bool = False) -> Path | None:
    """`ckpt.resume`: "auto" -> the newest valid checkpoint under root, if any, warning about
    each newer invalid one; "never" -> None; else a path that must verify (CheckpointError if
    not). After a torchrun restart (`restarted`) the newest valid one under root comes first,
    whatever the setting: the attempt before this one wrote it.

    "never" and a path refuse a root that holds a valid checkpoint newer than where they start
    (another run's): pruning would delete this run's checkpoints first, and a restart would
    resume from the other run's.
    """
    if setting == "auto":
        return _newest_valid(Path(root))
    if restarted:
        try:
            path = _newest_valid(Path(root))
        except CheckpointError:  # none valid: the setting (never, or a path) decides
            path = None
        if path is not None:
            return path
    start = None if setting == "never" else _checkpoint_in(Path(setting))
    step = 0 if start is None else verify(start)["step"]
    for other_step, other in step_dirs(root):
        if other_step <= step or (start is not None and other.resolve() == start.resolve()):
            continue
        try:
            verify(other)
        except CheckpointError:
            continue  # not a checkpoint: resume skips it; a save at its step moves it aside
        what = "a fresh start (ckpt.resume=never)" if start is None else f"resuming from {start}"
        raise CheckpointError(
            other,
            f"a valid checkpoint newer than {what}; this run's checkpoints would mix with it. "
            f"Use another run directory (hydra.run.dir=..., RUN_ID=...), move {root} away, or "
            "continue that run with ckpt.resume=auto",
        )
    return start


def _checkpoint_in(path: Path) -> Path:
    """ckpt.resume=PATH: a checkpoint directory itself; a run directory (or its checkpoints/),
    its newest valid checkpoint, as mgpu.evaluate, sample and export read one."""
    if path.name.startswith("step-") or (path / MANIFEST).exists():
        return path  # verify says which check it fails, if any
    root = path if path.name == "checkpoints" else checkpoint_root(path)
    newest = _newest_valid(root)
    if newest is None:
        why = "no valid checkpoint to resume from (ckpt.resume names this run's checkpoints)"
        raise CheckpointError(root, f"{why}; name another run, or use ckpt.resume=never")
    return newest


def _newest_valid(root: Path, below: int | None = None) -> Path | None:
    """The newest valid checkpoint under root (older than step `below`, when given: the newer
    one could not be loaded), warning about each newer invalid one."""
    path, problems = find_latest_valid(root, below=below)
    for problem in problems:
        log.warning("resuming: skipping invalid checkpoint: %s", problem)
    skipped = problems or below is not None
    if path is None and skipped:
        # A fresh start here would train over a damaged run from step 0 and exit 0: only
        # when asked. (Said by rank 0 in one line; the checkpoints stay for inspection.)
        first = problems[0] if problems else "none of them could be loaded on every rank"
        raise CheckpointError(
            root,
            f"holds checkpoints but none is valid (the newest: {first}); restore them, or "
            "start this run again from step 0 with ckpt.resume=never",
        )
    if path is None:
        log.info("ckpt.resume=auto: no valid checkpoint under %s", root)
    elif skipped:
        log.warning("ckpt.resume=auto: resuming from an OLDER checkpoint, %s", path)
    return path


def free_space(path: Path) -> str:
    """The space free on `path`'s filesystem (its nearest existing directory), for a message."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError as err:
        return f"unknown space ({err.strerror})"
    return f"{free / 2**20:,.1f} MiB"


# The settings a resumed run takes from its own config over the checkpoint's (mgpu.optim.optimizer's
# keep_hyperparameters), by optimizer: those it reads, and those of the schedule.
_SETTINGS = {
    "adamw": ("lr", "weight_decay", "betas", "eps"),
    "sgd": ("lr", "weight_decay", "momentum"),
}
_SCHEDULE = ("warmup_steps", "min_lr_ratio")


def check_settings(
    loaded: Loaded,
    optim: OptimConfig,
    max_steps: int,
    *,
    say: bool,
    residual: str | None = None,
    config_text: str = "",
) -> None:
    """A resumed run's optimizer and schedule settings against the config its checkpoint saved:
    another optimizer type is refused (its moments mean nothing to this one); each other
    setting that changed is logged once (`say`: rank 0), old -> new, and takes the new value.
    `residual`: GPT's model.residual (None for other models). The weights are the same either
    way, but the arithmetic is not, so a change of it is logged too (configs saved before the
    key existed trained with fp32). `config_text`: this run's config, whose data settings
    (data.batch_size, ...) are logged where they changed too; token ids of another tokenizer or
    vocabulary are refused (mgpu.data.tokenizer.other_tokens). A trainer.max_steps below the
    checkpoint's step is refused:
    the run would end at once, "done", with no checkpoint of the step it asked for."""
    if max_steps < loaded.step:
        raise CheckpointMismatch(
            f"trainer.max_steps={max_steps}: {loaded.path} is at step {loaded.step}, past it. "
            f"Set trainer.max_steps above {loaded.step} to train on, use the checkpoint as it is "
            "(python -m mgpu.evaluate or mgpu.export on the run directory), or start afresh in "
            "another run directory (hydra.run.dir=...)"
        )
    text = loaded.shared.get("config")
    if not text:
        return  # a state without its config (Trainer.state_dict): nothing to compare with
    saved = OmegaConf.to_container(OmegaConf.create(text))
    old = saved.get("optim", {})
    name = optim.name.value
    if old.get("name", name) != name:
        raise CheckpointMismatch(
            f"optim.name={name}: {loaded.path} was trained with optim.name={old['name']}, whose "
            f"state {name} cannot continue from. Resume with optim.name={old['name']}, or start "
            "this run in another run directory (hydra.run.dir=...)"
        )
    data = OmegaConf.to_container(OmegaConf.create(config_text)).get("data", {})
    # Refused here, before the run's config.yaml and tokenizer.json are written (build_run)
    if other := other_tokens(saved.get("data", {}), data, loaded.path, loaded.path.parent.parent):
        raise CheckpointMismatch(other)
    changes = [
        (f"optim.{key}", old[key], getattr(optim, key))
        for key in (*_SETTINGS[name], *_SCHEDULE)
        if key in old and old[key] != getattr(optim, key)
    ]
    old_max = saved.get("trainer", {}).get("max_steps", max_steps)
    if old_max != max_steps:
        changes.append(("trainer.max_steps", old_max, max_steps))
    old_residual = saved.get("model", {}).get("residual", "fp32")
    if residual is not None and old_residual != residual:
        changes.append(("model.residual", old_residual, residual))
    changes += [
        (f"data.{key}", was, data[key])
        for key, was in saved.get("data", {}).items()
        if key in data and data[key] != was
    ]
    if say and changes:
        log.info(
            "resuming with settings changed from %s: %s",
            loaded.path,
            ", ".join(f"{key} {was} -> {now}" for key, was, now in changes),
        )


def check_resumable(sampler: object, batch_size: int | None = None) -> None:
    if not (isinstance(sampler, ShardedSampler) and sampler.even):
        raise TypeError(
            f"checkpoints record the data position of a training ShardedSampler; this "
            f"loader's sampler is a {type(sampler).__name__}"
        )
    # The cursor counts whole batches of the loader's size, as the stream cuts its epochs.
    if sampler.stream_batch not in (0, batch_size):
        raise ValueError(
            f"the sampler streams batches of {sampler.stream_batch} but the loader makes "
            f"batches of {batch_size}: checkpoints would record the wrong data position"
        )


Generators = dict[str, torch.Generator]


class Checkpointer:
    """fit's checkpoints, on every rank: `due(step, now)`; `save(step, state, generators)`, all
    ranks together; and, first thing in fit, `restore_rng(generators)`: a resumed run's RNG
    states (`loaded`: this rank's part of the checkpoint it resumes from, if any). `generators`
    are the RNGs a checkpoint carries besides the global ones (the DataLoader's)."""

    def __init__(self, plan: CheckpointPlan, rt: Runtime, *, seed: int, loaded: Loaded | None):
        self.plan, self.rt = plan, rt
        self._failed_in_row = 0  # the same on every rank: each save's outcome is agreed
        self._rng_state: dict | None = None  # a checkpoint's RNG states, restored by fit
        self._reseed: int | None = None  # or, resuming on another world size, a fresh seed
        if loaded is None:
            return
        if loaded.world_size == rt.world_size:
            self._rng_state = loaded.rank_state["rng"]
            return
        say = log.warning if rt.is_primary else log.info  # the same on every rank: said once
        say(
            "%s was saved by %d process(es), this run has %d: every training sample is still "
            "seen exactly once, but the run does not match an uninterrupted one bit for bit "
            "(other batches, fresh RNG streams seeded from trainer.seed, rank and step)",
            loaded.path, loaded.world_size, rt.world_size,
        )  # fmt: skip
        fresh = np.random.SeedSequence([seed, rt.rank, loaded.step])
        self._reseed = int(fresh.generate_state(1)[0])

    def due(self, step: int, now: bool) -> bool:
        return now or (self.plan.every > 0 and step % self.plan.every == 0)

    def save(
        self, step: int, state: Callable[[], dict], generators: Generators, *, required: bool
    ) -> Path | None:
        """Every rank together: each takes `state()` (the replicated training state: a
        collective where dist.shard_optimizer gathers the optimizer's shards) and writes its RNG
        states; barrier; rank 0 writes the state with the run's config and seals the
        checkpoint; barrier; rank 0 prunes old ones. A collective.

        A failure is logged on the rank where it happened (file and cause); a `required` save
        (final, preemption) then raises, any other lets training go on from the previous one."""
        plan, rt = self.plan, self.rt
        error: Exception | None = None
        path = None
        try:
            own = {"rng": capture_rng(rt.device, generators)}
            replicated = state()  # on every rank: a sharded optimizer's state is gathered
            write_rank_files(plan.root, step, rt.rank, own, token=plan.token)
        except Exception as err:  # noqa: BLE001 - every rank must reach the barrier below
            error = err
        if all_ok(error is None, rt):  # barrier: every rank's file is on disk
            if rt.is_primary:
                try:
                    shared = {**replicated, "config": plan.config}
                    path = finalize(plan.root, step, rt.world_size, shared, token=plan.token)
                except Exception as err:  # noqa: BLE001
                    error = err
        elif rt.is_primary:
            abort(plan.root, step, token=plan.token)
        if all_ok(error is None, rt):  # barrier: sealed (or not) before anyone goes on
            if rt.is_primary:
                prune(plan.root, plan.keep_last)
            self._failed_in_row = 0
            return path
        self._failed_in_row += 1
        if error is not None:
            log.error("checkpoint at step %d failed on rank %d: %s", step, rt.rank, error)
        else:
            log.error("checkpoint at step %d failed on another rank (its log says why)", step)
        if required:
            raise CheckpointError(step_dir(plan.root, step), "not saved (errors above)")
        kept = newest_kept(plan.root)
        if self._failed_in_row >= plan.max_failed_saves:  # every rank: the count is agreed
            on = "resume" if kept else "start again"
            where = f"hydra.run.dir=PATH{' ckpt.resume=<this run directory>' if kept else ''}"
            raise CheckpointError(
                plan.root,
                f"the last {self._failed_in_row} saves failed (ckpt.max_failed_saves="
                f"{plan.max_failed_saves}), {free_space(plan.root)} free there; newest "
                f"checkpoint: {kept or 'none'}. Fix what the errors above name (a full disk, a "
                f"path that is not a writable directory), or {on} elsewhere ({where})",
            )
        if kept is not None:
            log.warning("training goes on; %s stays the newest checkpoint", kept)
        else:
            log.warning("training goes on; no checkpoint in %s yet", plan.root)
        return None

    def restore_rng(self, generators: Generators) -> None:
        """A resumed run's RNG states (or fresh seeds on another world size); once."""
        if self._rng_state is not None:
            restore_rng(self._rng_state, self.rt.device, generators)
        elif self._reseed is not None:
            random.seed(self._reseed)
            np.random.seed(self._reseed)
            torch.manual_seed(self._reseed)
            for generator in generators.values():
                generator.manual_seed(self._reseed)
        self._rng_state = self._reseed = None
