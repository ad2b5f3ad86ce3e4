"""Checkpoints that cannot be saved or used stop the run in one line instead of losing it: every
save failing (a full disk) stops after ckpt.max_failed_saves in a row, and ckpt.resume=auto
over a run directory whose checkpoints are all invalid stops instead of starting again from
step 0; ckpt.resume=never starts afresh there, as asked."""

from pathlib import Path

import pytest
import torch
from conftest import read_scalars, run_train, said_lines

from mgpu.ckpt.checkpoint import CheckpointError

SMALL = [
    "model.vocab_size=256",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "data.num_workers=0",
]


def output(proc) -> str:
    return proc.stdout + proc.stderr


def test_saves_failing_in_a_row_stop_the_run_naming_the_directory_and_free_space(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    # A file where the checkpoints directory goes: every save fails, as on a full disk.
    (run_dir / "checkpoints").write_text("not a directory")
    args = [*SMALL, "trainer.max_steps=12", "ckpt.every=2", "ckpt.max_failed_saves=3"]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, timeout=180)
    text = output(proc)
    said = [line for line in said_lines(proc) if "the last 3 saves failed" in line]
    assert proc.returncode != 0 and len(said) == 1, text[-3000:]
    assert str(run_dir / "checkpoints") in said[0] and " MiB free there" in said[0], said[0]
    # none saved: nothing to resume from elsewhere, so not advised
    assert said[0].endswith("or start again elsewhere (hydra.run.dir=PATH)"), said[0]
    # stopped at the third failed save (step 6), not trained on to the end with none saved
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]][-1] == 6


def damaged_run_dir(run_dir: Path, steps: list[int]) -> None:
    """A run directory as a 2-rank run leaves it, made here: checkpoints at `steps` written by
    mgpu's own writer (what fit calls, mgpu.ckpt.write), then damaged on disk (their shared
    state no longer matches the manifest), and the run's loss logged at steps 1 to 4."""
    from torch.utils.tensorboard import SummaryWriter

    from mgpu.ckpt.write import finalize, write_rank_files

    root = run_dir / "checkpoints"
    for step in steps:
        for rank in (0, 1):
            write_rank_files(root, step, rank, {"step": step, "rank": rank}, token="first")
        path = finalize(root, step, 2, {"step": step}, token="first")
        (path / "state.pt").write_bytes(b"damaged")
    with SummaryWriter(run_dir) as writer:
        for step in (1, 2, 3, 4):
            writer.add_scalar("train/loss", 5.0, step)


def test_resume_auto_over_only_invalid_checkpoints_stops_and_never_starts_afresh(tmp_path):
    from mgpu.ckpt.resume import resume_point
    from mgpu.config.schema import CheckpointConfig
    from mgpu.runtime.dist import Runtime

    # The earlier run is made here, not launched: only its checkpoints' being there and invalid
    # matters to the launch below, and launching it cost two thirds of this test.
    run_dir = tmp_path / "run"
    damaged_run_dir(run_dir, [2, 4])
    args = [*SMALL, "ckpt.every=2", f"hydra.run.dir={run_dir}"]
    again = run_train([*args, "trainer.max_steps=6"], cwd=tmp_path, timeout=180)
    text = output(again)
    said = [line for line in said_lines(again) if "holds checkpoints but none is valid" in line]
    assert again.returncode != 0 and len(said) == 1, text[-3000:]
    assert "ckpt.resume=never" in said[0] and "resumed from" not in text
    # nothing trained, and the earlier run's history neither added to nor set aside
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]] == [1, 2, 3, 4]
    # ckpt.resume=never over the same directory starts afresh: where a launch starts, decided
    # by what train.py calls, here for a world of one (a save over a damaged checkpoint keeps
    # it as evidence: tests/test_checkpoint.py)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    root = run_dir / "checkpoints"
    assert resume_point(CheckpointConfig(resume="never"), root, rt)[0] is None
    with pytest.raises(CheckpointError, match="holds checkpoints but none is valid"):
        # the control: the same call for the launch's ckpt.resume=auto refuses
        resume_point(CheckpointConfig(resume="auto"), root, rt)


def test_resume_from_a_missing_path_says_it_does_not_exist(tmp_path):
    from mgpu.config.checks import ConfigError
    from mgpu.config.schema import CheckpointConfig

    missing = tmp_path / "no-such-run"
    try:
        CheckpointConfig(resume=str(missing))
    except ConfigError as err:
        said = str(err)
    assert f"ckpt.resume='{missing}'" in said or str(missing) in said, said
    assert "does not exist" in said, said
