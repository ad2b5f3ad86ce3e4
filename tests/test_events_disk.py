"""A TensorBoard event file that cannot be written (a full disk) stops the run in one line that
names the file, the OS error and the fix; not a traceback from TensorBoard's writer thread. The
writes fail for real: the event file is swapped for a link to /dev/full (ENOSPC), or for a
directory (EISDIR: any OSError takes the same way)."""

import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, train_command
from hydra import compose, initialize_config_dir

from mgpu.run.build import Run, build_run
from mgpu.run.config import resolved_yaml, to_config
from mgpu.runtime.dist import Runtime
from mgpu.telemetry.board import EventsUnwritable, TensorBoard

FULL = "No space left on device"
SAID = "cannot write TensorBoard events to"


def swap(events: Path, full: bool) -> None:
    """`events` becomes /dev/full (every write: ENOSPC) or a directory (EISDIR); TensorBoard's
    writer opens the file by name for each record, so its next write meets it."""
    if full:
        link = events.with_name("to-dev-full")
        link.symlink_to("/dev/full")
        os.replace(link, events)
    else:
        events.unlink()
        events.mkdir()


@pytest.mark.parametrize("full", [True, False], ids=["ENOSPC", "EISDIR"])
def test_a_failed_write_is_one_error_naming_the_file_the_cause_and_the_fix(tmp_path, capfd, full):
    board = TensorBoard(tmp_path, enabled=True)
    assert board.events.parent == tmp_path and board.events.is_file()
    swap(board.events, full)
    with pytest.raises(EventsUnwritable) as caught:
        board.scalars(1, {"train/loss": 1.0})
        board.flush()  # the writer's thread met the error; here it reaches the host thread
    said = str(caught.value)
    assert str(board.events) in said and "hydra.run.dir" in said, said
    assert (FULL if full else os.strerror(21)) in said, said
    board.scalars(2, {"train/loss": 1.0})  # after the error: nothing more, and quietly
    board.close()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception in thread" not in err, err


def test_close_says_what_the_last_write_met_unless_the_run_already_stops(tmp_path):
    board = TensorBoard(tmp_path, enabled=True)
    swap(board.events, full=True)
    board.scalars(1, {"train/loss": 1.0})  # queued; the thread fails on it
    with pytest.raises(EventsUnwritable, match=FULL):
        board.close()
    other = TensorBoard(tmp_path / "other", enabled=True)
    swap(other.events, full=True)
    other.scalars(1, {"train/loss": 1.0})
    other.close(failing=True)  # logged, not raised: the first stop's line stays the one said


STOPPED = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    import torch
    from mgpu.telemetry.board import TensorBoard
    from mgpu.runtime.dist import Runtime, stopped
    logging.basicConfig(format="%(message)s")
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    with stopped(rt):
        board = TensorBoard(Path(sys.argv[1]), enabled=True)
        link = board.events.with_name("link")
        link.symlink_to("/dev/full")
        link.replace(board.events)
        for step in range(100):
            board.scalars(step, {"train/loss": 1.0})
        board.flush()
    """
)


def test_under_mgpus_stop_it_is_one_line_and_exit_code_1(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", STOPPED, str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert out.strip().count("\n") == 0 and SAID in out and FULL in out, out


def test_train_py_on_a_full_disk_stops_in_one_line_and_keeps_its_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    args = [
        "model.vocab_size=256",
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "trainer.log_every=1",
        "trainer.max_steps=100000",
        "trainer.eval_every=0",
        "ckpt.every=2",
        "data.num_workers=0",
        f"hydra.run.dir={run_dir}",
    ]
    command, env = train_command(args, nproc=None)
    proc = subprocess.Popen(
        command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 240  # a bound on a hang, generous for a loaded machine
        while not list(run_dir.glob("checkpoints/step-*/manifest.json")):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            time.sleep(0.1)
        (events,) = run_dir.glob("events.out.tfevents.*")
        swap(events, full=True)
        out, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, out[-3000:]
    said = [line for line in out.splitlines() if SAID in line]
    assert len(said) == 1 and str(events) in said[0] and FULL in said[0], out[-3000:]
    assert "Traceback" not in out and "Exception in thread" not in out, out[-3000:]
    assert list(run_dir.glob("checkpoints/step-*/manifest.json")), "the checkpoints went"


class FirstBatches:
    """In place of the Trainer: starts both loaders' DataLoader workers (a batch from each) and
    ends, as a run that trained does."""

    def fit(self, train, evals) -> None:
        for loader in (train, evals):
            batches = iter(loader)
            next(batches)
            batches.close()
        self.workers = multiprocessing.active_children()


def test_a_failed_last_write_still_stops_the_loaders_workers(tmp_path):
    """The run ended, and the events' last write fails as the board closes (a full disk): that
    error is the run's, and the DataLoader workers, persistent for the training loader, are
    stopped all the same (left running they keep `python train.py` from exiting)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    args = ["data.num_workers=1", "trainer.eval_every=0", f"hydra.run.dir={run_dir}"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        dcfg = compose(config_name="config", overrides=args)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    built = build_run(to_config(dcfg), rt, run_dir, resolved_yaml(dcfg))
    trainer = FirstBatches()
    run = Run(trainer, built.train_loader, built.eval_loader, built.board, built.goodput)
    # What the build queued (the hyperparameters) written first: left queued, the writer's thread
    # could meet the full disk with it before the add below, which would then raise here.
    built.board.flush()
    swap(built.board.events, full=True)
    built.board.scalars(1, {"train/loss": 1.0})  # queued; the writer's thread fails on it
    with pytest.raises(EventsUnwritable, match=FULL):
        run.fit()
    assert trainer.workers, "the loaders started no worker: nothing was tested"
    assert not multiprocessing.active_children(), "the DataLoader workers still run"
    assert (run_dir / "goodput.json").is_file()
