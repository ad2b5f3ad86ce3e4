"""A progress line every few seconds for the data commands' long work (prepare, prepare_images,
check_images), on a terminal only: piped or redirected output stays what it was."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

EVERY_S = 10.0  # seconds between lines: often enough to see it move, rarely enough to read


class Progress:
    """`update(done)` as the work goes; a line when EVERY_S have passed since the last one,
    with the share done and the time left at the rate so far."""

    def __init__(
        self,
        what: str,
        total: int,
        unit: str,
        stream: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.what, self.total, self.unit = what, total, unit
        self.stream = stream or sys.stdout
        self.on = self.stream.isatty()
        self.clock = clock
        self.started = self.last = clock()

    def update(self, done: int) -> None:
        if not self.on:
            return
        now = self.clock()
        if now - self.last < EVERY_S:
            return
        self.last = now
        took = now - self.started
        share = done / self.total if self.total else 1.0
        left = f", about {took * (1 - share) / share:.0f} s left" if 0 < share < 1 else ""
        self.stream.write(
            f"{self.what}: {done:,} of {self.total:,} {self.unit} ({100 * share:.0f} %), "
            f"{took:.0f} s{left}\n"
        )
        self.stream.flush()
