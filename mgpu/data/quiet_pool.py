"""A multiprocessing Pool for the data tools (check_images, prepare_images) whose workers leave
Ctrl-C and SIGTERM to the tool: a terminal's Ctrl-C goes to the whole process group, and each
worker's traceback used to follow the tool's one line."""

from __future__ import annotations

import signal
from multiprocessing import Pool


def quiet_worker() -> None:
    """A pool worker's first act: Ctrl-C, which a terminal sends to the whole process group,
    left to the parent (which says it in one line and terminates the pool), and SIGTERM, which
    terminate() sends, at its default: the worker ends without a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def quiet_pool(workers: int) -> Pool:
    """A Pool of quiet_worker processes. While they start, SIGINT is ignored and SIGTERM at its
    default, so that no worker ever runs the parent's handlers (a fork inherits them): a Ctrl-C
    in those milliseconds is lost, a SIGTERM ends the parent at once."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        return Pool(workers, initializer=quiet_worker)
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
