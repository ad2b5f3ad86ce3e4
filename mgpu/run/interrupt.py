"""Ctrl-C during a run: one line saying the step it reached and the newest checkpoint (what the
same command resumes from), and exit code 130, instead of a KeyboardInterrupt traceback from every
rank and every thread it passes through. Where the run stops is mgpu.runtime.ctrl_c's: during
training, after a step every rank agreed on."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from mgpu.ckpt.checkpoint import checkpoint_root, newest_kept
from mgpu.runtime.ctrl_c import CtrlC
from mgpu.runtime.dist import RunStopped
from mgpu.runtime.preempt import RESUME
from mgpu.runtime.stops import peer_gone

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C ended


class Interrupted(RunStopped):
    """Ctrl-C reached the run. A terminal sends SIGINT to every process of the job, so every
    rank meets it and rank 0 alone says it."""

    exit_code = INTERRUPTED_EXIT_CODE


@contextmanager
def interrupted(
    run_dir: Path, step: Callable[[], int | None], advice: str = RESUME
) -> Iterator[CtrlC]:
    """Around a run, handing the trainer its CtrlC: KeyboardInterrupt becomes Interrupted,
    naming `step()` (the last step trained, None before training started) and the run's newest
    checkpoint. So does a collective whose peer process ended after this rank's own Ctrl-C: where
    the ranks stop on their own (an evaluation batch, the grace run out), one can leave another
    in a collective. A second Ctrl-C while the run unwinds, and
    torchrun's SIGTERM sent as it sees its workers stop, are ignored from then on: either would
    cut the line short with a traceback or -15. (train.py exits at once for a Ctrl-C that comes
    before this.)"""
    with CtrlC() as ctrl_c:
        try:
            yield ctrl_c
        except (KeyboardInterrupt, RuntimeError) as err:
            if isinstance(err, RuntimeError) and not (ctrl_c.asked and peer_gone(err)):
                raise
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
            reached = step()
            where = "before the first step" if not reached else f"after step {reached}"
            newest = newest_kept(checkpoint_root(run_dir))
            resume = f"newest checkpoint {newest}: {advice}"  # run_name.resume_advice's
            raise Interrupted(
                f"interrupted (Ctrl-C) {where}; "
                + (resume if newest else "no checkpoint saved yet: the same command starts afresh")
            ) from None
