"""Checkpoints of dist.shard_optimizer=true runs, end to end under torchrun: a worker killed with
SIGKILL resumes and ends bit for bit like an uninterrupted sharded run; a checkpoint saved by 2
sharded processes resumes on 1 unsharded and on 4 sharded processes (one checkpoint format)."""

import pytest
import torch
from conftest import run_train
from test_resume import (
    RUN,
    assert_same_run,
    faulty,
    final_state,
    output,
    run_restartable,
    uninterrupted_run,
)

from mgpu.ckpt.checkpoint import step_dir

SHARDED = [*RUN, "dist.shard_optimizer=true"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted sharded run: 2 processes, 20 steps, checkpoints at 5, 10, 15, 20."""
    return uninterrupted_run(tmp_path_factory.mktemp("sharded_reference"), SHARDED)


def test_a_killed_sharded_worker_restarts_and_ends_like_an_uninterrupted_run(tmp_path, reference):
    marker = tmp_path / "killed"
    run_dir = tmp_path / "run"
    kill = faulty("kill", rank=1, step=13, marker=marker)
    proc = run_restartable([*SHARDED, *kill, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, output(proc)[-3000:]
    assert marker.exists()  # rank 1 did die, at step 13
    assert "resumed from " + str(step_dir(run_dir / "checkpoints", 10)) in output(proc)
    assert_same_run(run_dir, reference)


def test_the_sharded_checkpoint_holds_the_unsharded_optimizer_format(reference):
    state = final_state(reference)
    params = dict(state["model"])
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]  # optim/adamw's, matrices only
    count = sum(len(g["params"]) for g in groups)
    assert sorted(state["optimizer"]["state"]) == list(range(count))
    shapes = sorted(tuple(v.shape) for v in params.values() if v.dim() > 0)
    saved = sorted(tuple(s["exp_avg"].shape) for s in state["optimizer"]["state"].values())
    # every trainable parameter's moments, whole (the tied embedding once)
    assert set(saved) <= set(shapes) and len(saved) == count
    assert all(s["step"].item() == 20 for s in state["optimizer"]["state"].values())


@pytest.mark.parametrize(
    ("nproc", "sharding"), [(None, "false"), (4, "true")], ids=["1_unsharded", "4_sharded"]
)
def test_a_sharded_checkpoint_resumes_on_another_number_of_processes(
    tmp_path, reference, nproc, sharding
):
    run_dir = tmp_path / "run"
    never = faulty("kill", rank=-1, step=1, marker=tmp_path / "unused")
    start = step_dir(reference / "checkpoints", 10)
    proc = run_train(
        [
            *RUN,
            *never,
            f"dist.shard_optimizer={sharding}",
            f"ckpt.resume={start}",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=tmp_path,
        nproc=nproc,
    )
    assert proc.returncode == 0, output(proc)[-3000:]
    assert f"saved by 2 process(es), this run has {nproc or 1}" in output(proc)
    assert "resumed from " + str(start) in output(proc)
    got = final_state(run_dir)
    assert got["step"] == 20
    # It trained on from the saved moments: Adam's step counts went on from 10, not from 0.
    steps = {s["step"].item() for s in got["optimizer"]["state"].values()}
    assert steps == {20.0}
    for name, tensor in got["model"].items():
        assert torch.isfinite(tensor).all(), name
