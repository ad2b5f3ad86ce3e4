"""The per-step agreement: every step the ranks exchange one small flags tensor, through one
collective, saying whether any rank's loss or the reduced gradients are NaN/inf and whether any
rank has been asked to stop (a preemption signal, mgpu.runtime.preempt; a Ctrl-C,
mgpu.runtime.ctrl_c). A non-finite step's optimizer update is skipped on every rank; the host
learns of it a couple of steps later and stops or goes on (`trainer.nonfinite`), and learns of a
stop at the same lag, on every rank at once.

Why the verdict is agreed and not looked up locally: a rank whose own loss went NaN poisons the
averaged gradients of all ranks, but a rank can also see an infinite loss with finite gradients.
A rank that skipped alone would leave the others' parameters different from its own; a rank that
stopped alone would leave the others waiting in the next collective until dist.timeout_s.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as tdist
from torch.distributed import ReduceOp

from mgpu.config.schema import NonFinite
from mgpu.runtime.dist import RunStopped, Runtime
from mgpu.telemetry.lagged import HostCopy

log = logging.getLogger(__name__)

# Steps between the verdict's all_reduce and the host reading it. The copy to the host is done
# by then in practice, so reading it costs no stall.
LAG = 2

# Why this rank asks to stop, in the flags' last slot; the exchange keeps the largest, so that a
# Ctrl-C on any rank stops every rank without the preemption's save.
PREEMPTION, CTRL_C = 1, 2


class NonFiniteStep(RuntimeError, RunStopped):
    """Every rank raises it at the same step. Under trainer.nonfinite=stop no checkpoint was
    saved after the last good step; under skip, a checkpoint saved during the streak of skipped
    steps holds the parameters of the last good one (a skipped step changes none)."""


@dataclass
class _Verdict:
    step: int
    # per rank 1 if its loss was non-finite; then the gradients; last: the stop (PREEMPTION...)
    flags: HostCopy


def fused(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step kernel can skip its own update on a device flag."""
    return bool(optimizer.defaults.get("fused"))


class NonFiniteGuard:
    """`bad = guard.check(step, loss, grads, grad_norm, stop_asked)` after backward (gradients
    reduced, clipped or not), `guard.step(optimizer, bad)` instead of `optimizer.step()`,
    `guard.poll()` after each step, `guard.settle()` before a checkpoint and at the end. All of
    them on every rank. `guard.stop` turns from 0 to the largest reason asked (PREEMPTION,
    CTRL_C) on every rank after the same step, once any rank's `stop_asked` was in an exchange
    that has been read."""

    def __init__(
        self,
        policy: NonFinite,
        max_consecutive: int,
        rt: Runtime,
        *,
        scaler_owns_grads: bool,
        agree: bool = True,
        preemptible: bool = False,
        on_skip: Callable[[int, int], None] | None = None,
    ):
        self.policy, self.max_consecutive, self.rt = policy, max_consecutive, rt
        # Under fp16 an overflowing gradient is the loss scaler's business (it skips the step
        # and lowers the scale); only a non-finite loss counts here.
        self.scaler_owns_grads = scaler_owns_grads
        self.cuda = rt.device.type == "cuda"
        # Ranks that share parameters must agree on the verdict; ranks that train apart
        # (dist.engine=none, the scaling baseline) decide it alone. Both agree on a stop
        # (`preemptible`: a Preemption or a CtrlC takes part), so that they stop (and save)
        # together; with neither, the ranks stay free of any per-step collective.
        several = rt.distributed
        self.distributed = agree and several
        self.exchanges = several and (agree or preemptible)
        self.stop = 0  # the agreed reason to stop after this step: 0, PREEMPTION or CTRL_C
        self.pending: deque[_Verdict] = deque()
        self.skipped = 0  # steps skipped so far in this launch
        self.consecutive = 0
        self.on_skip = on_skip  # (step, skipped so far): told of each skipped step (TensorBoard)
        self._warned_sync = False

    def check(
        self,
        step: int,
        loss: torch.Tensor,
        grads: list[torch.Tensor],
        grad_norm: torch.Tensor | None,
        stop_asked: int = 0,
    ) -> torch.Tensor:
        """The agreed verdict for this step, as a device bool; no host sync (a collective).
        `stop_asked`: why this rank asks to stop (0, PREEMPTION or CTRL_C)."""
        flags = self.exchange(loss, grad_norm, stop_asked)
        self.remember(step, flags)
        return self.verdict(flags)

    def exchange(
        self, loss: torch.Tensor, grad_norm: torch.Tensor | None, stop: int | torch.Tensor
    ) -> torch.Tensor:
        """The step's flags, agreed across ranks: device work and one collective, nothing the
        host reads, so that a CUDA graph can record it (mgpu.train.update_replay). `stop`: this
        rank's reason to stop (0, PREEMPTION or CTRL_C); a device int where a graph records
        this."""
        world = self.rt.world_size if self.distributed else 1
        rank = self.rt.rank if self.distributed else 0
        flags = torch.zeros(world + 2, dtype=torch.int32, device=self.rt.device)
        flags[rank] = (~torch.isfinite(loss)).int()
        if grad_norm is not None and not self.scaler_owns_grads:
            # The reduced gradients are bit-identical on every rank, and so is this slot.
            flags[world] = (~torch.isfinite(grad_norm)).int()
        if isinstance(stop, torch.Tensor):
            flags[world + 1] = stop
        elif stop:
            flags[world + 1] = stop
            if not self.exchanges:  # no one to agree with, nothing to wait for: stop now
                self.stop = max(self.stop, stop)
        if self.exchanges:
            # The one agreement of the step: queued on the compute stream, the host does not
            # wait for it. Ranks that decide their verdict alone exchange the stop slot only
            # (a contiguous view of the same tensor).
            tdist.all_reduce(flags if self.distributed else flags[world + 1 :], op=ReduceOp.MAX)
        return flags

    def verdict(self, flags: torch.Tensor) -> torch.Tensor:
        """Whether any rank's step went non-finite, from exchange's flags (a device bool)."""
        return flags[: (self.rt.world_size if self.distributed else 1) + 1].any()

    def remember(self, step: int, flags: torch.Tensor) -> None:
        """Copy `step`'s flags to the host, behind the work queued so far, to act on them LAG
        steps later (poll): a replayed step's flags are overwritten by the next replay."""
        self.pending.append(_Verdict(step, HostCopy(flags)))

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        bad: torch.Tensor,
        grad_scale: torch.Tensor | None = None,
    ) -> None:
        """optimizer.step(), unless `bad`: an update that never happens, on every rank alike.
        `grad_scale` (fused optimizers only): a device scalar every gradient is divided by."""
        if fused(optimizer):
            # The fused kernels take a device flag and leave parameters, moments and step
            # counts untouched where it is set: the skip costs no host sync. This is the
            # attribute protocol torch's loss scaler uses to hand its flag (and its scale, which
            # the kernels divide the gradients by) to these kernels.
            optimizer.grad_scale, optimizer.found_inf = grad_scale, bad.float()
            try:
                optimizer.step()
            finally:
                del optimizer.grad_scale, optimizer.found_inf
            return
        if grad_scale is not None:
            raise ValueError("grad_scale needs a fused optimizer (it is applied by its kernel)")
        if self.cuda and not self._warned_sync:  # a user's optimizer without a fused kernel
            self._warned_sync = True
            log.warning(
                "%s has no fused kernel: each step reads the non-finite verdict on the host "
                "before the optimizer step (a sync point)",
                type(optimizer).__name__,
            )
        # Without a fused kernel: on CPU reading a value drains no queue; on CUDA it is a sync
        # point, named in the warning above.
        if not bool(bad):
            optimizer.step()

    def poll(self) -> None:
        """Act on the verdicts of steps LAG or more steps old (every rank the same ones)."""
        while len(self.pending) > LAG:
            self._read(self.pending.popleft())

    def settle(self) -> None:
        """Act on every verdict so far: before a checkpoint (nothing bad gets saved), before
        leaving the loop (no exchange left running when the process group goes) and at the end
        of training. A sync point on the last steps."""
        while self.pending:
            self._read(self.pending.popleft())

    def _read(self, verdict: _Verdict) -> None:
        *flags, stop = verdict.flags.read().tolist()  # a copy LAG steps old: long landed
        self.stop = max(self.stop, stop)
        if not any(flags):
            self.consecutive = 0
            return
        what = self._describe(flags)
        if self.policy is NonFinite.stop:
            raise NonFiniteStep(
                f"step {verdict.step}: {what} (trainer.nonfinite=stop): stopped before its "
                "optimizer update, no checkpoint saved after it. Resume from the last checkpoint "
                "with a lower optim.lr or trainer.grad_clip, or set trainer.nonfinite=skip"
            )
        self.skipped += 1
        self.consecutive += 1
        if self.on_skip is not None:
            self.on_skip(verdict.step, self.skipped)
        if self.consecutive > self.max_consecutive:
            good = verdict.step - self.consecutive  # the last step whose update was applied
            raise NonFiniteStep(
                f"step {verdict.step}: {what}, {self.consecutive} non-finite steps in a row "
                f"(trainer.max_consecutive_skips={self.max_consecutive}): stopping. Steps "
                f"{good + 1}-{verdict.step} were skipped, so a checkpoint saved since step {good} "
                f"holds the parameters of step {good}. Resume from the last checkpoint with a "
                "lower optim.lr or trainer.grad_clip"
            )
        if self.rt.is_primary or not self.distributed:  # an agreed verdict: said once
            log.warning(
                "step %d: %s: its optimizer update was skipped on every rank", verdict.step, what
            )

    def _describe(self, flags: list[int]) -> str:
        ranks = [r for r, bad in enumerate(flags[:-1]) if bad]
        if not self.distributed:
            ranks = [self.rt.rank for _ in ranks]  # one slot: this rank's own
        if ranks:
            who = "rank " + ", ".join(map(str, ranks)) if len(ranks) < 8 else f"{len(ranks)} ranks"
            return f"the loss is NaN/inf on {who}"
        return "the reduced gradients are NaN/inf (every rank's loss was finite)"
