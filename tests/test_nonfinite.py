"""trainer.nonfinite: a NaN loss on one rank stops every rank at the same step (stop), or skips
that optimizer update on every rank and counts it (skip); 2 processes over gloo, end to end."""

import re
from pathlib import Path

import torch
from conftest import ROOT, read_scalars, run_train

from mgpu.ckpt.checkpoint import step_dir

# gpt_tiny's vocabulary and context in one narrow layer: what happens to a NaN loss does not
# depend on the model's size, and a step costs a third.
GPT = "vocab_size=256 block_size=64 n_layer=1 n_head=2 n_embd=32".split()
RUN = [
    "trainer.log_every=1",
    "trainer.eval_every=0",
    "data.num_workers=0",
    "data.eval_samples=64",
    "model=custom",
    "model._target_=tests.faults.NanGPT",
    *[f"+model.kwargs.{kv}" for kv in GPT],
]


def nan(first: int, last: int = 0, rank: int | None = None) -> list[str]:
    """NaN logits on training forwards first..last (one per step: no accumulation)."""
    args = [f"+model.kwargs.nan_from={first}", f"+model.kwargs.nan_until={last}"]
    return args + ([f"+model.kwargs.rank={rank}"] if rank is not None else [])


def output(proc) -> str:
    return proc.stdout + proc.stderr


def no_worker_traceback(proc) -> bool:
    """torchrun prints its own traceback for a failed worker; the workers print none: no frame
    of the project's own files (train.py, mgpu/, tests/), wherever the clone is and whatever
    its folder is called (torchrun's frames are in the environment's torch, which may live
    inside the clone, as .venv/ does)."""
    return not [f for f in re.findall(r'File "([^"]+)", line', output(proc)) if own_file(f)]


def own_file(path: str) -> bool:
    try:
        first = Path(path).resolve().relative_to(ROOT).parts[0]
    except ValueError:  # outside the clone
        return False
    return first in ("train.py", "mgpu", "tests")


def checkpoints(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_stop_ends_every_rank_naming_the_step_and_rank(tmp_path):
    run_dir = tmp_path / "run"
    args = [*RUN, "trainer.max_steps=20", "ckpt.every=5", *nan(7, rank=1)]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2, timeout=120)
    assert proc.returncode == 1, output(proc)[-3000:]
    assert "step 7: the loss is NaN/inf on rank 1 (trainer.nonfinite=stop)" in output(proc)
    assert no_worker_traceback(proc), output(proc)[-3000:]
    # torchrun's closing table names the stop as the root cause, not a link to its docs
    cause = proc.stderr[proc.stderr.index("Root Cause") :]
    assert "traceback : step 7: the loss is NaN/inf on rank 1" in cause, cause
    assert checkpoints(run_dir) == ["step-00000005"]  # the last good one, nothing after it
    losses = read_scalars(run_dir)["train/loss"]
    assert all(step < 7 for step, _ in losses)  # the record stops before the bad step


def test_skip_drops_the_update_on_every_rank_counts_it_and_stops_after_max_consecutive_skips(
    tmp_path,
):
    """One run, two stretches of NaN on rank 1: steps 7-9 (3 in a row, as many as allowed:
    skipped on every rank, counted, training goes on), then from step 13 on (the 4th in a row,
    step 16, stops the run)."""
    run_dir = tmp_path / "run"
    args = [*RUN, "trainer.max_steps=20", "ckpt.every=5", "trainer.nonfinite=skip"]
    args += ["trainer.max_consecutive_skips=3", *nan(7, 9, rank=1), "+model.kwargs.nan_again=13"]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2, timeout=120)
    assert proc.returncode == 1, output(proc)[-3000:]
    assert "step 7: the loss is NaN/inf on rank 1: its optimizer update was skipped" in output(proc)
    # Rank 0's loss was finite throughout, yet its optimizer took 3 updates fewer: a
    # checkpoint's optimizer state is rank 0's.
    state = torch.load(step_dir(run_dir / "checkpoints", 10) / "state.pt", weights_only=True)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {10 - 3}
    scalars = read_scalars(run_dir)
    assert scalars["train/skipped_steps"][:4] == [(7, 1.0), (8, 2.0), (9, 3.0), (13, 4.0)]
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6, 10, 11, 12]
    assert all(torch.isfinite(torch.tensor(v)) for _, v in scalars["train/loss"])
    # The stop: named in one line, no worker traceback.
    assert "step 16: the loss is NaN/inf on rank 1, 4 non-finite steps in a row" in output(proc)
    assert no_worker_traceback(proc), output(proc)[-3000:]
    # Step 15 was skipped, so its checkpoint holds the parameters after step 12: still good,
    # and the stop says so.
    assert checkpoints(run_dir) == ["step-00000005", "step-00000010", "step-00000015"]
    said = "Steps 13-16 were skipped, so a checkpoint saved since step 12 holds the parameters"
    assert said + " of step 12" in output(proc), output(proc)[-3000:]
    state = torch.load(step_dir(run_dir / "checkpoints", 15) / "state.pt", weights_only=True)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {15 - 6}


def test_ranks_that_train_apart_decide_alone(tmp_path):
    """dist.engine=none: no shared parameters, so no agreement (and no per-step collective):
    rank 1 skips its own bad steps, rank 0 takes every update."""
    run_dir = tmp_path / "run"
    args = [*RUN, "trainer.max_steps=12", "ckpt.every=0", "trainer.nonfinite=skip"]
    args += ["dist.engine=none", *nan(7, 9, rank=1)]
    proc = run_train([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path, nproc=2, timeout=120)
    assert proc.returncode == 0, output(proc)[-3000:]
    state = torch.load(step_dir(run_dir / "checkpoints", 12) / "state.pt", weights_only=True)
    assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {12}  # rank 0's
    log1 = (run_dir / "rank1.log").read_text()
    for step in (7, 8, 9):
        said = f"step {step}: the loss is NaN/inf on rank 1: its optimizer update was skipped"
        assert said in log1
    assert "NaN/inf" not in (run_dir / "rank0.log").read_text()
    # what a resume of such a run does, said before it saves anything
    assert "a checkpoint holds rank 0's alone" in (run_dir / "rank0.log").read_text()
