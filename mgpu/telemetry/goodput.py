"""Goodput: where a run's wall time went (start-up, training, evaluation, checkpointing, data
stalls, restarts), summed over every attempt of the run through a small JSON file in the run
directory that rank 0 rewrites atomically. `goodput/pct` is the share of wall time spent training.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
CATEGORIES = ("startup", "training", "eval", "checkpoint", "stall", "restart")
# Work that a restart throws away when done after the last checkpoint: the next attempt resumes
# from that checkpoint and does it again (TensorBoard's purge_step drops its records, eval too).
REDONE = ("training", "eval")


GOODPUT_FILE = "goodput.json"  # in the run directory, kept by rank 0


class Goodput:
    """A clock that charges the time since the last phase change to the current category.

    Cheap enough for phase changes (a clock read and a dict add); not meant to be called per step.
    `path` is None on every rank but 0: those count in memory and write nothing. `started_at` is
    when this process began (train.py's first line), so imports and building count as start-up.
    """

    def __init__(
        self,
        path: Path | None,
        *,
        started_at: float | None = None,
        clock: Callable[[], float] = time.time,  # wall clock: attempts span processes
    ):
        self.path, self.clock = (None if path is None else Path(path)), clock
        start = clock() if started_at is None else started_at
        self._records = self._load() if path is not None else []
        self._past = dict.fromkeys(CATEGORIES, 0.0)  # earlier attempts, fixed from here on
        for i, rec in enumerate(self._records):
            for cat in CATEGORIES:
                self._past[cat] += rec["seconds"][cat]
            for cat in REDONE:
                self._past[cat] -= rec["at_risk"][cat]
                self._past["restart"] += rec["at_risk"][cat]
            # Dead time between attempts: the failed process's last moments, torchrun's restart,
            # queueing before a relaunch. An overlap (clock skew between hosts) counts as none.
            nxt = self._records[i + 1]["started_at"] if i + 1 < len(self._records) else start
            self._past["restart"] += max(0.0, nxt - rec["last_update"])
        if self._records and start < self._records[-1]["last_update"]:
            start = self._records[-1]["last_update"]  # so that the parts still add up to wall
        self.attempt = len(self._records) + 1
        self._first = self._records[0]["started_at"] if self._records else start
        self._started_at, self._last, self._current = start, start, "startup"
        self._seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._at_risk = dict.fromkeys(REDONE, 0.0)
        self._step: int | None = None
        self._write_failed = False
        self.save()  # record this attempt now: one that dies in start-up still shows

    def _tick(self) -> float:
        # Never backwards: a wall clock stepped back by NTP must not make a part negative.
        now = self.clock()
        if now > self._last:
            self._seconds[self._current] += now - self._last
            if self._current in self._at_risk:
                self._at_risk[self._current] += now - self._last
            self._last = now
        return self._last

    def enter(self, category: str) -> None:
        """From now on time counts as `category` (any of CATEGORIES but restart)."""
        if category not in self._seconds or category == "restart":
            raise ValueError(f"goodput category {category!r}: one of {CATEGORIES[:-1]}")
        self._tick()
        self._current = category

    def move_to_stall(self, seconds: float) -> None:
        """Recharge `seconds` already counted as training (data wait, learnt a log interval late)
        to stall; at most this attempt's training so far."""
        self._tick()
        moved = min(max(seconds, 0.0), self._seconds["training"])
        self._seconds["training"] -= moved
        self._seconds["stall"] += moved
        # A wait is published before the checkpoint that follows it, so it lies after the last
        # one: the training it is taken from was at risk.
        self._at_risk["training"] -= min(moved, self._at_risk["training"])

    def checkpointed(self, step: int) -> None:
        """A checkpoint at `step` is sealed: nothing done so far is lost if this attempt dies."""
        self._tick()
        self._at_risk = dict.fromkeys(REDONE, 0.0)
        self._step = step

    def totals(self) -> dict[str, float]:
        """`<category>_s` over every attempt up to now, `wall_s` (the first attempt's start to
        now, which the parts add up to) and `pct`, the share of wall time spent training."""
        now = self._tick()
        out = {f"{cat}_s": self._past[cat] + self._seconds[cat] for cat in CATEGORIES}
        wall = now - self._first
        out["wall_s"] = wall
        out["pct"] = 100.0 * out["training_s"] / wall if wall > 0 else 0.0
        return out

    def scalars(self) -> dict[str, float]:
        """totals() as TensorBoard tags: goodput/pct, goodput/<category>_s, goodput/wall_s."""
        return {f"goodput/{key}": value for key, value in self.totals().items()}

    def save(self) -> None:
        """Rank 0: rewrite the file (a few hundred bytes) atomically; a no-op on other ranks.
        A failed write is logged, never raised: telemetry must not stop training."""
        if self.path is None:
            return
        current = {
            "started_at": self._started_at,
            "last_update": self._tick(),
            "seconds": dict(self._seconds),
            "at_risk": dict(self._at_risk),
            "step": self._step,
        }
        text = json.dumps({"version": FORMAT_VERSION, "attempts": [*self._records, current]})
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the name points at it
            # Atomic: readers see the old file or the new one. No directory fsync: losing the
            # last rename to a power cut costs one log interval of accounting, not the file.
            os.replace(tmp, self.path)
            self._write_failed = False
        except OSError as err:
            tmp.unlink(missing_ok=True)
            if not self._write_failed:  # once per run of failures, not every log step
                log.warning("goodput: could not write %s (%s); training goes on", self.path, err)
            self._write_failed = True

    def _load(self) -> list[dict]:
        """Earlier attempts' records, or none (a new run, or an unreadable file moved aside)."""
        for stale in self.path.parent.glob(f".{self.path.name}.tmp-*"):
            stale.unlink(missing_ok=True)  # a write cut short by a killed attempt
        try:
            data = json.loads(self.path.read_text())
            if data["version"] != FORMAT_VERSION:
                raise ValueError(f"format version {data['version']}, expected {FORMAT_VERSION}")
            return [
                {
                    "started_at": float(r["started_at"]),
                    "last_update": float(r["last_update"]),
                    "seconds": {cat: float(r["seconds"][cat]) for cat in CATEGORIES},
                    "at_risk": {cat: float(r["at_risk"][cat]) for cat in REDONE},
                    "step": None if r["step"] is None else int(r["step"]),
                }
                for r in data["attempts"]
            ]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as err:
            why = f"goodput: {self.path} is unreadable ({type(err).__name__}: {err}); accounting "
            aside = self.path.with_name(f"{self.path.name}.corrupt")
            try:
                os.replace(self.path, aside)  # kept as evidence, out of the way of the new file
                why += f"starts afresh from this attempt, the old file is now {aside}"
            except OSError:
                why += "starts afresh from this attempt"
            log.warning("%s", why)
            return []
