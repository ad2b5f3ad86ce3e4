"""How an mgpu process ends (train.py, mgpu.evaluate): its own exit code, its logs flushed, its
multiprocessing queues' semaphores released, and then at once, without the interpreter's
teardown of torch (exit_process says why)."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from mgpu.runtime.stops import BAD_INPUT

# How long an ending process waits for its multiprocessing queues' feeder threads (a feeder
# sends its queue's last message in milliseconds; a longer wait is one for a reader that is
# gone), and one that stops on bad input for the collection of its garbage (the finalizers of a
# DataLoader iterator join its worker processes, up to 5 s each where one does not answer).
FEEDER_GRACE_S = 2.0
COLLECT_GRACE_S = 10.0


def exit_process(main: Callable[[], None]) -> None:
    """Run `main` (Hydra's, which ends with sys.exit, errors included) and end the process.

    Teardown rule: by the time `main` returns, the process group is destroyed, every file the
    run writes is closed and its DataLoader workers are gone. The process then ends without
    Python's and C++'s teardown of torch: after joining a process group, that teardown of
    torch's communication threads can abort ("terminate called without an active exception")
    after the work is done and turn a finished run into a failed one; and in every process it
    took 1.45 s on a 2-core CPU host after the run's last line (the interpreter freeing torch's
    modules), which each run, and each of its test's launches, would wait for."""
    try:
        main()
        code = 0
    except SystemExit as stop:
        code = exit_code(stop)
    end_process(code)


def exit_code(stop: SystemExit) -> int:
    """The process's exit code for a SystemExit, as Python's own exit gives it."""
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


def end_process(code: int) -> None:
    """End this process with `code` under exit_process's teardown rule, once its logs are out
    and its multiprocessing queues' feeder threads have ended (up to FEEDER_GRACE_S).

    Why wait for the feeders: a DataLoader's queue to a worker hands what the process puts in
    it to the pipe from a feeder thread of multiprocessing's, which holds two of the queue's
    semaphores until it has sent the worker's last message. The DataLoader's shutdown does not
    wait for it (torch cancels the join), and os._exit skips the join Python's own exit does: a
    feeder still sending ended with its semaphores unreleased, and the resource tracker, left
    alone, warned of "leaked semaphore objects" after a finished run (1 in 4-5 two-process CPU
    runs). A feeder ends once its sentinel is sent; a name is all that tells its thread apart
    (multiprocessing.queues names it).

    A process that stops on bad input (BAD_INPUT: an unreadable image, a config error met in a
    running process) collects its garbage first: the frames its exception passed through held
    a DataLoader iterator mid-epoch, which the traceback keeps in reference cycles, so its
    queues' semaphores (11 a worker pool) were never released and the tracker's warning followed
    the run's one line. Only there: after a CUDA error, freeing a batch the prefetcher marked
    with record_stream throws in its destructor and aborts the process (seen on an H200 after a
    device-side assert), and a finished run has closed its loaders itself. The collection runs
    finalizers, so it gets COLLECT_GRACE_S on a thread of its own.

    While it waits, the process ignores Ctrl-C and SIGTERM (torchrun sends it as the first rank
    exits): either would end it with a traceback, the interpreter's teardown or -15 instead of
    its own code."""
    try:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if code == BAD_INPUT:
            collecting = threading.Thread(target=gc.collect, name="mgpu-exit-gc", daemon=True)
            collecting.start()
            collecting.join(COLLECT_GRACE_S)
        deadline = time.monotonic() + FEEDER_GRACE_S
        for thread in threading.enumerate():
            if thread.name == "QueueFeederThread":
                thread.join(max(0.0, deadline - time.monotonic()))
    finally:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
