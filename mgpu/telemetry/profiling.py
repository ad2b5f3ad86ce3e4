"""Profiling: a torch.profiler trace per rank over a window of optimizer steps
(`trainer.profile`), and the named phase ranges of each step, as NVTX ranges for Nsight Systems
and, while a trace records, as ranges in that trace.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.profiler import ProfilerAction, ProfilerActivity, profile, record_function

from mgpu.runtime.dist import Runtime

log = logging.getLogger(__name__)

DATA, FORWARD, BACKWARD = "mgpu/data", "mgpu/forward", "mgpu/backward"
REDUCE, OPTIMIZER = "mgpu/reduce", "mgpu/optimizer"

# Read by every phase() call, so kept as plain module globals: NVTX ranges whenever training
# runs on CUDA (set by StepProfiler, which the trainer always builds), trace ranges only while
# a StepProfiler records. Neither reads or waits on the GPU.
_nvtx = False
_recording = False
_NOTHING = nullcontext()


class _Phase:
    __slots__ = ("name", "pushed", "ranged")

    def __init__(self, name: str):
        self.name, self.pushed, self.ranged = name, _nvtx, None

    def __enter__(self) -> None:
        if self.pushed:
            torch.cuda.nvtx.range_push(self.name)  # host-side marker: no sync
        if _recording:
            self.ranged = record_function(self.name)
            self.ranged.__enter__()

    def __exit__(self, *exc) -> None:
        if self.ranged is not None:
            self.ranged.__exit__(None, None, None)
            self.ranged = None
        if self.pushed:
            torch.cuda.nvtx.range_pop()


def phase(name: str) -> _Phase | nullcontext:
    """`with phase(FORWARD): ...`: a named range around one phase of a step. On CPU with no
    trace recording it is a shared no-op context."""
    if not (_nvtx or _recording):
        return _NOTHING
    return _Phase(name)


class StepProfiler:
    """A trace of optimizer steps [start, start + steps - 1] into <run_dir>/profile/rank<k>/.

    Call `begin_step(step)` at the top of every training iteration, before step `step` (1-based)
    runs, and `close()` once training ends, in a `finally`. The trace covers whole iterations,
    so a window step includes the evaluation or checkpoint that the loop does after it. A run
    that resumes inside the window records the rest of it; one that ends inside the window
    writes what it recorded at close(); a window outside the run's steps writes nothing.
    """

    def __init__(
        self,
        enabled: bool,
        start: int,
        steps: int,
        run_dir: Path,
        rt: Runtime,
        *,
        with_stack: bool = False,
    ):
        global _nvtx
        _nvtx = rt.device.type == "cuda"
        self.enabled, self.start, self.end = enabled, start, start + steps - 1
        self.dir = Path(run_dir) / "profile" / f"rank{rt.rank}"
        self.rt, self.with_stack = rt, with_stack
        self.pending = enabled  # the window is still ahead (or under way)
        self.written: Path | None = None
        self._prof: profile | None = None
        self._first = self._step = 0  # the step the profiler started before; the latest step

    def begin_step(self, step: int) -> None:
        """Before optimizer step `step`: start, advance or end the trace. Disabled: a no-op."""
        self._step = step
        if self._prof is not None:
            # Ends step - 1's trace span; past the window this writes the trace.
            self._prof.step()
            if step > self.end:
                self._finish()
        elif self.pending and self.start - 1 <= step <= self.end:
            self._begin(step)

    def _begin(self, step: int) -> None:
        global _recording
        self._first = step
        activities = [ProfilerActivity.CPU]
        if self.rt.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._prof = profile(
            activities=activities,
            # One warm-up step when the run has the step before the window: tracing starts
            # there, so its set-up cost stays out of the recorded steps.
            schedule=self._action,
            on_trace_ready=self._write,
            record_shapes=False,
            with_stack=self.with_stack,
        )
        self._prof.__enter__()
        _recording = True

    def _action(self, n: int) -> ProfilerAction:
        """The profiler counts steps from 0 at the one it started before."""
        step = self._first + n
        if step < self.start:
            return ProfilerAction.WARMUP
        if step < self.end:
            return ProfilerAction.RECORD
        return ProfilerAction.RECORD_AND_SAVE if step == self.end else ProfilerAction.NONE

    def _write(self, prof: profile) -> None:
        # <worker>.<span>.pt.trace.json: the name TensorBoard's profiler plugin looks for.
        path = self.dir / f"rank{self.rt.rank}.{time.time_ns()}.pt.trace.json"
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(path))
        except Exception:  # noqa: BLE001 - a trace is not worth the training run
            log.exception("rank %d: profile trace not written to %s", self.rt.rank, path)
            return
        self.written = path
        first, last = max(self.start, self._first), min(self._step, self.end)
        log.info("rank %d: profile of steps %d-%d written to %s", self.rt.rank, first, last, path)

    def _finish(self) -> None:
        global _recording
        prof, self._prof, self.pending, _recording = self._prof, None, False, False
        # Stopping a trace that still records (a run that ended inside the window) writes it.
        # On CUDA, stopping flushes the device activity: a sync point, once per run.
        prof.__exit__(None, None, None)

    def close(self) -> None:
        """End the trace, writing what it recorded; safe to call again and on an error path."""
        if self._prof is not None:
            try:
                self._finish()
            except Exception:  # noqa: BLE001 - a failed trace must not hide why training ended
                log.exception("rank %d: profile trace not written", self.rt.rank)
        if self.enabled and self.written is None and self.rt.is_primary:
            log.warning(
                "trainer.profile: no trace of steps %d-%d (outside this run's steps, or an error "
                "above)", self.start, self.end,
            )  # fmt: skip
        self.enabled = False  # warn once
