"""What rank 0 writes to TensorBoard: event files in the run directory, the Custom Scalars
layout of the charts that answer "how fast, and where did the time go", and the run's config in
the HParams tab. The values themselves come from mgpu.telemetry.metrics.Recorder."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mgpu.runtime.dist import RunStopped
from mgpu.telemetry.goodput import CATEGORIES, GOODPUT_FILE
from mgpu.telemetry.timing import PARTS

log = logging.getLogger(__name__)


def _lines(*tags: str) -> list:
    return ["Multiline", list(tags)]


# TensorBoard's Custom Scalars tab: the few charts that answer "how fast, and where did the
# time go", each a group of the tags metrics.Recorder.publish writes.
LAYOUT = {
    "mgpu": {
        "throughput": _lines("throughput/tokens_per_sec", "throughput/samples_per_sec"),
        "MFU %": _lines("throughput/mfu_pct"),
        "step breakdown, ms": _lines("time/step_ms", *(f"time/{p}_ms" for p in PARTS)),
        "step breakdown, %": _lines(*(f"time/{p}_pct" for p in PARTS)),
        "memory, GiB": _lines("memory/max_allocated_gib", "memory/max_reserved_gib"),
        "ranks: step ms": _lines(*(f"ranks/step_ms_{s}" for s in ("min", "median", "max"))),
        "ranks: data wait ms": _lines(
            *(f"ranks/data_wait_ms_{s}" for s in ("min", "median", "max"))
        ),
        "ranks: compute ms": _lines(*(f"ranks/compute_ms_{s}" for s in ("min", "median", "max"))),
        "ranks: slowest": _lines(
            *(f"ranks/{f}_slowest_rank" for f in ("step_ms", "data_wait_ms", "compute_ms"))
        ),
        "goodput": _lines("goodput/pct"),
        "goodput, s": _lines(*(f"goodput/{c}_s" for c in CATEGORIES), "goodput/wall_s"),
    }
}


def set_aside_earlier_run(run_dir: Path) -> Path | None:
    """Before a run that does not continue this directory's own checkpoints writes a point: the
    TensorBoard event files an earlier run left in `run_dir` move into `earlier-<UTC time>/`
    inside it, which TensorBoard shows as a run of its own, so that no step shows the values of
    two runs in one series; its goodput.json goes with them, so that this run's goodput does
    not count the earlier one's attempts (and the idle time since) as its own restarts.
    Returns that folder, or None where there was nothing to move."""
    run_dir = Path(run_dir)
    old = sorted(run_dir.glob("events.out.tfevents.*"))
    old += [p for p in [run_dir / GOODPUT_FILE] if p.is_file()]
    if not old:
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    aside, n = run_dir / f"earlier-{stamp}", 1
    while aside.exists():
        aside, n = run_dir / f"earlier-{stamp}-{n}", n + 1
    aside.mkdir()
    for path in old:
        path.rename(aside / path.name)
    return aside


def flatten(tree: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """[("optim.lr", 0.001), ...] for a nested dict."""
    out = []
    for key, value in tree.items():
        if isinstance(value, dict):
            out += flatten(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


class EventsUnwritable(RuntimeError, RunStopped):
    """Rank 0's TensorBoard event file cannot be written (a full disk, a read-only directory).
    Said by rank 0, the one rank that writes; the checkpoints saved before stay as they are."""

    every_rank = False

    def __init__(self, events: Path, err: OSError):
        where = os.fsdecode(err.filename) if err.filename else events
        why = os.strerror(err.errno) if err.errno else str(err)
        super().__init__(
            f"rank 0: cannot write TensorBoard events to {where}: {why}; free space there, or "
            "point hydra.run.dir elsewhere (checkpoints saved so far are kept)"
        )


def _quiet_writer_thread(args: threading.ExceptHookArgs) -> None:
    """TensorBoard writes events from a thread of its own. A write that fails there ends that
    thread, and the writer raises the error again on the host thread's next write or flush, where
    TensorBoard._writing turns it into one line; Python would also print it from the thread as a
    traceback of its own. Not that: any other thread's error still goes to the hook before."""
    if issubclass(args.exc_type, OSError) and type(args.thread).__module__.startswith(
        "tensorboard."
    ):
        return
    _hook_before(args)


_hook_before = threading.excepthook


def _quiet_writer_threads() -> None:
    global _hook_before
    if threading.excepthook is not _quiet_writer_thread:
        _hook_before, threading.excepthook = threading.excepthook, _quiet_writer_thread


class TensorBoard:
    """Rank 0 writes event files into the run directory; every other rank writes nothing.

    `purge_step`: a resumed run's first step. TensorBoard then drops what earlier event files in
    the directory hold from that step on (steps an interrupted attempt logged after its last
    checkpoint), so each step shows once, with the value of the run that continued.

    Every write that fails (an OSError, from the writer's thread or this one) stops the run
    with one line, EventsUnwritable; after it, nothing more is written.
    """

    def __init__(self, run_dir: Path, enabled: bool, purge_step: int | None = None):
        # The file this writer writes, for its error (which names none): known once created
        self.events, self.writer = Path(run_dir) / "events.out.tfevents.*", None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_writer_threads()
            before = set(Path(run_dir).glob("events.out.tfevents.*"))
            with self._writing():  # the first event is written and flushed here
                self.writer = SummaryWriter(log_dir=str(run_dir), purge_step=purge_step)
            new = set(Path(run_dir).glob("events.out.tfevents.*")) - before
            if len(new) == 1:
                self.events = new.pop()

    @contextmanager
    def _writing(self) -> Iterator[None]:
        # The writer's thread writes and flushes the file; its error reaches this thread on the
        # next add (raised before or after queueing the event) or flush (after the queue drains).
        try:
            yield
        except OSError as err:
            self.writer = None  # its thread has ended: what it holds can no longer be written
            raise EventsUnwritable(self.events, err) from err

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """All of a step's values in one event (one record per value would cost tens of
        microseconds each, on the host thread that feeds the GPU)."""
        if self.writer is not None and values:
            from tensorboard.compat.proto.summary_pb2 import Summary

            record = Summary(
                value=[Summary.Value(tag=t, simple_value=float(v)) for t, v in values.items()]
            )
            with self._writing():
                self.writer.file_writer.add_summary(record, step)

    def describe_run(self, config: dict[str, Any], summary: str) -> None:
        """Once per launch: the charts' layout, the run's config in the HParams tab (next to
        the metrics it is compared by) and a text summary."""
        if self.writer is None:
            return
        from torch.utils.tensorboard.summary import hparams

        flat = {k: v if isinstance(v, int | float | bool) else str(v) for k, v in flatten(config)}
        metrics = dict.fromkeys(("train/loss", "eval/loss", "throughput/mfu_pct", "goodput/pct"), 0)
        with self._writing():
            self.writer.add_custom_scalars(LAYOUT)
            for record in hparams(flat, metrics):  # experiment, session start, session end
                self.writer.file_writer.add_summary(record)
            self.writer.add_text("run/summary", summary)

    def text(self, tag: str, body: str) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.add_text(tag, body)

    def flush(self) -> None:
        if self.writer is not None:
            with self._writing():
                self.writer.flush()

    def close(self, failing: bool = False) -> None:
        """The last events onto disk. The writer's own close() would not say that its thread
        failed on them: flush() first does. `failing`: the run already stops for another reason,
        whose line a failed write here must not replace; it is logged instead."""
        if self.writer is None:
            return
        try:
            with self._writing():
                self.writer.flush()
                self.writer.close()
        except EventsUnwritable as err:
            if not failing:
                raise
            log.warning("%s", err)
        self.writer = None
