"""The training loop: one optimizer step over `grad_accum_steps` micro-batches under the chosen
precision (forward and loss eager or replayed as CUDA graphs: mgpu.train.graphs; the update with
its clipping and loss scaling: mgpu.train.update; batches: mgpu.train.feed), when to evaluate
(mgpu.train.evaluation), when to record metrics, when all ranks save a checkpoint together
(mgpu.ckpt.resume), stopping on preemption or at a Ctrl-C; the state a checkpoint holds
(state_dict).

Hot-loop rule: nothing here reads a GPU value on the host during training steps. The loss stays
on the device and is handed to the Recorder, which reads it a log interval later with the step's
timing marks and the data wait; the step's agreement (mgpu.train.guard: the non-finite verdict
and the reason to stop, one collective) is read two steps late. Saving reads everything back.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from mgpu.ckpt.resume import Checkpointer, check_resumable
from mgpu.ckpt.state import restore_training_state, training_state
from mgpu.comm.engine import MgpuDataParallel, sync_gradients, unwrap
from mgpu.comm.sharded_optim import ShardedOptimizer
from mgpu.config.schema import CUDA_GRAPH_MODES, Precision, TrainerConfig
from mgpu.data.prefetch import DeviceLoader
from mgpu.data.progress import ticking
from mgpu.data.sampler import DataCursor, advance, epochs
from mgpu.models import compile_plan
from mgpu.runtime.ctrl_c import CtrlC
from mgpu.runtime.dist import Runtime, is_timeout
from mgpu.runtime.preempt import Preempted, Preemption
from mgpu.telemetry.goodput import Goodput
from mgpu.telemetry.metrics import Recorder
from mgpu.telemetry.profiling import BACKWARD, DATA, FORWARD, OPTIMIZER, StepProfiler, phase
from mgpu.telemetry.timing import StepTimer
from mgpu.train import watchdog
from mgpu.train.evaluation import Evaluation
from mgpu.train.feed import Feed, first_batch_everywhere
from mgpu.train.fp8 import check_fp8
from mgpu.train.graphs import GraphedLoss, reduction_in_graphs, use_graphs
from mgpu.train.guard import CTRL_C, PREEMPTION, NonFiniteGuard
from mgpu.train.model_loss import ModelLoss
from mgpu.train.numerics import autocast, autocast_dtype, training_loss
from mgpu.train.update import Update, build_scaler

log = logging.getLogger(__name__)


def generators(data: DataLoader) -> dict[str, torch.Generator]:
    """The RNGs a checkpoint carries besides the global ones: the DataLoader's (worker seeds)."""
    return {"loader": data.generator} if data.generator is not None else {}


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        schedule: torch.optim.lr_scheduler.LRScheduler,
        rt: Runtime,
        *,
        recorder: Recorder | None = None,
        input_transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
        checkpointer: Checkpointer | None = None,
        preemption: Preemption | None = None,
        ctrl_c: CtrlC | None = None,
        profiler: StepProfiler | None = None,
        goodput: Goodput | None = None,
    ):
        self.cfg, self.model, self.rt = cfg, model, rt
        # The parameter objects, listed once (sharding and loads change only their data): walking
        # the module tree every step cost ResNet-50 ~0.17 ms of host time, paid in full.
        self.params = list(model.parameters())
        self.profiler, self.goodput, self.preemption = profiler, goodput, preemption
        # Ctrl-C, agreed on in the steps' exchange; one never entered: Python's own, at once
        self.ctrl_c = ctrl_c if ctrl_c is not None else CtrlC()
        self.optimizer, self.schedule, self.recorder = optimizer, schedule, recorder
        if cfg.precision is Precision.fp8:
            check_fp8(rt.device)  # train.py checked before starting; a Trainer built in Python
        self.amp_dtype = autocast_dtype(cfg.precision, rt.device)
        # The loss is compiled in the mode of the model it follows (CUDA graphs or not), decided
        # as build_parallel_model decided it for the model.
        wrapped = isinstance(model, MgpuDataParallel | DistributedDataParallel)
        ddp = isinstance(model, DistributedDataParallel)
        recordable = isinstance(model, MgpuDataParallel) and model.reducer.capturable()
        args = dict(distributed=rt.distributed, reduces=wrapped, ddp=ddp, recordable=recordable)
        plan = compile_plan(cfg, unwrap(model), rt.device, **args)
        mode = plan.mode
        if plan.whole:  # every gradient comes at backward's end: no early bucket to start
            model.use_large_buckets(whole=True)
        # A model that takes its own loss (`computes_loss`, as GPT does to fuse its head with
        # the cross-entropy) is called as model(inputs, targets); any other as loss_fn(model(x)).
        own_loss = getattr(unwrap(model), "computes_loss", False)
        loss_fn = None if own_loss else training_loss(cfg, rt.device, mode)
        self.compiles = compiled = cfg.compiles(rt.device.type)
        own_graphs = compiled and mode in CUDA_GRAPH_MODES
        reduces = reduction_in_graphs(model, rt.distributed, cfg.grad_accum_steps, own_graphs)
        checkpointed = getattr(unwrap(model), "checkpointed", 0)  # GPT's recomputed blocks
        graphs = use_graphs(cfg.cuda_graphs, rt.device, compiled, wrapped, checkpointed, reduces)
        # The step's forward and loss: eager kernels launched from Python, or replayed as CUDA
        # graphs (mgpu.train.graphs), with mgpu's gradient reduction inside where it can be.
        self.forward_loss = (
            GraphedLoss(model, loss_fn, self.amp_dtype, cfg.cuda_graphs is True, reduces)
            if graphs
            else ModelLoss(model, loss_fn)
        )
        sharded = isinstance(optimizer, ShardedOptimizer)
        self.scaler = build_scaler(cfg, rt.device, self.amp_dtype, sharded)
        self.checkpointer = checkpointer  # None: fit saves nothing
        # Where fit starts: after step 0, at epoch 0's start, unless load_state_dict says
        # otherwise; `step` is the last step done.
        self.start_step, self.start_cursor, self.step = 0, None, 0
        channels_last = rt.device.type == "cuda" and getattr(unwrap(model), "channels_last", False)
        self.feed = Feed(rt.device, channels_last, input_transform)
        # Where this rank is, for hang reports; started by fit (trainer.stall_timeout_s).
        self.watch = watchdog.Watchdog(rt, cfg.stall_timeout_s)
        args = (self.ctrl_c, self.amp_dtype, compiled)
        self.evaluation = Evaluation(model, self.feed, rt, self.watch, *args)
        self.guard = NonFiniteGuard(
            cfg.nonfinite,
            cfg.max_consecutive_skips,
            rt,
            scaler_owns_grads=self.scaler.is_enabled(),
            # Wrapped for data parallelism: the ranks share their parameters and must agree.
            agree=wrapped,
            preemptible=preemption is not None or self.ctrl_c.active,
            on_skip=recorder.skipped if recorder is not None else None,
        )
        # The step's end: clipping, the agreement, the optimizer (replayed too where the backward
        # replays its reductions: trainer.replay_update) and the schedule.
        flat = model.grad_tensors if isinstance(model, MgpuDataParallel) else None
        replayed = self.forward_loss.replaying if graphs and reduces else None
        args = (self.scaler, self.guard, self._stop_asked, flat, replayed)
        self.update = Update(cfg, self.params, optimizer, schedule, *args)
        # Where train_step marks the parts of each step for the Recorder's breakdown.
        self.timer = recorder.timer if recorder is not None else StepTimer(None)

    def train_step(self, batches: Iterator, step: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `grad_accum_steps` micro-batches; returns the mean loss and
        whether the step was skipped as non-finite, both device tensors (reading them on the
        host would stall the GPU queue).

        `batches` yields (inputs, targets) ready for the model, as a DeviceLoader gives them
        (on the device, input transform applied); host batches are moved, not transformed."""
        accum = self.cfg.grad_accum_steps
        # The step's marks for the Recorder's breakdown (metrics.breakdown): CUDA events on
        # the compute stream, read a log interval later; host time on CPU.
        timer, watch = self.timer, self.watch
        total = torch.zeros((), device=self.rt.device)
        for micro in range(accum):
            watch.beat(step, watchdog.DATA)
            timer.data_asked()
            with phase(DATA):
                inputs, targets = self.feed.prepare(next(batches))
            timer.data_ready()
            watch.beat(step, watchdog.STEP)
            # Gradients are averaged across ranks on the last micro-step only; the earlier
            # ones accumulate locally (forward and backward both inside the no-sync region).
            with sync_gradients(self.model, enabled=micro == accum - 1):
                with phase(FORWARD), autocast(self.rt.device, self.amp_dtype):
                    loss = self.forward_loss(inputs, targets)
                with phase(BACKWARD):
                    self.scaler.scale(loss / accum).backward()
            timer.backward_done()
            total += loss.detach()
        watch.beat(step, watchdog.UPDATE)
        with phase(OPTIMIZER):
            loss, bad = self.update(total / accum, step)
        timer.step_done()
        self.guard.poll()  # verdicts LAG steps old: raises under trainer.nonfinite=stop
        return loss, bad

    def loss_scale(self) -> torch.Tensor | None:
        """fp16's loss scale on the device (no host sync; the scaler's API), else None."""
        if not self.scaler.is_enabled():
            return None
        return self.scaler.scale(torch.ones((), device=self.rt.device))

    def _stop_asked(self) -> int:  # this rank's reason to stop, for the step's agreement
        asked = self.preemption is not None and self.preemption.asked
        return CTRL_C if self.ctrl_c.asked else PREEMPTION if asked else 0

    def evaluate(self, loader: DataLoader) -> float:
        """The mean loss over every eval sample exactly once, summed across ranks
        (mgpu.train.evaluation)."""
        return self.evaluation(loader)

    def fit(self, train_loader: DeviceLoader | DataLoader, eval_loader: Iterable | None) -> None:
        """Train from start_step to trainer.max_steps. Each step reads: data -> step (its
        agreement inside, read LAG steps later) -> log -> maybe save and evaluate; all ranks
        stop together after the step their agreement names on preemption."""
        cfg, rec = self.cfg, self.recorder
        if rec is None:
            raise ValueError("Trainer.fit records its steps: build the Trainer with a recorder")
        if self.start_step >= cfg.max_steps:
            # Loud: the same command in a run directory already trained (a second experiment in
            # one SLURM job's directory) would otherwise seem to have trained.
            say = log.warning if self.rt.is_primary else log.info
            say(
                "resumed at step %d, trainer.max_steps=%d: nothing left to train in this run "
                "directory. To train further, raise trainer.max_steps; for another run, give it "
                "a directory of its own (RUN_ID=NAME, hydra.run.dir=PATH) or ckpt.resume=never",
                self.step, cfg.max_steps,
            )  # fmt: skip
            return
        train, owned = self.feed.prefetcher(train_loader)
        batches = self._begin(train)
        try:
            self.watch.start()  # the stall clock and progress reports, until the end
            first = self.start_step + 1  # where a compiled model compiles: the clock waits
            self.watch.compiles_in(first if self.compiles else 0)
            self.ctrl_c.defer(True)  # a Ctrl-C rides the steps' agreement, until the end
            batches = first_batch_everywhere(batches, self.rt, self.watch, first)
            for step in range(first, cfg.max_steps + 1):
                lr = self.schedule.get_last_lr()[0]  # the rate this step trains with
                loss, bad = self._step(batches, step)  # data, forward/backward, agree, update
                rec.step(loss, bad)  # on the device: read a log interval later
                # Agreed in the step's exchange: on every rank after the same step. A Ctrl-C
                # stops without the preemption's save.
                stopping, last = self.guard.stop != 0, step == cfg.max_steps
                if self.guard.stop == CTRL_C and not last:
                    self.guard.settle()  # no exchange left running when the group goes
                    self.ctrl_c.stop_now()  # KeyboardInterrupt
                save, evaluate = self._due(step, last, stopping, eval_loader is not None)
                # Saves close a log interval too, so a resumed run logs the same intervals as
                # an uninterrupted one.
                if step % cfg.log_every == 0 or last or evaluate or save:
                    self.watch.beat(step, watchdog.LOG)
                    # The loader's GPU events in the wait are read at publish, not now.
                    rec.close_interval(step, lr, train.wait.take(), self.loss_scale())
                if evaluate or save:
                    required = last or stopping  # a save that must not fail quietly
                    self._save_and_evaluate(step, eval_loader if evaluate else None, save, required)
                if stopping and not last:
                    self.guard.settle()  # no exchange left running when the group goes
                    stop = self.preemption
                    raise stop.stopped_after(step) if stop is not None else Preempted(step, None)
            self.guard.settle()
            rec.publish_pending()
            rec.finish(cfg.max_steps)
        except Exception as err:
            if is_timeout(err):
                raise self.watch.timed_out(err) from err
            raise
        finally:
            self.ctrl_c.defer(False)
            self.watch.stop()
            if self.profiler is not None:
                self.profiler.close()
            batches.close()  # ends the running epoch: in-flight batches retired, threads joined
            if owned:
                train.close()

    def _step(self, batches: Iterator[Any], step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.profiler is not None:
            self.profiler.begin_step(step)
        # A compiled model compiles in the first step (minutes when large): rank 0 says so.
        first = step == self.start_step + 1
        compiling = first and self.rt.is_primary and self.compiles
        with ticking("trainer.compile: compiling the first step") if compiling else nullcontext():
            loss, bad = self.train_step(batches, step)
        self.step = step
        if first:  # start-up includes the first step, where a compiled model compiles
            self._enter("training")
        return loss, bad

    def _due(self, step: int, last: bool, stopping: bool, evaluates: bool) -> tuple[bool, bool]:
        """Whether this step saves a checkpoint, and whether it evaluates."""
        cfg = self.cfg
        save = self.checkpointer is not None and self.checkpointer.due(step, last or stopping)
        periodic = cfg.eval_every > 0 and step % cfg.eval_every == 0 and not stopping
        return save, evaluates and (last or periodic)

    def _begin(self, train: DeviceLoader) -> Iterator[Any]:
        """The batches from where the run stands, with its RNG states; telemetry's clock."""
        data = train.loader  # the DataLoader: its sampler, batch size and generator
        if self.checkpointer is not None:
            check_resumable(data.sampler, data.batch_size)
        self._data = data
        self._generators = generators(data)
        train.wait.take()  # data wait counts from here
        batches = epochs(train, start=self.start_cursor)
        self.model.train()
        if self.checkpointer is not None:
            self.checkpointer.restore_rng(self._generators)  # the last thing before the first step
        self.recorder.begin()
        return batches

    def _save_and_evaluate(self, step: int, evals: Iterable | None, save: bool, required: bool):
        rec = self.recorder
        # Now, not an interval later: the record is complete up to the step that is evaluated
        # or saved (and a restart's purge_step starts right after it).
        rec.publish_pending()
        # The save before the evaluation: an evaluation that fails or hangs (its data, its
        # workers) loses nothing trained. The saved RNG states are the evaluation's too, since
        # it draws from none of them (eval mode; the eval loader's own generator is not saved).
        if save:
            # Every verdict up to this step, now: a non-finite step is never saved.
            self.guard.settle()
            self._enter("checkpoint")
            self.watch.beat(step, watchdog.SAVE)
            rec.flush()  # the record up to this step is on disk, as the checkpoint is
            saved = self.checkpointer.save(
                step, self.state_dict, self._generators, required=required
            )
            if saved is not None and self.goodput is not None:  # rank 0, the one that counts
                self.goodput.checkpointed(step)
            rec.save_goodput()
        if evals is not None:
            self._enter("eval")  # the interval published above: its GPU work is done
            rec.eval_loss(step, self.evaluate(evals))
        self._enter("training")
        rec.restart_clock()  # neither is training step time

    def _enter(self, category: str) -> None:
        if self.goodput is not None:
            self.goodput.enter(category)

    # ---- state: what a checkpoint holds (mgpu.ckpt.resume saves it, mgpu.ckpt.state restores)

    def cursor(self, step: int, data: DataLoader) -> DataCursor:
        """The position in `data` (the training DataLoader) after `step`: counted from the step
        number (pure), never from the loader, whose prefetching runs ahead of training."""
        sampler = data.sampler
        start = self.start_cursor or DataCursor(sampler.seed, 0, 0, sampler.num_samples)
        batches = (step - self.start_step) * self.cfg.grad_accum_steps
        return advance(start, batches, batch_size=data.batch_size, world_size=self.rt.world_size)

    def state_dict(self) -> dict:
        """The replicated training state after the last step fit did: model (unwrapped: its
        keys carry no wrapper prefix), optimizer, schedule, loss scaler, step and data cursor.
        Under dist.shard_optimizer a collective (the optimizer's shards are gathered): every
        rank calls it."""
        return self._state(self.step, self._data)

    def _state(self, step: int, data: DataLoader) -> dict:
        # A data set's own state (image_folder's decode share: checkpoint_state, not a user's
        # state_dict) goes in the checkpoint; build_run hands it back to the resumed run's.
        dataset_state = getattr(data.dataset, "checkpoint_state", None)
        return training_state(
            model=unwrap(self.model), optimizer=self.optimizer, schedule=self.schedule,
            scaler=self.scaler, step=step, cursor=self.cursor(step, data),
            dataset=dataset_state() if dataset_state is not None else None,
        )  # fmt: skip

    def save(self, step: int, loader: DeviceLoader | DataLoader, *, required: bool) -> Path | None:
        """Every rank together saves the state after `step`, trained from `loader` (its cursor
        and generator state, not the loader). A collective, through fit's checkpointer."""
        data = loader.loader if isinstance(loader, DeviceLoader) else loader
        return self.checkpointer.save(
            step, lambda: self._state(step, data), generators(data), required=required
        )

    def load_state_dict(self, state: dict, *, source: str = "checkpoint") -> None:
        """Continue from `state` (a checkpoint's shared state): model, optimizer, schedule and
        scaler now; fit starts after its step, at its data cursor, on any number of ranks."""
        self.start_step, self.start_cursor = restore_training_state(
            state, model=unwrap(self.model), optimizer=self.optimizer,
            schedule=self.schedule, scaler=self.scaler, source=source,
        )  # fmt: skip
        self.step = self.start_step
        # mgpu's reducer re-attaches its buckets at the first forward after gradients are None.
        self.optimizer.zero_grad(set_to_none=True)
        log.info(
            "resumed from %s: step %d, epoch %d with %d of its samples done",
            source, self.start_step, self.start_cursor.epoch, self.start_cursor.consumed,
        )  # fmt: skip
