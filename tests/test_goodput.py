"""Goodput: the parts add up to wall time across phase changes and across attempts, lost work
after the last checkpoint counts as restart, an unreadable file is moved aside with a warning,
only rank 0 writes, and the file is always whole, even when its writer is SIGKILLed."""

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mgpu.telemetry.goodput import CATEGORIES, Goodput

ROOT = Path(__file__).resolve().parents[1]
PARTS = [f"{cat}_s" for cat in CATEGORIES]


class FakeClock:
    def __init__(self, t: float = 1_700_000_000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def assert_adds_up(totals: dict) -> None:
    assert sum(totals[p] for p in PARTS) == pytest.approx(totals["wall_s"], rel=1e-12, abs=1e-6)
    assert all(totals[p] >= 0 for p in PARTS), totals


def run_phases(g: Goodput, clock: FakeClock, phases: list[tuple[str, float]]) -> None:
    for category, seconds in phases:
        if category == "checkpointed":
            g.checkpointed(int(seconds))
            continue
        g.enter(category)
        clock.advance(seconds)


def test_parts_add_up_to_wall_time(tmp_path):
    clock = FakeClock()
    started = clock.t
    clock.advance(7)  # imports and building before the object exists are start-up too
    g = Goodput(tmp_path / "goodput.json", started_at=started, clock=clock)
    clock.advance(3)
    phases = [("training", 50), ("eval", 4), ("training", 20), ("checkpoint", 2), ("stall", 1)]
    run_phases(g, clock, phases + [("training", 6)])
    t = g.totals()  # the open training phase counts up to now
    assert t["startup_s"] == 10
    assert t["training_s"] == 76
    assert (t["eval_s"], t["checkpoint_s"], t["stall_s"], t["restart_s"]) == (4, 2, 1, 0)
    assert t["wall_s"] == 93
    assert t["pct"] == pytest.approx(100 * 76 / 93)
    assert_adds_up(t)
    assert g.scalars() == {f"goodput/{k}": v for k, v in t.items()}
    assert set(g.scalars()) == {"goodput/pct", "goodput/wall_s", *(f"goodput/{p}" for p in PARTS)}


def test_unknown_category_and_restart_are_refused():
    g = Goodput(None, clock=FakeClock())
    for bad in ("train", "restart"):
        with pytest.raises(ValueError, match=repr(bad)):
            g.enter(bad)


def test_clock_stepping_back_makes_nothing_negative():
    clock = FakeClock()
    g = Goodput(None, clock=clock)
    g.enter("training")
    clock.advance(10)
    g.enter("eval")
    clock.advance(-5)  # NTP stepped the wall clock back
    g.enter("training")
    clock.advance(8)  # 3 s past the furthest time seen
    t = g.totals()
    assert (t["training_s"], t["eval_s"], t["wall_s"]) == (13, 0, 13)
    assert_adds_up(t)


def test_move_to_stall_moves_training_and_never_makes_it_negative():
    clock = FakeClock()
    g = Goodput(None, clock=clock)
    g.enter("training")
    clock.advance(30)
    g.move_to_stall(4)  # includes the still-open training phase
    t = g.totals()
    assert (t["training_s"], t["stall_s"]) == (26, 4)
    g.move_to_stall(100)  # more than was trained: only what there is
    g.move_to_stall(-3)  # nonsense is ignored
    t = g.totals()
    assert (t["training_s"], t["stall_s"], t["wall_s"]) == (0, 30, 30)
    assert_adds_up(t)


def test_second_attempt_counts_lost_work_and_the_gap_as_restart(tmp_path):
    path, clock = tmp_path / "goodput.json", FakeClock()
    first = clock.t
    a = Goodput(path, started_at=first, clock=clock)
    clock.advance(10)  # start-up
    run_phases(a, clock, [("training", 100), ("checkpoint", 5), ("checkpointed", 200)])
    run_phases(a, clock, [("training", 30), ("eval", 4), ("training", 6)])
    a.move_to_stall(2)  # of the at-risk training: stall stays stall after the restart
    a.save()  # the last write of attempt 1 (t = first + 155); it dies 20 s later
    clock.advance(20 + 40)  # dies, then torchrun restarts it
    clock.advance(1)
    b = Goodput(path, started_at=clock.t - 1, clock=clock)
    assert b.attempt == 2
    clock.advance(9)
    b.enter("training")
    clock.advance(50)
    t = b.totals()
    assert t["startup_s"] == 10 + 10
    assert t["training_s"] == 100 + 50  # the 34 s trained after step 200 are redone: lost
    assert (t["eval_s"], t["checkpoint_s"], t["stall_s"]) == (0, 5, 2)
    assert t["restart_s"] == (30 + 6 - 2) + 4 + 60
    assert t["wall_s"] == clock.t - first
    assert_adds_up(t)


def test_checkpointed_work_is_not_lost(tmp_path):
    path, clock = tmp_path / "goodput.json", FakeClock()
    first = clock.t
    a = Goodput(path, clock=clock)
    run_phases(a, clock, [("training", 100), ("eval", 3), ("checkpoint", 5), ("checkpointed", 10)])
    a.enter("training")  # the final save, as the trainer makes it after the checkpoint
    a.save()
    clock.advance(600)  # queued before the relaunch
    b = Goodput(path, clock=clock)
    t = b.totals()
    assert (t["training_s"], t["eval_s"], t["restart_s"]) == (100, 3, 600)
    assert t["wall_s"] == clock.t - first
    assert_adds_up(t)


def test_three_attempts_accumulate(tmp_path):
    path, clock = tmp_path / "goodput.json", FakeClock()
    first = clock.t
    for attempt in range(1, 4):
        g = Goodput(path, clock=clock)
        assert g.attempt == attempt
        clock.advance(5)
        run_phases(g, clock, [("training", 20), ("checkpoint", 1), ("checkpointed", attempt)])
        run_phases(g, clock, [("training", 7)])  # lost, except in the last attempt
        g.save()
        if attempt < 3:
            clock.advance(3)  # after the last write, until the process is gone
    t = g.totals()
    assert t["startup_s"] == 3 * 5
    assert t["training_s"] == 3 * 20 + 7
    assert t["checkpoint_s"] == 3 * 1
    assert t["restart_s"] == 2 * (7 + 3)
    assert t["wall_s"] == clock.t - first
    assert_adds_up(t)
    records = json.loads(path.read_text())["attempts"]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["at_risk"]["training"] == 7 for r in records)


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        '{"version": 99, "attempts": []}',
        '{"version": 1, "attempts": [{"started_at": 1.0}]}',
        "[]",
    ],
)
def test_unreadable_file_is_moved_aside_with_a_warning(tmp_path, caplog, content):
    path, clock = tmp_path / "goodput.json", FakeClock()
    path.write_text(content)
    with caplog.at_level(logging.WARNING, logger="mgpu.telemetry.goodput"):
        g = Goodput(path, clock=clock)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0], warnings
    assert (tmp_path / "goodput.json.corrupt").read_text() == content  # kept as evidence
    assert g.attempt == 1
    clock.advance(12)
    t = g.totals()
    assert (t["wall_s"], t["startup_s"], t["restart_s"]) == (12, 12, 0)
    assert len(json.loads(path.read_text())["attempts"]) == 1  # a fresh, valid file


def test_other_ranks_write_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clock = FakeClock()
    g = Goodput(None, clock=clock)
    run_phases(g, clock, [("training", 5), ("checkpoint", 1), ("checkpointed", 3)])
    g.save()
    assert g.totals()["training_s"] == 5  # still counted, in memory
    assert list(tmp_path.iterdir()) == []


def test_save_is_atomic_and_leaves_no_temp_file(tmp_path):
    path, clock = tmp_path / "goodput.json", FakeClock()
    stale = tmp_path / ".goodput.json.tmp-12345"
    stale.write_text('{"half a wri')  # a killed attempt's unfinished write
    g = Goodput(path, clock=clock)
    assert not stale.exists()
    for _ in range(3):
        run_phases(g, clock, [("training", 2)])
        g.save()
        record = json.loads(path.read_text())["attempts"][-1]
        assert record["last_update"] == clock.t
        assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.json"]
    assert record["seconds"]["training"] == 6


def test_failed_write_warns_once_and_keeps_the_old_file(tmp_path, caplog, monkeypatch):
    path, clock = tmp_path / "goodput.json", FakeClock()
    g = Goodput(path, clock=clock)
    before = path.read_text()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    clock.advance(5)
    with caplog.at_level(logging.WARNING, logger="mgpu.telemetry.goodput"):
        g.save()
        g.save()
    assert len(caplog.records) == 1 and "No space left" in caplog.records[0].getMessage()
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.json"]


WRITER = """
import sys, time
from pathlib import Path
from mgpu.telemetry.goodput import Goodput
g = Goodput(Path(sys.argv[1]), started_at=time.time() - 1.0)
g.enter("training")
g.checkpointed(1)
print("ready", flush=True)
while True:
    g.save()
"""


def test_attempt_sigkilled_while_saving_is_resumed(tmp_path, caplog):
    """A real process rewriting the file in a loop, SIGKILLed at an arbitrary point: the next
    attempt finds a whole file and carries the dead one's time over, the parts adding up."""
    path = tmp_path / "goodput.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path)], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.3)  # a few hundred saves; no timing is asserted
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    record = json.loads(path.read_text())["attempts"][0]
    with caplog.at_level(logging.WARNING, logger="mgpu.telemetry.goodput"):
        g = Goodput(path)
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    assert g.attempt == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["goodput.json"]
    t = g.totals()
    assert t["startup_s"] >= 1.0  # the dead attempt's, from its started_at
    # Everything it trained after its checkpoint is lost: that, and the time from its last save
    # until this attempt began, is restart.
    trained, lost = record["seconds"]["training"], record["at_risk"]["training"]
    assert lost > 0
    assert t["training_s"] == pytest.approx(trained - lost, abs=1e-9)
    assert t["restart_s"] > lost
    assert_adds_up(t)


def test_attempt_starting_before_the_last_write_still_adds_up(tmp_path):
    """Rank 0 of the next attempt on a host whose clock runs behind: no negative gap, no part
    counted twice."""
    path, clock = tmp_path / "goodput.json", FakeClock()
    first = clock.t
    a = Goodput(path, clock=clock)
    run_phases(a, clock, [("training", 10), ("checkpoint", 1), ("checkpointed", 5)])
    a.save()
    clock.advance(-4)  # the new host's clock
    b = Goodput(path, started_at=clock.t - 2, clock=clock)
    clock.advance(6)  # 2 s past the previous attempt's last write
    t = b.totals()
    assert (t["training_s"], t["restart_s"], t["startup_s"]) == (10, 0, 2)
    assert t["wall_s"] == clock.t - first == 13
    assert_adds_up(t)
