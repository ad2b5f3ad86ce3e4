"""Preemption: SIGTERM and SIGUSR1 only set a flag. The flag rides the step's one agreement
(mgpu.train.guard: the same small collective as the non-finite verdict), so that all ranks learn of
any rank's signal after the same step, save one checkpoint together and exit with
PREEMPTED_EXIT_CODE ("preempted, resumable").

The agreement costs no per-step host stall: its result is read LAG steps after it was issued,
when the GPU finished it long ago. A signal that arrives before step s's update is in step s's
exchange and is acted on after step s+LAG, on every rank at once.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from mgpu.runtime.dist import RunStopped, Runtime

log = logging.getLogger(__name__)

# sysexits.h EX_TEMPFAIL: a temporary failure, try again. A preempted run saved a checkpoint and
# resumes from it when started again with the same command (ckpt.resume=auto).
PREEMPTED_EXIT_CODE = 75
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
RESUME = "run the same command to resume"


class Preempted(RunStopped):
    """Raised out of the training loop after every rank saved at the step they agreed on."""

    exit_code = PREEMPTED_EXIT_CODE
    level = logging.WARNING

    def __init__(self, step: int, signum: int | None, advice: str = RESUME):
        name = signal.Signals(signum).name if signum else "another rank's signal"
        super().__init__(f"preempted ({name}) after step {step}")
        self.step, self.advice = step, advice

    def report(self) -> str:
        """`advice`: mgpu.runtime.run_name.resume_advice's, what resumes this run."""
        return f"{self}: checkpoint saved; exit code {PREEMPTED_EXIT_CODE}, {self.advice}"


class Preemption:
    """Install the handlers with `with Preemption(rt) as p:` (previous handlers come back on
    exit); `p.asked` says whether this process has had a signal. The trainer hands it to the
    step's agreement.

    A handler can only run on the main thread, between Python bytecodes: a rank stuck inside a
    collective or a long C call acts on the signal only once that returns (dist.timeout_s bounds
    a hung collective); until then torchrun's shutdown timeout (30 s) is what ends it.
    """

    def __init__(
        self, rt: Runtime, signals: tuple[signal.Signals, ...] = SIGNALS, advice: str = RESUME
    ):
        self.rt, self.signals, self.advice = rt, signals, advice  # advice: Preempted's
        self.signum: int | None = None  # the first signal this process received
        self._previous: dict[signal.Signals, object] = {}

    def stopped_after(self, step: int) -> Preempted:
        """The stop, once every rank saved `step`: this process's signal and what resumes."""
        return Preempted(step, self.signum, self.advice)

    @property
    def asked(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only a flag: saving here would run in the middle of whatever the main thread was doing,
        # possibly a collective, and other ranks would not know.
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        else:
            log.warning("not on the main thread: SIGTERM/SIGUSR1 keep their default action")
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


def leave_preemption_to_the_trainer(worker_id: int) -> None:
    """DataLoader workers ignore SIGTERM and SIGUSR1.

    torchrun and SLURM signal every process of a worker, its DataLoader workers included; a
    DataLoader worker killed by the signal makes the next batch raise in the trainer before the
    preemption checkpoint is written. The trainer handles the signal (mgpu/runtime/preempt.py) and
    then shuts its workers down itself; a worker whose trainer is gone exits on its own.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
