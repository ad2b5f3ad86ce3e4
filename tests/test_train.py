"""The main job as users run it: `torchrun --nproc_per_node=2 train.py` on CPU/gloo."""

import math
import subprocess
from pathlib import Path

import pytest
from conftest import FAST, read_scalars, run_train

TAGS = [
    "train/loss",
    "train/lr",
    "eval/loss",
    "time/step_ms",
    "time/data_wait_ms",
    "time/data_wait_pct",
    "time/exposed_comm_ms",
    "time/exposed_comm_pct",
    "time/no_comm_efficiency",
    "time/data_host_wait_ms",
    "throughput/samples_per_sec",
    "throughput/samples_per_sec_per_device",
    "throughput/tokens_per_sec",
    "throughput/tokens_per_sec_per_device",
]


# A quarter of data.batch_size's default: the run's 40 steps take a third of the time on 2 CPUs,
# and its loss still falls by more than twice what the test asks.
BATCH = 8


def test_two_process_run_trains_and_writes_one_run_directory(tmp_path):
    proc = run_train([*FAST, f"data.batch_size={BATCH}"], cwd=tmp_path, nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dirs = [p for p in (tmp_path / "outputs").glob("*/*") if p.is_dir()]
    assert len(run_dirs) == 1, run_dirs  # both ranks resolved the same directory
    run_dir = run_dirs[0]
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # rank 0 writes, rank 1 not
    assert (run_dir / "config.yaml").read_text().count("max_steps: 40") == 1
    assert (run_dir / "rank0.log").exists() and (run_dir / "rank1.log").exists()

    scalars = read_scalars(run_dir)
    for tag in TAGS:
        assert tag in scalars, f"{tag} missing; have {sorted(scalars)}"
    assert [s for s, _ in scalars["train/loss"]] == [10, 20, 30, 40]
    losses = [v for _, v in scalars["train/loss"]]
    assert losses[-1] < losses[0] - 0.5, losses  # starts near ln(256) = 5.55
    evals = [v for _, v in scalars["eval/loss"]]
    assert [s for s, _ in scalars["eval/loss"]] == [20, 40]
    assert evals[-1] < math.log(256) - 0.5, evals
    # tokens/s = samples/s x seq_len, and the per-device rate is the global one over 2 ranks
    for (_, samples), (_, tokens), (_, per_dev) in zip(
        scalars["throughput/samples_per_sec"],
        scalars["throughput/tokens_per_sec"],
        scalars["throughput/samples_per_sec_per_device"],
        strict=True,
    ):
        assert math.isclose(tokens, samples * 64, rel_tol=1e-4)
        assert math.isclose(per_dev, samples / 2, rel_tol=1e-4)
    # samples/s x step time = the global batch (BATCH per rank x 2 ranks)
    for (_, samples), (_, step_ms) in zip(
        scalars["throughput/samples_per_sec"], scalars["time/step_ms"], strict=True
    ):
        assert math.isclose(samples * step_ms / 1e3, BATCH * 2, rel_tol=1e-3)
    # On CPU the data wait is host time inside the step: a share of the step time
    for (_, wait_ms), (_, pct), (_, step_ms) in zip(
        scalars["time/data_wait_ms"],
        scalars["time/data_wait_pct"],
        scalars["time/step_ms"],
        strict=True,
    ):
        assert 0 < wait_ms < step_ms and math.isclose(pct, 100 * wait_ms / step_ms, rel_tol=1e-3)
    # the step against itself without its exposed communication, in TensorBoard and the line
    for (_, eff), (_, exposed), (_, step_ms) in zip(
        scalars["time/no_comm_efficiency"],
        scalars["time/exposed_comm_ms"],
        scalars["time/step_ms"],
        strict=True,
    ):
        assert math.isclose(eff, (step_ms - exposed) / step_ms, rel_tol=1e-4)
    assert "loss" in proc.stdout and "tokens/s" in proc.stdout  # rank 0's progress line
    assert "ms exposed" in proc.stdout and "of no-comm" in proc.stdout


@pytest.fixture(scope="module")
def solo_image_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    """`python train.py` without torchrun, on an image model with accumulation and SGD: one
    launch for the two tests below (a world of one, and the image run), which check different
    things of it. The second rank's share of the global batch is the two-process run's check."""
    run_dir = tmp_path_factory.mktemp("solo") / "img"
    proc = run_train(
        [
            "model=resnet_tiny",
            "data=images",
            "optim=sgd",
            "data.batch_size=16",
            "trainer.grad_accum_steps=2",
            "trainer.max_steps=6",
            "trainer.log_every=3",
            "trainer.eval_every=0",
            "data.eval_samples=33",
            # no worker process: train.py's DataLoader workers are tests/test_image_folder.py's
            "data.num_workers=0",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=run_dir.parent,
        nproc=None,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, run_dir


def test_python_without_torchrun_is_a_world_of_one(solo_image_run):
    proc, run_dir = solo_image_run
    assert "1 process(es)" in proc.stdout
    assert [s for s, _ in read_scalars(run_dir)["train/loss"]] == [3, 6]


def test_image_models_train_with_accumulation_and_sgd(solo_image_run):
    _, run_dir = solo_image_run
    scalars = read_scalars(run_dir)
    assert "throughput/tokens_per_sec" not in scalars  # images have no tokens
    # global batch: 16 per micro-step x 2 micro-steps x 1 process
    (_, samples) = scalars["throughput/samples_per_sec"][0]
    (_, step_ms) = scalars["time/step_ms"][0]
    assert math.isclose(samples * step_ms / 1e3, 32, rel_tol=1e-3)
    assert len(scalars["eval/loss"]) == 1
