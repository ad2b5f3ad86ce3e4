"""Training's evaluation (periodic and final): the mean loss over every eval sample exactly once,
summed across ranks. It owns the input shapes it has run: a compiled model compiles again for
evaluation (eval mode, no gradients) and for each input shape new there (a last, smaller batch),
minutes for a large model, which the stall clock does not time and rank 0 announces."""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.utils.data import DataLoader

from mgpu.comm.engine import local_module
from mgpu.data.progress import ticking
from mgpu.models.loss import cross_entropy
from mgpu.runtime.ctrl_c import CtrlC
from mgpu.runtime.dist import Runtime, all_reduce_sum_
from mgpu.train import watchdog
from mgpu.train.feed import Feed
from mgpu.train.numerics import autocast

log = logging.getLogger(__name__)


class Evaluation:
    """Called by the Trainer at each step it evaluates; `compiles`: the model is compiled
    (trainer.compile on this device)."""

    def __init__(
        self,
        model: nn.Module,
        feed: Feed,
        rt: Runtime,
        watch: watchdog.Watchdog,
        ctrl_c: CtrlC,
        amp_dtype: torch.dtype | None,
        compiles: bool,
    ):
        # The module under DDP: eval forward must not take part in DDP's gradient bookkeeping.
        self.model = local_module(model)
        self.feed, self.rt, self.watch, self.ctrl_c = feed, rt, watch, ctrl_c
        self.amp_dtype, self.compiles = amp_dtype, compiles
        self.shapes: set[torch.Size] = set()  # the input shapes run so far

    @torch.no_grad()
    def __call__(self, loader: DataLoader) -> float:
        """The mean loss. A Ctrl-C ends this rank's batches and rides the sum: every rank stops
        after it (KeyboardInterrupt)."""
        model, watch = self.model, self.watch
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.rt.device)
        step = watch.step
        # Every rank compiles in its first evaluation, each for its own shapes (a rank's last,
        # smaller batch may be one the others never see).
        first = self.compiles and not self.shapes
        watch.beat(step, watchdog.EVAL_DATA)  # the first batch's: the workers start
        for batch in self.feed.batches(loader):
            if self.ctrl_c.asked:
                break
            inputs, targets = self.feed.prepare(batch)
            new = self.compiles and inputs.shape not in self.shapes
            self.shapes.add(inputs.shape)
            watch.beat(step, watchdog.EVAL_COMPILE if new else watchdog.EVAL)
            with self._compiling(inputs.shape) if new else nullcontext():
                with autocast(self.rt.device, self.amp_dtype):
                    logits = model(inputs)
            sums[0] += cross_entropy(logits, targets, reduction="sum").double()
            sums[1] += targets.numel()
            watch.beat(step, watchdog.EVAL_DATA)  # the next batch's loading and moving
        model.train()
        # The sum waits for every rank: in a first evaluation, for ranks that may still compile.
        watch.beat(step, watchdog.EVAL_FIRST_SUM if first else watchdog.EVAL)
        sums[2] = float(self.ctrl_c.asked)
        all_reduce_sum_(sums, self.rt)
        total, count, asked = sums.tolist()  # sync point: evaluation only, not the training loop
        watch.beat(step, watchdog.EVAL)  # every rank is here: what follows is timed again
        if asked:
            self.ctrl_c.stop_now()
        return total / count

    def _compiling(self, shape: torch.Size) -> AbstractContextManager:
        """Rank 0 says a compile starts (a pause of minutes for a large model, after which the
        run goes on), and on a terminal that it still runs, every few seconds."""
        if not self.rt.is_primary:
            return nullcontext()
        log.info(
            "trainer.compile: evaluation compiles the model for input shape %s (eval mode, no "
            "gradients), once a shape; the stall clock waits for it", tuple(shape),
        )  # fmt: skip
        return ticking("trainer.compile: compiling for evaluation")
