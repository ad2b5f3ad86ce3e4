"""The train.py and torchrun children of a bench script, ended with the script.

real_images.py and two_nodes.py start their runs as child processes, torchrun often, and torchrun
starts each worker in a session of its own. A script stopped by a signal to its own pid (kill, a
scheduler) ended only itself, and subprocess.run's SIGKILL of a child past its timeout ended
torchrun alone: the workers trained on as orphans. Under `timeout`, whose SIGTERM reaches the
script's whole process group, the script exited while torchrun was still stopping its workers
(up to 30 s): 4 train.py processes at 110 % CPU after the script was gone, beside whatever ran
next on the machine.

Here a child left running when the script stops waiting for it (a timeout, Ctrl-C, SIGTERM, an
error) is asked to end with SIGTERM (torchrun forwards it to its workers and waits for them),
given GRACE_S seconds, and only then killed. exit_on_sigterm, called first thing in a script's
main, turns SIGTERM into an exception so that it reaches that cleanup.
"""

from __future__ import annotations

import signal
import subprocess
import time
from types import FrameType

# torchrun gives its workers 30 s after SIGTERM before it kills them itself (the agent's
# shutdown timeout); a little more here lets it do so before its own SIGKILL would orphan them.
# 555 s of `timeout` plus this stays under a 10-minute call.
GRACE_S = 40.0


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit(143) in the main thread: Python's default ends the process at
    once, skipping every `finally`, so the children would be left running."""
    signal.signal(signal.SIGTERM, _exit)


def _exit(signum: int, frame: FrameType | None) -> None:
    # Once only: `timeout` sends SIGTERM to the script and then to its process group, which
    # holds the script too; a second SystemExit would cut short the cleanup the first started.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(128 + signum)


def stop(procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
    """Ends those of `procs` still running: SIGTERM to each, up to `grace_s` seconds for all of
    them to exit, then SIGKILL to any left; every one is reaped."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.terminate()
    deadline = time.monotonic() + grace_s
    try:
        for p in live:
            try:
                # communicate, not wait: a child whose output pipe is full never exits
                p.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:  # past the grace, or a second Ctrl-C meanwhile
        for p in live:
            if p.poll() is None:
                p.kill()
                p.wait()


def run_child(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    timeout: float | None = None,
    capture: bool = True,
    grace_s: float = GRACE_S,
) -> subprocess.CompletedProcess:
    """subprocess.run(cmd, capture_output=capture, text=True, env=env, cwd=cwd, timeout=timeout),
    but a child still running when the wait ends early (the timeout, Ctrl-C, exit_on_sigterm's
    SystemExit, any error) is ended by `stop` before the exception goes on, unchanged:
    subprocess.TimeoutExpired stays that."""
    pipe = subprocess.PIPE if capture else None
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=pipe, stderr=pipe, text=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            stop([proc], grace_s)
            raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
