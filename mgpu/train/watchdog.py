"""Hangs: where each rank is (step and phase), shared through the launch's key-value store, and
which rank the others wait for when a collective times out or a loop stops making progress: the
report names that rank, its step, phase and innermost frame, and where its stacks were written,
and that rank ends first, so that torchrun's "Root Cause" is the rank that hung.

Two clocks. Collectives are bounded by dist.timeout_s (the process group's own timeout); the
stall clock here (trainer.stall_timeout_s) catches what no collective bounds, such as a data
loader that never yields, and a host blocked behind a hung NCCL collective; not a compiled
run's first forward/backward, nor an evaluation forward of a shape new to it, where torch.compile
takes minutes (max-autotune far more), nor the loss sum of a first evaluation, where ranks wait
for those still compiling: a rank that never ends is found by the ranks that wait (in that sum,
by their collective timeout only).

Which rank did not arrive: the one with fewer collectives issued (per process group, in torch's
flight recorder) than another; where no count tells (a hang outside collectives, no recorder),
the one furthest behind in step and phase. A report asks every rank for its count and place
through the store (a side channel: a collective would hang too), and the rank it names to write
its stacks and end itself."""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import sys
import threading
import time
from pathlib import Path

import torch.distributed as tdist

from mgpu.runtime.dist import RunStopped, Runtime, first_line
from mgpu.runtime.flight import behind, issued, recorded_collectives
from mgpu.runtime.launch import launch_env
from mgpu.runtime.peers import nccl_lost_peer, store_client
from mgpu.runtime.stops import lost_peer_stop, on_console, record_for_torchrun

log = logging.getLogger(__name__)

# The exit code of the rank that hung, and of a rank whose stall clock fired and no other rank
# could be named (sysexits.h EX_SOFTWARE). A rank that waited for the hung one exits 1 after it.
STALLED_EXIT_CODE = 70
# How long a rank that waited outlives the hung one: torchrun (polling every 0.1 s by default)
# names the first worker it finds ended as the "Root Cause", which must be the rank that hung.
GRACE_S = 2.0

# Phases the training loop reports; those that wait in a collective say which one.
DATA = "data loading"
FIRST_BATCH = "agreeing that every rank read its first batch (all_reduce)"  # before the loop
STEP = "forward/backward and the gradient all_reduce"
UPDATE = "optimizer step and the step's agreement all_reduce (non-finite, preemption)"
LOG = "logging: the loss all_reduce and rank all_gather"
EVAL_DATA = "evaluation's data loading"
EVAL_COMPILE = "an evaluation forward that compiles the model for its input's shape (not timed)"
EVAL = "evaluation and its loss all_reduce"
# A compiled model's first evaluation: each rank compiles for its own shapes, and the sum waits
# for the slowest one.
EVAL_FIRST_SUM = "a first evaluation's loss all_reduce, waiting for ranks compiling (not timed)"
SAVE = "checkpoint save and its barriers"
UNTIMED = (EVAL_COMPILE, EVAL_FIRST_SUM)  # torch.compile at work here, or on a rank waited for

# A step's phases in the order the loop goes through them: ranks at the same step are ordered
# by phase, so the one still loading data lags the one waiting in the gradient all_reduce.
ORDER = (DATA, FIRST_BATCH, STEP, UPDATE, LOG, EVAL_DATA, EVAL_COMPILE, EVAL, EVAL_FIRST_SUM, SAVE)


def progress(record: dict) -> tuple[int, int]:
    phase = record["phase"]
    return record["step"], ORDER.index(phase) if phase in ORDER else -1


def stacks_path(rank: int) -> Path | None:
    """hang-rank<N>.txt beside this process's log file (train.py's: the run directory), where a
    report can name it; None without a log file (then the stacks go to stderr)."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename).parent / f"hang-rank{rank}.txt"
    return None


class CollectiveTimeout(RuntimeError, RunStopped):
    """A collective waited longer than dist.timeout_s; the message names it and the rank that
    did not arrive. Said by the rank that waited, whichever rank it is."""

    every_rank = False


class Watchdog:
    """`start()` before training and `stop()` after it (or `with watchdog:`); `beat(step,
    phase)` at each phase change (attribute writes: free in the hot loop)."""

    def __init__(self, rt: Runtime, stall_s: float, *, publish_every_s: float = 2.0):
        self.rt, self.stall_s = rt, stall_s
        self.step, self.phase, self.at = 0, "start-up", time.monotonic()
        self.compile_step = 0  # compiles_in(): the step whose STEP phase the clock leaves alone
        self.publish_every_s = min(publish_every_s, stall_s / 4) if stall_s else publish_every_s
        # How long a report waits for the other ranks' answers, then for the named rank's stacks:
        # each rank's thread looks at the store once every publish_every_s.
        self.answer_s = 2 * self.publish_every_s + 3.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store: tdist.Store | None = None
        self._loop = threading.get_ident()  # the training loop's thread, whose frame reports show

    def beat(self, step: int, phase: str) -> None:
        self.step, self.phase, self.at = step, phase, time.monotonic()

    def compiles_in(self, step: int) -> None:
        """`step` compiles the model (the run's first): its STEP phase is not timed (nor are the
        UNTIMED phases, which an evaluation beats around a forward of a shape new to it and
        its first sum)."""
        self.compile_step = step

    def __enter__(self) -> Watchdog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.beat(self.step, self.phase)
        self._loop = threading.get_ident()
        self._stop.clear()
        self._store = store_client(self.rt, timeout_s=5.0)
        self._ask_nccl = nccl_lost_peer(self.rt.device) is not None  # stops.lost_peer_stop
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
            self._answer_if_asked()
            if self._ask_nccl:  # the training thread, not waiting in NCCL, hears nothing
                lost_peer_stop(self.rt, self._store)  # returns only if no peer is lost
            idle = time.monotonic() - self.at
            first_step = self.step == self.compile_step and self.phase == STEP
            compiling = first_step or self.phase in UNTIMED
            if self.stall_s and idle > self.stall_s and not compiling:
                self._end_stalled(idle)

    # ---- the store: keys per torchrun restart (a store that outlives one holds the last's) ----

    def _key(self, what: str, rank: int | None = None) -> str:
        key = f"mgpu/{what}/{self.rt.restart_count}"
        return key if rank is None else f"{key}/{rank}"

    def _put(self, key: str, value: object) -> None:
        try:
            self._store.set(key, json.dumps(value))
        except Exception as err:  # noqa: BLE001 - rank 0 (the store's host) may be gone
            log.debug("%s not written: %s", key, err)

    def _read(self, keys: list[str]) -> dict[str, object]:
        found = {}
        for key in keys:
            try:
                if self._store.check([key]):
                    found[key] = json.loads(self._store.get(key))
            except Exception as err:  # noqa: BLE001 - report what can be read
                log.debug("%s not read: %s", key, err)
        return found

    def _record(self) -> dict:
        idle = time.monotonic() - self.at
        return {"step": self.step, "phase": self.phase, "since": time.time() - idle}

    def _publish(self) -> None:
        if self._store is not None:
            self._put(self._key("progress", self.rt.rank), self._record())

    def _answer_if_asked(self) -> None:
        """While a report is asked for, answer it; if this rank is the one it names, end."""
        if self._store is None:
            return
        asked = self._read([self._key("hang/asked"), self._key("hang/stop", self.rt.rank)])
        if self._key("hang/asked") in asked:
            self._answer()
        told = asked.get(self._key("hang/stop", self.rt.rank))
        if told is not None:
            self._end_as_culprit(str(told))

    def _answer(self) -> dict:
        """This rank's place, innermost frame and collectives issued, in the store."""
        answer = {**self._record(), "at": self._frame(), "issued": issued(recorded_collectives())}
        self._put(self._key("hang/answer", self.rt.rank), answer)
        return answer

    def _frame(self) -> str:
        """The training loop's innermost frame outside this module (a report made on that
        thread, after a collective timed out, is in this module)."""
        frame = sys._current_frames().get(self._loop)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame = frame.f_back
        if frame is None:
            return "its frame unknown"
        path = frame.f_code.co_filename
        if path.startswith(os.getcwd() + os.sep):
            path = os.path.relpath(path)
        return f"at {path}:{frame.f_lineno} in {frame.f_code.co_name}"

    # ---- a report: every rank's answer, the rank not arriving, its stacks ----

    def _answers(self) -> dict[int, dict]:
        """Every rank's answer, waiting at most answer_s; ranks that do not answer are left out."""
        world = self.rt.world_size
        self._put(self._key("hang/asked"), 1)
        answers = {self.rt.rank: self._answer()}
        deadline = time.monotonic() + self.answer_s
        while True:
            keys = [self._key("hang/answer", r) for r in range(world) if r not in answers]
            for key, answer in self._read(keys).items():
                answers[int(key.rsplit("/", 1)[1])] = answer
            if len(answers) == world or time.monotonic() > deadline:
                return answers
            time.sleep(0.1)

    def _laggards(self, answers: dict[int, dict]) -> tuple[list[int], dict]:
        """The ranks the others wait for, and what tells: issued collectives, silence, else
        the lowest step and phase."""
        late = behind(answers)
        silent = [r for r in range(self.rt.world_size) if r not in answers]
        if late or silent:
            return sorted({*late, *silent}), late
        lowest = min(progress(a) for a in answers.values())
        return [r for r, a in sorted(answers.items()) if progress(a) == lowest], late

    def _why(self, rank: int, answers: dict[int, dict], late: dict) -> str:
        """One rank's part of the line: what shows it did not arrive, and where it is."""
        if rank not in answers:
            records = self._read([self._key("progress", rank)])
            last = records.get(self._key("progress", rank))
            seen = f"; last seen in step {last['step']}, {last['phase']}" if last else ""
            return f"rank {rank} did not answer within {self.answer_s:.0f} s{seen}"
        a = answers[rank]
        where = f"in step {a['step']}, {a['phase']} for {time.time() - a['since']:.0f} s, {a['at']}"
        if rank not in late:
            return f"rank {rank} is furthest behind: it is {where}"
        group, count = late[rank]
        ahead = [r for r, a in sorted(answers.items()) if a["issued"].get(group, 0) > count]
        names = {seq: n for g, seq, n in recorded_collectives() if g == group}
        name = f" ({names[count + 1]})" if count + 1 in names else ""
        return (
            f"rank {rank} did not arrive at collective {count + 1}{name} of process group "
            f"{group}, which rank {', '.join(map(str, ahead))} issued: it is {where}"
        )

    def _where_all(self, answers: dict[int, dict], laggards: list[int]) -> str:
        """Every rank's step and phase, the ones the others wait for first."""
        now = time.time()
        ranked = sorted(answers.items(), key=lambda kv: (kv[0] not in laggards, progress(kv[1])))
        parts = [
            f"rank {r}: step {a['step']}, {a['phase']} for {now - a['since']:.0f} s"
            for r, a in ranked
        ]
        return f"lagging: rank {', '.join(map(str, laggards))}; " + "; ".join(parts[:8])

    def _report(self) -> tuple[str, bool | None]:
        """The report's middle part, and whether this rank is the one the others wait for (then
        it has written its stacks; None: not known); the other ranks named are asked to write
        theirs and end."""
        if self._store is None:
            where = self._write_stacks()
            return f"Other ranks are not known (no process group or store); stacks: {where}", None
        answers = self._answers()
        laggards, late = self._laggards(answers)
        me = self.rt.rank
        asked = [r for r in laggards if r != me]
        for rank in asked:
            self._put(self._key("hang/stop", rank), f"rank {me} waited {self._waited()}")
        stacks = self._stacks_of(asked)
        if me in laggards:
            stacks[me] = self._write_stacks()
        whys = [f"{self._why(r, answers, late)}; its stacks: {stacks[r]}" for r in laggards]
        return ". ".join([*whys, self._where_all(answers, laggards)]), me in laggards

    def _stacks_of(self, ranks: list[int]) -> dict[int, str]:
        """Where each asked rank wrote its stacks, as it said within answer_s."""
        keys = {self._key("hang/stacks", r): r for r in ranks}
        deadline = time.monotonic() + self.answer_s
        said = self._read(list(keys))
        while len(said) < len(keys) and time.monotonic() < deadline:
            time.sleep(0.1)
            said = self._read(list(keys))
        missing = f"not written (no answer within {self.answer_s:.0f} s)"
        return {r: str(said.get(k, missing)) for k, r in keys.items()}

    def _waited(self) -> str:
        return f"{time.monotonic() - self.at:.0f} s in step {self.step}, {self.phase}"

    def _write_stacks(self) -> str:
        """Every thread's stack, in this rank's hang-rank<N>.txt (else stderr); where, for the
        store and the line. The training loop's thread is named in the file's first line."""
        loop = f"the training loop's thread is 0x{self._loop:016x}"
        head = f"rank {self.rt.rank}: no progress for {self._waited()}; {loop}\n"
        path = stacks_path(self.rt.rank)
        if path is not None:
            try:
                with open(path, "w") as f:
                    f.write(head)
                    f.flush()  # faulthandler writes to the file descriptor, after it
                    faulthandler.dump_traceback(file=f, all_threads=True)
            except OSError as err:
                log.warning("stacks not written to %s (%s): on stderr instead", path, err)
                path = None
        if path is None:
            sys.stderr.write(head)
            sys.stderr.flush()  # faulthandler writes to the file descriptor, after it
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        where = str(path) if path is not None else "on its stderr"
        if self._store is not None:
            self._put(self._key("hang/stacks", self.rt.rank), where)
        return where

    def _end_stalled(self, idle: float) -> None:
        head = (
            f"rank {self.rt.rank}: no progress for {idle:.0f} s (trainer.stall_timeout_s="
            f"{self.stall_s:g}) in step {self.step}, {self.phase}"
        )
        report, hung = self._report()
        if hung is False:
            self._exit(f"{head}. {report}", 1)
        said = ": the other ranks wait for this one" if hung else ""
        self._exit(f"{head}{said}. {report}", STALLED_EXIT_CODE)

    def _end_as_culprit(self, told: str) -> None:
        """Another rank's report named this one as the rank it waits for."""
        where = self._write_stacks()
        self._exit(
            f"rank {self.rt.rank}: no progress for {self._waited()}: the other ranks wait for "
            f"this one ({told}); {self._frame()}; its stacks: {where}",
            STALLED_EXIT_CODE,
        )

    def _exit(self, line: str, code: int) -> None:
        """Say the line and end the process: the main thread is stuck in a call it does not
        return from, so no exception can reach it. A rank that waited outlives the hung one."""
        log.error("%s. Ending this process (exit %d).", line, code)
        # torchrun's root cause; marked as said where the line above reached the console, so
        # that launch/torchrun.py does not say it again
        record_for_torchrun(f"mgpu: {line}", launch_env().error_file, on_console(logging.ERROR))
        for handler in logging.getLogger().handlers:
            handler.flush()
        if code != STALLED_EXIT_CODE:
            time.sleep(GRACE_S)
        os._exit(code)

    def timed_out(self, err: Exception) -> CollectiveTimeout:
        """The error to stop with when a collective in the current phase timed out; the rank it
        names as not arriving has been asked to end first."""
        self.stop()  # the report uses the store from this thread now
        head = f"rank {self.rt.rank}: a collective timed out (dist.timeout_s) in step {self.step}"
        report, hung = self._report()
        if hung is False:
            time.sleep(GRACE_S)  # the hung rank ends first
        said = first_line(err)
        return CollectiveTimeout(f"{head}, {self.phase}. {report}. The backend said: {said}")
