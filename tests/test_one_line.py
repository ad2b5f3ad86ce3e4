"""Input that cannot work and a run stopped by hand end in one line of mgpu's, not a traceback:
a 10,000-character value or key, a key with a character Hydra's grammar does not read (unicode),
a value with shell metacharacters left unquoted for Hydra, a run directory on a read-only
filesystem or with a name too long, and Ctrl-C during training (the step reached and the newest
checkpoint, exit code 130); under torchrun, its closing report names the config error. Real
processes: train.py as a user starts it (each bad input's words are worked out in this process,
by the checks train.py runs, with one launch for each way it stops on them)."""

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import one_line_under_torchrun, run_train, train_command
from omegaconf.errors import OmegaConfBaseException

from mgpu.config.checks import ConfigError
from mgpu.run.cli import check_command_line, check_run_dir, config_error_line

LONG = "x" * 10_000

# (override, words the one line must hold)
BAD = [
    (f"trainer.max_steps={LONG}", ["trainer.max_steps=", "could not be converted to Integer"]),
    (f"+{LONG}=1", ["a key of 10000 characters"]),
    ("trainér.max_steps=3", ["'é' (character 6) cannot be in a key"]),
    ("+ключ=1", ["'к' (character 2) cannot be in a key"]),
    ("model.n_embd=32;rm -rf x", ["';' (character 16)", "\"model.n_embd='32;rm -rf x'\""]),
    ("data.path=$(touch pwned)", ["'(' (character 12)", "\"data.path='$(touch pwned)'\""]),
    (f"hydra.run.dir={LONG}", ["hydra.run.dir=", "a name of 10000 bytes"]),
]


IDS = ["long-value", "long-key", "accent-key", "cyrillic-key", "semicolon", "subshell", "dir"]


def said_for(override: str, cwd: Path) -> str:
    """The one line train.py says for `override`, started in `cwd`, worked out in this process
    by the checks it runs: its first step's (check_command_line), then, for what that leaves to
    Hydra's run start, ValidateOnRunStart's check of the run directory (check_run_dir)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        with pytest.raises((ConfigError, OmegaConfBaseException)) as err:
            check_command_line([override])
            key, _, value = override.partition("=")
            check_run_dir(key, value)
    return config_error_line(err.value)


@pytest.mark.parametrize("override, words", BAD, ids=IDS)
def test_a_value_or_key_that_cannot_work_is_one_short_line(tmp_path, override, words):
    line = said_for(override, tmp_path)
    assert "\n" not in line and line.startswith("mgpu: config error: "), line
    assert len(line) < 400, line
    for word in words:
        assert word in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing run, nothing made


# One launch per way train.py stops on such input (its first step; Hydra's run start): the
# line above, alone on stderr, exit code 2, no run directory of any name.
@pytest.mark.parametrize("override", [BAD[5][0], BAD[6][0]], ids=["subshell", "dir"])
def test_train_py_says_it_alone_exits_2_and_makes_nothing(tmp_path, override):
    run_dir = tmp_path / "run"
    args = (
        [override]
        if override.startswith("hydra.run.dir")
        else [override, f"hydra.run.dir={run_dir}"]
    )
    proc = run_train(args, cwd=tmp_path, nproc=None)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == said_for(override, tmp_path), lines[0]
    assert not run_dir.exists() and not (tmp_path / "pwned").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no run directory of any name


def test_torchruns_report_names_the_config_error_as_the_root_cause(tmp_path):
    """Plain torchrun ends with its own table of the failed ranks; mgpu records the error where
    torchrun reads it (TORCHELASTIC_ERROR_FILE), so the table says it, not a link to torch's
    docs on enabling tracebacks."""
    run_dir = tmp_path / "run"
    proc = run_train(["optim.lrr=1e-3", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    line = one_line_under_torchrun(proc, run_dir)  # said once by mgpu, exit code 2 per rank
    # a newcomer's mistake in a key (tests/test_config.py's NEWCOMER_MISTAKES[0]), named
    assert "optim.lrr='1e-3'" in line and "did you mean optim.lr=1e-3" in line, line
    assert not (tmp_path / "outputs").exists()  # nor a run directory of another name
    error = line.removeprefix("mgpu: ")
    report = proc.stderr[proc.stderr.index("Root Cause") :].splitlines()
    assert f"  traceback : {error}" in report, proc.stderr
    assert "To enable traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.count(f"traceback : {error}") == 2, proc.stderr  # each rank's entry


def test_a_run_directory_on_a_read_only_filesystem_is_one_line(tmp_path):
    """A read-only tmpfs mounted in a user and mount namespace of the run's own (no privileges
    needed where the kernel allows unprivileged user namespaces)."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rm", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip("needs unshare -rm (user and mount namespaces) to mount a read-only tmpfs")
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    command, env = train_command([f"hydra.run.dir={frozen / 'run'}"], nproc=None)
    script = f'mount -t tmpfs -o ro tmpfs "{frozen}" && exec "$@"'
    proc = subprocess.run(
        [unshare, "-rm", "sh", "-c", script, "sh", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"{frozen} is on a read-only filesystem" in lines[0], lines[0]
    assert "choose a run directory that can be written: hydra.run.dir=PATH" in lines[0], lines[0]


def start_in_its_own_group(args: list[str], tmp: Path, nproc: int | None, env=None):
    """train.py started as from a terminal: in a process group of its own (the one a terminal's
    Ctrl-C signals), SIGINT at its default action; `env` added to its environment."""
    command, env = train_command(args, nproc=nproc, env=env)
    log = open(tmp / "out.txt", "w")  # noqa: SIM115 - closed by the caller's wait
    return subprocess.Popen(
        command,
        cwd=tmp,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.mark.parametrize("nproc", [None, 2], ids=["python", "torchrun"])
def test_ctrl_c_says_the_step_and_the_newest_checkpoint_in_one_line(tmp_path, nproc):
    run_dir = tmp_path / "run"
    args = ["trainer.max_steps=100000", "ckpt.every=2", "trainer.eval_every=0"]
    args += ["model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.vocab_size=256"]
    # A DataLoader worker in the plain run: its fork server (an interpreter that imports torch,
    # one per training process) meets the Ctrl-C as it would in each process under torchrun,
    # where it would add two such interpreters and check nothing more.
    args += [f"data.num_workers={1 if nproc is None else 0}", f"hydra.run.dir={run_dir}"]
    proc = start_in_its_own_group(args, tmp_path, nproc)
    # Any checkpoint: with ckpt.every=2 the first one may be gone (ckpt.keep_last) before a
    # look at it, and a wait for that one alone could wait for ever.
    while not list(run_dir.glob("checkpoints/step-*/manifest.json")) and proc.poll() is None:
        time.sleep(0.2)  # waiting for the first checkpoint, not timing anything
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    code = proc.wait(timeout=240)
    text = (tmp_path / "out.txt").read_text()
    said = [line for line in text.splitlines() if "interrupted (Ctrl-C)" in line]
    assert len(said) == 1, text[-3000:]  # once, by rank 0
    assert "after step " in said[0] and "newest checkpoint " in said[0], said[0]
    assert str(run_dir / "checkpoints" / "step-0000") in said[0], said[0]
    assert "KeyboardInterrupt" not in text, text[-3000:]
    if nproc is None:
        assert code == 130 and "Traceback" not in text, text[-3000:]
