"""Progress lines of the data commands: every few seconds on a terminal (a pseudo-terminal
here), none when the output is piped, so scripts and logs read as before."""

import io
import logging
import os
import pty
import re
import subprocess
import sys
import time

import numpy as np
import torch
from conftest import ROOT
from PIL import Image
from torch.utils.data import DataLoader, TensorDataset

from mgpu.config.schema import Precision, TrainerConfig
from mgpu.data import progress
from mgpu.data.progress import Progress
from mgpu.models import MLP
from mgpu.runtime.dist import Runtime
from mgpu.train import watchdog
from mgpu.train.trainer import Trainer

# The command with progress lines at every update, so that a short run shows them.
EVERY_UPDATE = "import sys, runpy, mgpu.data.progress as p; p.EVERY_S = 0; "
EVERY_UPDATE += "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__')"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_line_when_the_interval_has_passed_with_the_time_left():
    now = [0.0]
    out = Terminal()
    bar = Progress("checked", 400, "images", stream=out, clock=lambda: now[0])
    for done, at in [(50, 3.0), (100, progress.EVERY_S), (150, progress.EVERY_S + 1)]:
        now[0] = at
        bar.update(done)
    # one line: the first update came too soon, the third too soon after the second
    assert out.getvalue() == "checked: 100 of 400 images (25 %), 10 s, about 30 s left\n"


def test_no_line_off_a_terminal():
    out = io.StringIO()
    bar = Progress("checked", 10, "images", stream=out, clock=lambda: 1e9)
    bar.update(5)
    assert out.getvalue() == ""


def on_a_terminal(args: list[str], code: str = EVERY_UPDATE) -> str:
    """`python -c EVERY_UPDATE module args` (or other `code`), its stdout a pseudo-terminal."""
    command = [sys.executable, "-c", code, *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    main, child = pty.openpty()
    proc = subprocess.Popen(command, env=env, stdout=child, stderr=subprocess.DEVNULL)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.wait(timeout=120)
    os.close(main)
    return b"".join(chunks).decode().replace("\r\n", "\n")


def piped(main, args: list[str], capsys) -> str:
    """What `main(args)` prints to a stdout that is not a terminal (pytest's capture, as a
    pipe), in this process, with progress lines due at every update as EVERY_UPDATE makes
    them: none may come."""
    try:
        main(args)
    except SystemExit as stop:
        assert stop.code in (0, None), stop.code
    return capsys.readouterr().out


def test_check_images_and_prepare_show_progress_on_a_terminal_only(tmp_path, capsys, monkeypatch):
    from mgpu.data.check_images import main as check_images
    from mgpu.data.prepare import main as prepare

    for name in ("ant", "bee"):
        (tmp_path / "imgs" / name).mkdir(parents=True)
        for k in range(3):
            Image.new("RGB", (8, 8), (k, 2 * k, 3 * k)).save(tmp_path / "imgs" / name / f"{k}.png")
    (tmp_path / "in.txt").write_bytes(np.full(3_000_000, ord("a"), np.uint8).tobytes())
    monkeypatch.setattr(progress, "EVERY_S", 0)
    for main, module, args, line in [
        (check_images, "mgpu.data.check_images", [tmp_path / "imgs", "--workers", "1"],
         "checked: 6 of 6"),
        (prepare, "mgpu.data.prepare", [tmp_path / "in.txt", tmp_path / "o.bin"],
         "of 3 MB (100 %)"),
    ]:  # fmt: skip
        args = list(map(str, args))
        # on a terminal: the command as users run it, its stdout a pseudo-terminal
        shown, quiet = on_a_terminal([module, *args]), piped(main, args, capsys)
        assert line in shown and line not in quiet, (shown, quiet)
        # besides the progress lines, the output is the same (the time a check took aside)
        assert same([t for t in shown.splitlines() if "%)" not in t]) == same(quiet.splitlines())


def same(lines: list[str]) -> list[str]:
    return [re.sub(r"\(\d+ s\)", "(N s)", line) for line in lines]


TICK = "trainer.compile: compiling the first step: "


def test_a_compiled_run_says_the_first_step_compiles_before_it_does_and_ticks_on_a_terminal(
    tmp_path,
):
    """A compiled run's first step (minutes for a large model, nothing printed meanwhile) is
    announced before it runs, and says it is still compiling every few seconds, on a terminal
    (piped: the test below)."""
    args = ["trainer.compile=true", "trainer.compile_backend=aot_eager", "trainer.max_steps=2"]
    args += ["trainer.log_every=1", "trainer.eval_every=0", "data.num_workers=0", "ckpt.every=0"]
    # gpt_tiny cut to one narrow layer: a smaller graph to compile (its first step still takes
    # seconds, many ticks at EVERY_S = 0.2), and what is said does not depend on the model
    args += ["model.vocab_size=256", "model.n_layer=1", "model.n_head=2", "model.n_embd=32"]
    tick = "import sys, runpy, mgpu.data.progress as p; p.EVERY_S = 0.2; "
    tick += "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    command = [str(ROOT / "train.py"), *args, f"hydra.run.dir={tmp_path / 'run'}"]
    shown = on_a_terminal(command, code=tick)
    assert "step 2/2" in shown, shown[-3000:]
    said = shown.index("trainer.compile: the first step compiles the model (aot_eager")
    assert said < shown.index("step 1/2"), shown[-3000:]
    assert re.search(re.escape(TICK) + r"\d+ s so far", shown), shown[-3000:]


def test_the_compile_ticks_stay_off_a_pipe(capsys, monkeypatch):
    """The trainer's `ticking` around the first step, on its default stream (stdout, here
    pytest's capture: not a terminal, as a pipe): no line however long the step takes."""
    monkeypatch.setattr(progress, "EVERY_S", 0)  # a line due at once, were it a terminal
    with progress.ticking(TICK.removesuffix(": ")):
        time.sleep(0.1)  # the step the lines would come during
    assert capsys.readouterr().out == ""


def evaluation_log(compile: bool, caplog) -> list[list[str]]:
    """What rank 0 logs in two evaluations of 10 samples in batches of 4 (input shapes (4, 8),
    (4, 8) and (2, 8) each time), the model compiled or not."""
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=5, hidden=[16])
    cfg = TrainerConfig(precision=Precision.fp32, compile=compile, compile_backend="eager")
    trainer = Trainer(cfg, model, None, None, Runtime(0, 0, 1, "gloo", torch.device("cpu"), False))
    data = TensorDataset(torch.randn(10, 8), torch.randint(0, 5, (10,)))
    said = []
    for _ in range(2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mgpu.train.evaluation"):
            trainer.evaluate(DataLoader(data, batch_size=4))
        said.append([r.getMessage() for r in caplog.records])
        # the stall clock times what follows an evaluation (its first sum is not timed)
        assert trainer.watch.phase == watchdog.EVAL, trainer.watch.phase
    return said


def test_evaluation_says_it_compiles_once_for_each_new_input_shape(caplog):
    """A compiled model compiles again for evaluation, and for each input shape new there; that
    pause (minutes for a large model) is announced, once a shape, and not for an eager model."""
    first, second = evaluation_log(True, caplog)
    assert len(first) == 2, first
    assert "compiles the model for input shape (4, 8)" in first[0]
    assert "compiles the model for input shape (2, 8)" in first[1]
    assert second == []  # both shapes run before: nothing compiles
    assert evaluation_log(False, caplog) == [[], []]
