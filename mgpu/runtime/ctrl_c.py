"""How a Ctrl-C (SIGINT) reaches a run's main thread: during training, as a request the trainer
acts on where it can stop cleanly (CtrlC: after a step every rank agreed on, an evaluation
batch); held out of blocks that an exception at any point would leave broken (ctrl_c_held).
What the run then says is mgpu.run.interrupt's.

Why not Python's own KeyboardInterrupt: it is raised between any two bytecodes of the main
thread, inside whatever library code that is. Cut there, torch's zip writer wrote a broken
checkpoint file; closing TensorBoard's writer after it waited out its 120-s flush interval, by
all signs a wake-up of its thread lost; and on several ranks, each stopped at a different
point, one rank can be left with collectives the others never join.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

# How long a deferred Ctrl-C waits for the run to stop (the ranks stop together a few steps
# later: mgpu.train.guard's agreement is read LAG steps after it was sent, and a step takes
# milliseconds to a couple of seconds) before it is raised wherever the main thread is in
# Python: a first step that compiles for minutes, a wait for data. (A thread blocked in C, in a
# collective or a device sync, runs no handler until that returns; dist.timeout_s bounds it.)
GRACE_S = 10.0
# A deferred Ctrl-C not acted on this soon is told on the console: the user sees it was heard.
TELL_S = 1.0

log = logging.getLogger("mgpu")


class CtrlC:
    """Ctrl-C during a run. `with CtrlC() as ctrl_c:` installs the handler: a Ctrl-C raises
    KeyboardInterrupt at once, as Python's own handler does, except under `ctrl_c.defer(True)`
    (the trainer's loop), where the first one only sets `asked`: the trainer hands it to the
    step's agreement (or an evaluation's sum), and every rank stops after the same step
    (stop_now()). A second Ctrl-C, or no stop within `grace_s`, raises it at once wherever the
    main thread is. (Under torchrun the terminal's Ctrl-C reaches the agent, which passes one
    SIGINT on to each worker.) On the way out, Ctrl-C raises KeyboardInterrupt (the previous
    handler is not put back: it may end the process without a word).

    Only the main thread runs signal handlers; on another thread this does nothing (`active`
    says whether it is installed). A watcher thread, started on entering, ends the grace: it
    sends SIGINT to the main thread, which also cuts short a blocking system call there."""

    def __init__(self, grace_s: float = GRACE_S):
        self.asked = False  # a deferred Ctrl-C came; read by the main thread only
        self.grace_s = grace_s
        self._deferring = False  # defer(True)
        self._came = threading.Event()  # set by the handler: the watcher's grace starts
        self._acted = threading.Event()  # set at a stop or on the way out: no grace left
        self._raised = False  # raised by the handler: the grace has nothing left to end
        # Held by the watcher from its last look at _acted to its SIGINT, and by the main thread
        # to set _acted: a stop can't fall between them, where the watcher's SIGINT would land
        # as a second KeyboardInterrupt in the code handling the first (a `finally`, the line).
        self._ending = threading.Lock()
        self._watcher: threading.Thread | None = None

    @property
    def active(self) -> bool:
        return self._watcher is not None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)
            self._watcher = threading.Thread(target=self._watch, name="mgpu-ctrl-c", daemon=True)
            self._watcher.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watcher is None:
            return
        self._act()
        self._came.set()  # the watcher ends without a signal
        self._watcher.join()
        if signal.getsignal(signal.SIGINT) == self._handle:  # not what the caller set since
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def defer(self, on: bool) -> None:
        """Turned on as the training loop starts, which acts on `asked` where it can stop
        cleanly, and off as it ends, whichever way. A Ctrl-C the loop had no step left to act on
        (it came in the last steps) ends no grace after it: the run trained to its end."""
        self._deferring = on
        if not on and self.asked:
            self._act()

    def _act(self) -> None:
        # Waits, on the main thread, for a watcher sending its SIGINT: that one is then raised
        # here, as the lock's wait is cut short by it (a KeyboardInterrupt either way).
        with self._ending:
            self._acted.set()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Runs on the main thread between two bytecodes, wherever it is: sets a flag and wakes
        # the watcher, nothing else. The flag first: a second signal arriving inside set() then
        # raises instead of entering set() again.
        if self.asked or not self._deferring:
            self._raised = True  # no lock taken here: set() may be what the signal cut into
            raise KeyboardInterrupt  # not deferred, the second Ctrl-C, or the grace ran out
        self.asked = True
        self._came.set()

    def _watch(self) -> None:
        self._came.wait()
        tell = min(TELL_S, self.grace_s)
        if self._acted.wait(tell):
            return
        if not self._raised:  # logged from this thread: the main one may be inside logging
            log.info(
                "Ctrl-C: stopping after a step every rank agrees on, within %.0f s; "
                "Ctrl-C again stops at once",
                self.grace_s,
            )
        if self._acted.wait(self.grace_s - tell):
            return
        with self._ending:
            if not self._acted.is_set() and not self._raised:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    def stop_now(self) -> None:
        """Stop the run: KeyboardInterrupt (mgpu.run.interrupt says it), where the ranks agreed
        on a Ctrl-C (this rank's or another's)."""
        self._act()
        raise KeyboardInterrupt


@contextmanager
def ctrl_c_held() -> Iterator[None]:
    """A Ctrl-C (SIGINT) that comes inside is held until the block ends, then delivered to the
    handler it would have met (during a run, CtrlC's). For blocks that an exception at any
    point leaves broken (torch's zip writer, cut short in a Python write it calls:
    mgpu.ckpt.write), also against a Ctrl-C raised at once (a second one, CtrlC's grace run
    out). For short blocks only: a Ctrl-C waits for it. Only the main thread sets handlers;
    elsewhere, and under a handler installed outside Python, nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = signal.getsignal(signal.SIGINT)
    if before is None:
        yield
        return
    held: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)
        for _ in held:  # each one: a second Ctrl-C held here is a second one
            signal.raise_signal(signal.SIGINT)
