"""A progress line every few seconds for long work: the data commands' (prepare, prepare_images,
check_images), counted as it goes, and a run's first compile, which reports nothing until it
ends (ticking). On a terminal only: piped or redirected output stays what it was."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def ticking(what: str, stream: TextIO | None = None) -> Iterator[None]:
    """A line `what: N s so far` every EVERY_S while the body runs, from a thread of its own (the
    body is one call that returns only when done, as torch.compile's first step is)."""
    stream = stream or sys.stdout
    if not stream.isatty():
        yield
        return
    done, started, every = threading.Event(), time.monotonic(), EVERY_S

    def tick() -> None:
        while not done.wait(every):
            stream.write(f"{what}: {time.monotonic() - started:.0f} s so far\n")
            stream.flush()

    thread = threading.Thread(target=tick, name="mgpu-ticking", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
