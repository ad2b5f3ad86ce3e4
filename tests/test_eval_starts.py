"""Evaluation starts that cannot hang: DataLoader workers are never forks of the (threaded)
training process, and a run that starts its evaluation workers at every step finishes with
the eval losses of a run without workers. The stress version (`pytest -m stress
tests/test_eval_starts.py`, about 10 minutes on 2 CPUs) starts them thousands of times."""

import os

import pytest
import torch
from conftest import read_scalars, run_train

from mgpu.data.config import DataConfig
from mgpu.data.loader import build_dataloader
from mgpu.runtime.dist import Runtime

SMALL = ["model.vocab_size=256", "model.n_layer=1", "model.n_head=2", "model.n_embd=32"]


class _Parent(torch.utils.data.Dataset):
    """Each sample: the pid of the parent of the process that loads it."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor(os.getppid())


@pytest.mark.parametrize("train", [True, False])
def test_loader_workers_are_not_forks_of_the_process_that_iterates(train):
    """A fork of a process whose other threads may hold an interpreter lock at that instant
    (the stall clock, the parent watch, the backends' threads) can leave the child stuck in
    CPython's post-fork code; this pytest process runs threads too. Every worker, of an
    evaluation loader (started anew each evaluation) and of a training loader, has another
    parent: the fork server."""
    cfg = DataConfig(_target_="unused", batch_size=1, num_workers=2)
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    loader = build_dataloader(cfg, _Parent(), rt, seed=0, train=train, stream=False)
    for _ in range(2):  # two evaluations' worth of worker starts
        parents = {int(batch) for batch in loader}
        assert parents and os.getpid() not in parents, parents


def eval_losses(tmp_path, name: str, steps: int, workers: int) -> list[tuple[int, float]]:
    run_dir = tmp_path / name
    args = [*SMALL, f"trainer.max_steps={steps}", "trainer.eval_every=1", "ckpt.every=0"]
    args += [f"data.num_workers={workers}", "data.eval_samples=64", f"hydra.run.dir={run_dir}"]
    # A hang in an evaluation's start ends the run here (exit 70, the stall report), not in
    # the test's timeout: no step takes a second on 2 CPUs.
    args.append("trainer.stall_timeout_s=60")
    proc = run_train(args, cwd=tmp_path, timeout=60 + steps * 2)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return read_scalars(run_dir)["eval/loss"]


def evaluations_at_every_step(tmp_path, steps: int) -> None:
    """A 2-process run that starts 2 evaluation workers a rank at every step: every
    evaluation comes back, with the losses of the same run loading in the trainers."""
    got = eval_losses(tmp_path, "workers", steps, workers=2)
    assert [step for step, _ in got] == list(range(1, steps + 1))
    assert got == eval_losses(tmp_path, "in-process", steps, workers=0)


def test_evaluation_workers_started_at_every_step_all_come_back(tmp_path):
    evaluations_at_every_step(tmp_path, steps=5)


@pytest.mark.stress
def test_thousands_of_evaluation_starts_none_hangs(tmp_path, request):
    """2 ranks x 1,500 evaluations, each starting 2 workers: 6,000 worker starts. Forked from
    the trainer, about one evaluation start in 350 hung."""
    if "stress" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a stress test: run it with -m stress")
    evaluations_at_every_step(tmp_path, steps=1500)
