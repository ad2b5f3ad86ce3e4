"""Ctrl-C while a run is still starting (importing torch, checking its config, starting the
DataLoader workers' fork server): one line and exit 130, as Ctrl-C during training says
(tests/test_one_line.py), not a KeyboardInterrupt traceback from the import it arrived in."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from conftest import train_command


def wait_until_importing_torch(pid: int, proc: subprocess.Popen) -> None:
    """train.py's first lines (its Ctrl-C handler among them) have run once torch's library is
    mapped into the process: its imports come after them."""
    maps = Path(f"/proc/{pid}/maps")
    while proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)  # waiting for the process to get there, not timing anything


def test_ctrl_c_while_starting_says_one_line_and_exits_130(tmp_path):
    run_dir = tmp_path / "run"
    command, env = train_command(["trainer.max_steps=5", f"hydra.run.dir={run_dir}"], nproc=None)
    out = open(tmp_path / "out.txt", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        env=env,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    wait_until_importing_torch(proc.pid, proc)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does: every process of it
    code = proc.wait(timeout=240)
    out.close()
    text = (tmp_path / "out.txt").read_text()
    said = [line for line in text.splitlines() if "interrupted (Ctrl-C)" in line]
    assert code == 130, text[-3000:]
    assert len(said) == 1 and "before the first step" in said[0], text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
