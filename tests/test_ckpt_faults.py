"""Checkpoints that cannot be saved or used stop the run in one line instead of losing it: every
save failing (a full disk) stops after ckpt.max_failed_saves in a row, and ckpt.resume=auto
over a run directory whose checkpoints are all invalid stops instead of starting again from
step 0; ckpt.resume=never starts afresh there, as asked."""

from conftest import read_scalars, run_train, said_lines

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
    # stopped at the third failed save (step 6), not trained on to the end with none saved
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]][-1] == 6


def test_resume_auto_over_only_invalid_checkpoints_stops_and_never_starts_afresh(tmp_path):
    run_dir = tmp_path / "run"
    args = [*SMALL, "ckpt.every=2", f"hydra.run.dir={run_dir}"]
    first = run_train([*args, "trainer.max_steps=4"], cwd=tmp_path, timeout=180)
    assert first.returncode == 0, output(first)[-3000:]
    saved = sorted((run_dir / "checkpoints").glob("step-*"))
    assert len(saved) == 2
    for step_dir in saved:  # damaged on disk: their checksums no longer match
        (step_dir / "state.pt").write_bytes(b"damaged")
    again = run_train([*args, "trainer.max_steps=6"], cwd=tmp_path, timeout=180)
    text = output(again)
    said = [line for line in said_lines(again) if "holds checkpoints but none is valid" in line]
    assert again.returncode != 0 and len(said) == 1, text[-3000:]
    assert "ckpt.resume=never" in said[0] and "resumed from" not in text
    assert [step for step, _ in read_scalars(run_dir)["train/loss"]] == [1, 2, 3, 4]
    fresh = run_train([*args, "trainer.max_steps=2", "ckpt.resume=never"], cwd=tmp_path)
    assert fresh.returncode == 0, output(fresh)[-3000:]
    assert "resumed from" not in output(fresh)


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
