"""Hangs: where each rank is (step and phase, a collective named where the phase is one), shared
through the launch's key-value store, so that a collective that times out or a loop that stops
making progress ends the job with a message that names what stalled and which rank lags.

Two clocks. Collectives are bounded by dist.timeout_s (the process group's own timeout); the
stall clock here (trainer.stall_timeout_s) catches what no collective bounds, such as a data
loader that never yields: a background thread that sees no progress for that long logs where
every rank is, dumps this process's stacks and ends it.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time

import torch.distributed as tdist

from mgpu.runtime.dist import RunStopped, Runtime, first_line, store_client

log = logging.getLogger(__name__)

# The exit code of a process the stall clock ended (sysexits.h EX_SOFTWARE).
STALLED_EXIT_CODE = 70

# Phases the training loop reports; those that wait in a collective say which one.
DATA = "data loading"
FIRST_BATCH = "agreeing that every rank read its first batch (all_reduce)"  # before the loop
STEP = "forward/backward and the gradient all_reduce"
UPDATE = "optimizer step and the step's agreement all_reduce (non-finite, preemption)"
LOG = "logging: the loss all_reduce and rank all_gather"
EVAL = "evaluation and its loss all_reduce"
SAVE = "checkpoint save and its barriers"


# A step's phases in the order the loop goes through them: ranks at the same step are ordered
# by phase, so the one still loading data lags the one waiting in the gradient all_reduce.
ORDER = (DATA, FIRST_BATCH, STEP, UPDATE, LOG, EVAL, SAVE)


def progress(record: dict) -> tuple[int, int]:
    phase = record["phase"]
    return record["step"], ORDER.index(phase) if phase in ORDER else -1


class CollectiveTimeout(RuntimeError, RunStopped):
    """A collective waited longer than dist.timeout_s; the message names it and the laggards.
    Said by the rank that waited, whichever rank it is."""

    every_rank = False


class Watchdog:
    """`start()` before training and `stop()` after it (or `with watchdog:`); `beat(step,
    phase)` at each phase change (attribute writes: free in the hot loop)."""

    def __init__(self, rt: Runtime, stall_s: float, *, publish_every_s: float = 2.0):
        self.rt, self.stall_s = rt, stall_s
        self.step, self.phase, self.at = 0, "start-up", time.monotonic()
        self.publish_every_s = min(publish_every_s, stall_s / 4) if stall_s else publish_every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: tdist.Store | None = None

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase, self.at = step, phase, time.monotonic()

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.beat(self.step, self.phase)
        self._stop.clear()
        self._store = store_client(self.rt, timeout_s=5.0)
        if self.stall_s or self._store is not None:
            self._thread = threading.Thread(target=self._watch, name="mgpu-watchdog", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _watch(self) -> None:
        while not self._stop.wait(self.publish_every_s):
            self._publish()
            idle = time.monotonic() - self.at
            if self.stall_s and idle > self.stall_s:
                self._end_stalled(idle)

    def _publish(self) -> None:
        if self._store is None:
            return
        idle = time.monotonic() - self.at
        record = {"step": self.step, "phase": self.phase, "since": time.time() - idle}
        try:
            self._store.set(self._key(self.rt.rank), json.dumps(record))
        except Exception as err:  # noqa: BLE001 - rank 0 (the store's host) may be gone
            log.debug("progress not published: %s", err)

    def _end_stalled(self, idle: float) -> None:
        log.error(
            "rank %d: no progress for %.0f s (trainer.stall_timeout_s=%g) in step %d, %s. %s. "
            "Ending this process (exit %d); its threads' stacks follow on stderr.",
            self.rt.rank,
            idle,
            self.stall_s,
            self.step,
            self.phase,
            self.where_ranks_are(),
            STALLED_EXIT_CODE,
        )
        for handler in logging.getLogger().handlers:
            handler.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        # The main thread is stuck in a call it does not return from: no exception can reach
        # it, so the process ends from here, without Python's teardown.
        os._exit(STALLED_EXIT_CODE)

    def _key(self, rank: int) -> str:
        # Per restart: a store that outlives a torchrun restart still holds the last attempt's.
        return f"mgpu/progress/{self.rt.restart_count}/{rank}"

    def where_ranks_are(self) -> str:
        """Every rank's last published step and phase, the laggards first; or why not known."""
        if self._store is None:
            return "other ranks' progress is not known (no process group)"
        records = {}
        for rank in range(self.rt.world_size):
            key = self._key(rank)
            try:
                if self._store.check([key]):
                    records[rank] = json.loads(self._store.get(key))
            except Exception as err:  # noqa: BLE001 - report what can be read
                return f"other ranks' progress is not readable ({err})"
        now = time.time()
        if not records:
            return "no rank has published its progress yet"
        ranked = sorted(records.items(), key=lambda kv: progress(kv[1]))
        lowest = progress(ranked[0][1])
        lagging = [r for r, rec in ranked if progress(rec) == lowest]
        unknown = [r for r in range(self.rt.world_size) if r not in records]
        parts = [
            f"rank {r}: step {rec['step']}, {rec['phase']} for {now - rec['since']:.0f} s"
            for r, rec in ranked
        ]
        head = f"lagging: rank {', '.join(map(str, lagging))}"
        if unknown:
            head += f"; no progress from rank {', '.join(map(str, unknown))}"
        return head + "; " + "; ".join(parts[:8])

    def timed_out(self, err: Exception) -> CollectiveTimeout:
        """The error to stop with when a collective in the current phase timed out."""
        return CollectiveTimeout(
            f"rank {self.rt.rank}: a collective timed out (dist.timeout_s) in step {self.step}, "
            f"{self.phase}. {self.where_ranks_are()}. The backend said: {first_line(err)}"
        )
