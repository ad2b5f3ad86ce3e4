"""Ctrl-C during training is acted on where the run can stop cleanly (mgpu.runtime.ctrl_c): the
first only asks, and every rank stops after the step whose agreement carried it; a second one, or
a grace with no such stop, stops at once, as does one before training. Checked on CtrlC itself in
this process, and end to end with a user's model whose forward sends the Ctrl-C where a
terminal's goes and records whether a KeyboardInterrupt ever cut into it."""

import logging
import os
import signal
import threading
import time

import pytest
import torch
from conftest import NCCL_ENV, free_port, gloo_runtime, spawn
from test_one_line import start_in_its_own_group

from mgpu.config.schema import NonFinite
from mgpu.runtime.ctrl_c import GRACE_S, TELL_S, CtrlC
from mgpu.train.guard import CTRL_C, LAG, PREEMPTION, NonFiniteGuard


def busy(seconds: float) -> None:
    """Python work on the main thread, where a handler that raises would raise."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(0.01)


def first_ctrl_c(work_s: float = 0.3) -> None:
    """A Ctrl-C, then a step's work that it must not cut into."""
    try:
        os.kill(os.getpid(), signal.SIGINT)
        busy(work_s)
    except KeyboardInterrupt:
        pytest.fail("the first Ctrl-C raised KeyboardInterrupt at once")


def test_a_ctrl_c_only_asks_until_the_trainer_stops_there():
    with CtrlC(grace_s=3600) as ctrl_c:
        ctrl_c.defer(True)
        assert not ctrl_c.asked
        first_ctrl_c()
        assert ctrl_c.asked
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.stop_now()
    # on the way out, Python's own handler: a Ctrl-C after the run raises at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_ctrl_c_not_acted_on_at_once_is_told(caplog):
    """A first step that compiles for minutes: the user sees the Ctrl-C was heard."""
    with CtrlC(grace_s=3600) as ctrl_c, caplog.at_level(logging.INFO, logger="mgpu"):
        ctrl_c.defer(True)
        first_ctrl_c(TELL_S + 0.5)
        told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Ctrl-C")]
        assert told == [
            "Ctrl-C: stopping after a step every rank agrees on, within 3600 s; "
            "Ctrl-C again stops at once"
        ]
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.stop_now()


def test_a_second_ctrl_c_stops_at_once():
    with CtrlC(grace_s=3600) as ctrl_c:
        ctrl_c.defer(True)
        first_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            busy(30)  # never reached: no step boundary here
        assert ctrl_c.asked


def test_a_ctrl_c_before_the_training_loop_stops_at_once():
    with CtrlC(grace_s=3600), pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        busy(30)  # building the run: nothing to defer to


def test_a_ctrl_c_the_loop_had_no_step_left_for_ends_no_grace_after_it():
    """Asked in the last steps, the run trained to its end: its teardown is not cut short."""
    with CtrlC(grace_s=0.3) as ctrl_c:
        ctrl_c.defer(True)
        first_ctrl_c(0.1)
        ctrl_c.defer(False)
        try:
            busy(1.0)  # the final save, closing TensorBoard's writer
        except KeyboardInterrupt:
            pytest.fail("the grace raised KeyboardInterrupt after the loop had ended")


def test_a_ctrl_c_no_step_boundary_meets_stops_after_the_grace():
    with CtrlC(grace_s=1.0) as ctrl_c:
        ctrl_c.defer(True)
        first_ctrl_c(0.2)
        with pytest.raises(KeyboardInterrupt):
            busy(60)  # a first step compiling, a wait for data: the grace ends it


def test_a_stop_as_the_grace_runs_out_is_one_keyboard_interrupt(monkeypatch):
    """The grace's end and a stop fall together: the watcher has decided to send its SIGINT when
    the trainer's stop_now() raises. Only one KeyboardInterrupt: the watcher's, raised in place of
    the stop's, never a second one in the code handling the first."""
    sending, send = threading.Event(), signal.pthread_kill

    def slow_send(thread_id: int, signum: int) -> None:
        sending.set()
        time.sleep(0.3)  # widened from the microseconds it takes
        send(thread_id, signum)

    monkeypatch.setattr(signal, "pthread_kill", slow_send)
    with CtrlC(grace_s=0.2) as ctrl_c:
        ctrl_c.defer(True)
        first_ctrl_c(0.01)
        assert sending.wait(5)
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.stop_now()
        try:
            busy(1.0)  # handling the stop: the line, the teardown
        except KeyboardInterrupt:
            pytest.fail("a second KeyboardInterrupt came after the stop")


def reasons_worker(rank: int, port: int, out: str):
    """Rank 0 asks to stop for a preemption from step 2 on, rank 1 for a Ctrl-C from step 3 on:
    what each rank's guard agrees on after each step."""
    with gloo_runtime(rank, port, 2) as rt:
        guard = NonFiniteGuard(NonFinite.skip, 5, rt, scaler_owns_grads=False, preemptible=True)
        agreed = []
        for step in range(1, 8):
            asked = (PREEMPTION if step >= 2 else 0) if rank == 0 else (CTRL_C if step >= 3 else 0)
            guard.check(step, torch.tensor(1.0), [], None, asked)
            guard.poll()
            agreed.append(guard.stop)
        torch.save(agreed, f"{out}/{rank}.pt")


def test_a_ctrl_c_on_any_rank_outranks_a_preemption_on_every_rank(tmp_path):
    """The step's agreement keeps the largest reason: every rank reads the preemption of step 2
    and then the Ctrl-C of step 3, each LAG steps later, and a Ctrl-C stops without saving."""
    spawn(reasons_worker, free_port(), str(tmp_path), nprocs=2)
    expected = [0] * (2 + LAG - 1) + [PREEMPTION] + [CTRL_C] * (7 - 2 - LAG)  # after step s+LAG
    for rank in (0, 1):
        assert torch.load(tmp_path / f"{rank}.pt") == expected, rank


NETS = """
import logging
import os
import signal
import time
from pathlib import Path

from torch import nn


class Signalling(nn.Module):
    '''At its forward number `at`, rank 0 sends SIGINT where a terminal's Ctrl-C goes (train.py's
    process group; under torchrun its agent's, which passes one on to each worker) and goes on
    working for `hold_s`; a KeyboardInterrupt that cuts into it is recorded in `record`.'''

    def __init__(self, at: int, hold_s: float, record: str, only_rank0: bool = False):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
        self.at, self.hold_s, self.record, self.calls = at, hold_s, Path(record), 0
        self.only_rank0 = only_rank0  # SIGINT to rank 0's process alone

    def forward(self, x):
        self.calls += 1
        try:
            if self.calls == self.at and os.environ.get("RANK", "0") == "0":
                launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else 0
                if self.only_rank0:
                    os.kill(os.getpid(), signal.SIGINT)
                else:
                    os.killpg(os.getpgid(launcher), signal.SIGINT)
                end = time.monotonic() + self.hold_s
                while time.monotonic() < end:
                    time.sleep(0.01)
            return self.net(x)
        except KeyboardInterrupt:
            (self.record / f"cut-{os.getpid()}").write_text(str(self.calls))
            raise
"""


def signalling_model(tmp_path):
    """mypkg.nets.Signalling in the run's working directory; returns its record folder."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NETS)
    record = tmp_path / "record"
    record.mkdir()
    return record


# On GPUs the Python forward must run every step to send its Ctrl-C: not compiled, not replayed.
EAGER_ON_GPUS = ("trainer.compile=false", "trainer.cuda_graphs=false")


@pytest.mark.parametrize(
    "nproc, hold_s",
    [(None, 1.0), (2, 1.0), (None, 60.0)],
    ids=["python", "torchrun", "past-the-grace"],
)
def test_a_ctrl_c_in_a_step_stops_every_rank_after_the_same_step(tmp_path, nproc, hold_s):
    """Sent from step 3's forward: the step finishes, the forward never cut (a KeyboardInterrupt
    raised at once would cut it on every rank), and the run stops in one line: alone after step
    3, on two ranks both after the step whose agreement they read it in (3 + LAG), saving
    nothing more. A forward that goes on past the grace is cut, and the run stops after step 2."""
    stops_after_the_same_step(tmp_path, nproc, hold_s)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_ctrl_c_in_a_step_stops_both_gpus_after_the_same_step(tmp_path):
    """The same over NCCL: the agreement's collective runs on the GPUs, and a rank's host may
    wait in a device sync rather than in the collective itself."""
    stops_after_the_same_step(tmp_path, 2, 1.0, EAGER_ON_GPUS, NCCL_ENV)


def stops_after_the_same_step(tmp_path, nproc, hold_s, settings=(), env=None):
    record = signalling_model(tmp_path)
    run_dir = tmp_path / "run"
    args = ["model=custom", "model._target_=mypkg.nets.Signalling", "+model.kwargs.at=3"]
    args += [f"+model.kwargs.hold_s={hold_s}", f"+model.kwargs.record={record}"]
    args += ["data=images", "data.image_size=8", "data.num_classes=10", "data.batch_size=8"]
    # One DataLoader worker in the plain runs: its fork server meets the group's Ctrl-C as it
    # would under torchrun, where each rank's would add an interpreter and check nothing more.
    args += [f"data.num_workers={1 if nproc is None else 0}", "optim=sgd"]
    args += ["trainer.max_steps=1000", "trainer.eval_every=0"]
    args += ["ckpt.every=2", f"hydra.run.dir={run_dir}", *settings]
    proc = start_in_its_own_group(args, tmp_path, nproc, env)
    code = proc.wait(timeout=240)
    text = (tmp_path / "out.txt").read_text()
    said = [line for line in text.splitlines() if "interrupted (Ctrl-C)" in line]
    assert len(said) == 1, text[-3000:]  # once, by rank 0
    cut = {path.name: path.read_text() for path in record.iterdir()}
    if hold_s > GRACE_S:
        assert list(cut.values()) == ["3"], cut
        stop = 2
    else:
        assert cut == {}, cut  # no rank's forward was cut
        stop = 3 if nproc is None else 3 + LAG
    for rank in range(nproc or 1):  # every rank says where it stopped in its own log
        log = (run_dir / f"rank{rank}.log").read_text()
        assert f"interrupted (Ctrl-C) after step {stop}; newest checkpoint " in log, log[-2000:]
    newest = run_dir / "checkpoints" / f"step-{stop - stop % 2:08d}"
    assert f"newest checkpoint {newest}:" in said[0], said[0]
    assert "KeyboardInterrupt" not in text and "stopped: " not in text, text[-3000:]
    if nproc is None:  # (torchrun's agent adds a traceback of its own when it is signalled)
        assert code == 130 and "Traceback" not in text, text[-3000:]


def test_a_ctrl_c_during_an_evaluation_stops_every_rank_after_it(tmp_path):
    """Sent to rank 0 alone from its first evaluation batch (step 4's evaluation: forward 5):
    rank 0 reads no more batches, the evaluation's sum carries the Ctrl-C, and both ranks stop
    after step 4 in one line; rank 1 is not left in the sum waiting for a rank that left."""
    stops_after_the_evaluation(tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_a_ctrl_c_during_an_evaluation_stops_both_gpus_after_it(tmp_path):
    """The same over NCCL (rank 1, which got no Ctrl-C, reads all its batches first)."""
    stops_after_the_evaluation(tmp_path, EAGER_ON_GPUS, NCCL_ENV)


def stops_after_the_evaluation(tmp_path, settings=(), env=None):
    record = signalling_model(tmp_path)
    run_dir = tmp_path / "run"
    args = ["model=custom", "model._target_=mypkg.nets.Signalling", "+model.kwargs.at=5"]
    args += ["+model.kwargs.hold_s=0.5", f"+model.kwargs.record={record}"]
    args += ["+model.kwargs.only_rank0=true", "data=images", "data.image_size=8"]
    args += ["data.num_classes=10", "data.batch_size=8", "data.eval_samples=256"]
    args += ["data.num_workers=0", "optim=sgd", "trainer.max_steps=1000", "trainer.eval_every=4"]
    args += ["ckpt.every=100", f"hydra.run.dir={run_dir}", *settings]
    proc = start_in_its_own_group(args, tmp_path, 2, env)
    proc.wait(timeout=240)
    text = (tmp_path / "out.txt").read_text()
    assert list(record.iterdir()) == [], text[-3000:]  # no forward cut
    for rank in (0, 1):
        log = (run_dir / f"rank{rank}.log").read_text()
        assert "interrupted (Ctrl-C) after step 4; no checkpoint saved yet" in log, log[-2000:]
    assert "KeyboardInterrupt" not in text and "stopped: " not in text, text[-3000:]
