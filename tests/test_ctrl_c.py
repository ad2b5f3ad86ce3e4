"""Ctrl-C during a run is acted on where the run can stop cleanly (mgpu.runtime.ctrl_c): the first
only asks, the trainer stops at its next step boundary; a second one later, or a grace with no
such boundary, stops at once. Checked on CtrlC itself in this process, and end to end with a
user's model whose forward sends the Ctrl-C to its own process group (as a terminal does, to
every process of the job) and records whether a KeyboardInterrupt ever cut into it."""

import os
import signal
import time

import pytest
from test_one_line import start_in_its_own_group

from mgpu.runtime.ctrl_c import CtrlC


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
        ctrl_c.stop_here()  # nothing asked yet
        first_ctrl_c()
        assert ctrl_c.asked
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.stop_here()
    # on the way out, Python's own handler: a Ctrl-C after the run raises at once
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_second_ctrl_c_stops_at_once():
    with CtrlC(grace_s=3600) as ctrl_c:
        first_ctrl_c()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            busy(30)  # never reached: no step boundary here
        assert ctrl_c.asked


def test_a_ctrl_c_no_step_boundary_meets_stops_after_the_grace():
    with CtrlC(grace_s=1.0):
        first_ctrl_c(0.2)
        with pytest.raises(KeyboardInterrupt):
            busy(60)  # a first step compiling, a wait for data: the grace ends it


NETS = """
import os
import signal
import time
from pathlib import Path

from torch import nn


class Signalling(nn.Module):
    '''At its forward number `at`, rank 0 sends SIGINT where a terminal's Ctrl-C goes (train.py's
    process group; under torchrun its agent's, which passes one on to each worker) and goes on
    working for `hold_s`; a KeyboardInterrupt that cuts into it is recorded in `record`.'''

    def __init__(self, at: int, hold_s: float, record: str):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 10))
        self.at, self.hold_s, self.record, self.calls = at, hold_s, Path(record), 0

    def forward(self, x):
        self.calls += 1
        try:
            if self.calls == self.at and os.environ.get("RANK", "0") == "0":
                launcher = os.getppid() if "TORCHELASTIC_RUN_ID" in os.environ else 0
                os.killpg(os.getpgid(launcher), signal.SIGINT)
                end = time.monotonic() + self.hold_s
                while time.monotonic() < end:
                    time.sleep(0.01)
            return self.net(x)
        except KeyboardInterrupt:
            (self.record / f"cut-{os.getpid()}").write_text(str(self.calls))
            raise
"""


@pytest.mark.parametrize(
    "nproc, hold_s",
    [(None, 1.0), (2, 1.0), (None, 60.0)],
    ids=["python", "torchrun", "past-the-grace"],
)
def test_a_ctrl_c_in_a_step_stops_after_that_step(tmp_path, nproc, hold_s):
    """Sent from step 3's forward: the step finishes and the run stops after it, in one line,
    the forward never cut (a KeyboardInterrupt raised at once would cut it on every rank). A
    forward that goes on past the grace is cut, and the run stops after step 2."""
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "nets.py").write_text(NETS)
    record = tmp_path / "record"
    record.mkdir()
    run_dir = tmp_path / "run"
    args = ["model=custom", "model._target_=mypkg.nets.Signalling", "+model.kwargs.at=3"]
    args += [f"+model.kwargs.hold_s={hold_s}", f"+model.kwargs.record={record}"]
    args += ["data=images", "data.image_size=8", "data.num_classes=10", "data.batch_size=8"]
    args += ["data.num_workers=1", "optim=sgd", "trainer.max_steps=1000", "trainer.eval_every=0"]
    args += ["ckpt.every=2", f"hydra.run.dir={run_dir}"]
    proc = start_in_its_own_group(args, tmp_path, nproc)
    code = proc.wait(timeout=240)
    text = (tmp_path / "out.txt").read_text()
    said = [line for line in text.splitlines() if "interrupted (Ctrl-C)" in line]
    assert len(said) == 1, text[-3000:]  # once, by rank 0
    cut = {path.name: path.read_text() for path in record.iterdir()}
    if hold_s < 5:
        assert cut == {}, cut  # no rank's forward was cut
        assert "after step 3; newest checkpoint " in said[0], said[0]
    else:
        assert list(cut.values()) == ["3"], cut
        assert "after step 2; newest checkpoint " in said[0], said[0]
    assert str(run_dir / "checkpoints" / "step-00000002") in said[0], said[0]
    assert "KeyboardInterrupt" not in text and "stopped: " not in text, text[-3000:]
    if nproc is None:  # (torchrun's agent adds a traceback of its own when it is signalled)
        assert code == 130 and "Traceback" not in text, text[-3000:]
