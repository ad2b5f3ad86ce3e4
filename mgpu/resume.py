"""A training run's checkpoints: when one is due, every rank saving one together, and resuming
from one (model, optimizer, schedule, loss scaler, data position, RNG states), on the same or
another number of ranks. The files and their checks are mgpu.checkpoint's; what they hold,
mgpu.state's.

Saving is the training loop's one planned sync point: it reads everything back to the host.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from mgpu.checkpoint import (
    CheckpointError,
    Loaded,
    abort,
    finalize,
    prune,
    step_dir,
    write_rank_files,
)
from mgpu.comm import unwrap
from mgpu.config import TrainerConfig
from mgpu.dist import Runtime, all_ok
from mgpu.loader import DeviceLoader
from mgpu.sampler import DataCursor, ShardedSampler, advance
from mgpu.state import (
    CheckpointMismatch,
    capture_rng,
    restore_rng,
    restore_training_state,
    training_state,
)

log = logging.getLogger(__name__)


@dataclass
class CheckpointPlan:
    """Where and when fit saves (ckpt.*), and what every save carries besides training state."""

    root: Path  # <run dir>/checkpoints
    every: int  # steps between saves; 0: only the final one (and a preemption's)
    keep_last: int
    token: str  # the same on every rank of one launch, new for each (checkpoint.staging_dir)
    config: str  # the resolved config, as YAML


def _dataloader(loader: DeviceLoader | DataLoader) -> DataLoader:
    return loader.loader if isinstance(loader, DeviceLoader) else loader


def _generators(loader: DeviceLoader | DataLoader) -> dict[str, torch.Generator]:
    """The RNGs a checkpoint carries besides the global ones: the DataLoader's (worker seeds)."""
    generator = _dataloader(loader).generator
    return {"loader": generator} if generator is not None else {}


class RunCheckpoints:
    """The trainer's checkpoints: what a save takes from its parts, and where a resumed run
    starts (step, data cursor, RNG states)."""

    def __init__(
        self,
        plan: CheckpointPlan | None,
        cfg: TrainerConfig,
        rt: Runtime,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
    ):
        self.plan, self.cfg, self.rt = plan, cfg, rt
        self.model, self.optimizer, self.schedule, self.scaler = model, optimizer, schedule, scaler
        # Where fit starts: step 0 of epoch 0, unless resume() says otherwise.
        self.start_step, self.start_cursor = 0, None
        self._rng_state: dict | None = None  # a checkpoint's RNG states, restored by fit
        self._reseed: int | None = None  # or, resuming on another world size, a fresh seed

    def due(self, step: int, now: bool) -> bool:
        plan = self.plan
        return plan is not None and (now or (plan.every > 0 and step % plan.every == 0))

    def check_resumable(self, loader: DeviceLoader) -> None:
        if self.plan is None:
            return
        sampler = loader.sampler
        if not (isinstance(sampler, ShardedSampler) and sampler.even):
            raise TypeError(
                f"checkpoints record the data position of a training ShardedSampler; this "
                f"loader's sampler is a {type(sampler).__name__}"
            )

    def cursor(self, step: int, loader: DeviceLoader | DataLoader) -> DataCursor:
        """The data position after `step`: counted from the step number (pure), never from the
        loader, whose prefetching runs ahead of training."""
        data = _dataloader(loader)
        sampler = data.sampler
        start = self.start_cursor or DataCursor(sampler.seed, 0, 0, sampler.num_samples)
        batches = (step - self.start_step) * self.cfg.grad_accum_steps
        return advance(start, batches, batch_size=data.batch_size, world_size=self.rt.world_size)

    def save(self, step: int, loader: DeviceLoader | DataLoader, *, required: bool) -> Path | None:
        """Every rank together: each writes its RNG states; barrier; rank 0 writes the shared
        state and seals the checkpoint; barrier; rank 0 prunes old ones. A collective.

        A failure is logged on the rank where it happened (file and cause); a `required` save
        (final, preemption) then raises, any other lets training go on from the previous one."""
        plan, rt = self.plan, self.rt
        error: Exception | None = None
        path = None
        try:
            state = {"rng": capture_rng(rt.device, _generators(loader))}
            # On every rank: a sharded optimizer gathers its state (a collective).
            optimizer_state = self.optimizer.state_dict()
            write_rank_files(plan.root, step, rt.rank, state, token=plan.token)
        except Exception as err:  # noqa: BLE001 - every rank must reach the barrier below
            error = err
        if all_ok(error is None, rt):  # barrier: every rank's file is on disk
            if rt.is_primary:
                try:
                    shared = training_state(
                        model=unwrap(self.model), optimizer=optimizer_state,
                        schedule=self.schedule, scaler=self.scaler, step=step,
                        cursor=self.cursor(step, loader), config=plan.config,
                    )  # fmt: skip
                    path = finalize(plan.root, step, rt.world_size, shared, token=plan.token)
                except Exception as err:  # noqa: BLE001
                    error = err
        elif rt.is_primary:
            abort(plan.root, step, token=plan.token)
        if all_ok(error is None, rt):  # barrier: sealed (or not) before anyone goes on
            if rt.is_primary:
                prune(plan.root, plan.keep_last)
            return path
        if error is not None:
            log.error("checkpoint at step %d failed on rank %d: %s", step, rt.rank, error)
        else:
            log.error("checkpoint at step %d failed on another rank (its log says why)", step)
        if required:
            raise CheckpointError(step_dir(plan.root, step), "not saved (errors above)")
        log.warning("training goes on; the previous checkpoint stays the newest")
        return None

    def resume(self, loaded: Loaded, loader: DeviceLoader | DataLoader) -> None:
        """Continue from a checkpoint (checkpoint.load's result for this rank): model,
        optimizer, schedule and scaler now; RNG states at the start of fit; the data from the
        checkpoint's cursor, on any number of ranks."""
        sampler = _dataloader(loader).sampler
        cursor = DataCursor.from_dict(loaded.shared["data"])
        if (cursor.num_samples, cursor.seed) != (sampler.num_samples, sampler.seed):
            raise CheckpointMismatch(
                f"{loaded.path} trained on {cursor.num_samples} samples shuffled with "
                f"trainer.seed={cursor.seed}; this run has {sampler.num_samples} with "
                f"trainer.seed={sampler.seed}. Resuming needs the same training set and seed"
            )
        self.start_step, self.start_cursor = restore_training_state(
            loaded.shared, model=unwrap(self.model), optimizer=self.optimizer,
            schedule=self.schedule, scaler=self.scaler, source=str(loaded.path),
        )  # fmt: skip
        # mgpu's reducer re-attaches its buckets at the first forward after gradients are None.
        self.optimizer.zero_grad(set_to_none=True)
        if loaded.world_size == self.rt.world_size:
            self._rng_state = loaded.rank_state["rng"]
        else:
            log.warning(
                "%s was saved by %d process(es), this run has %d: every training sample is still "
                "seen exactly once, but the run does not match an uninterrupted one bit for bit "
                "(other batches, fresh RNG streams seeded from trainer.seed, rank and step)",
                loaded.path, loaded.world_size, self.rt.world_size,
            )  # fmt: skip
            seed = np.random.SeedSequence([self.cfg.seed, self.rt.rank, self.start_step])
            self._reseed = int(seed.generate_state(1)[0])
        log.info(
            "resumed from %s: step %d, epoch %d with %d of its samples done",
            loaded.path, self.start_step, self.start_cursor.epoch, self.start_cursor.consumed,
        )  # fmt: skip

    def restore_rng(self, loader: DeviceLoader | DataLoader) -> None:
        if self._rng_state is not None:
            restore_rng(self._rng_state, self.rt.device, _generators(loader))
        elif self._reseed is not None:
            random.seed(self._reseed)
            np.random.seed(self._reseed)
            torch.manual_seed(self._reseed)
            for generator in _generators(loader).values():
                generator.manual_seed(self._reseed)
        self._rng_state = self._reseed = None
