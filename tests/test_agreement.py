"""A training step meets the other ranks once besides its gradient buckets: the non-finite
verdict and the preemption flag share one collective. Counted on two gloo processes from the
profiler's record of c10d operations over Trainer.fit (the whole loop, preemption included), as
the difference between a longer and a shorter run, so that start-up, the last step's logging
and the final settling cancel out; the model's gradients fill one bucket."""

from pathlib import Path

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils.data import DataLoader, TensorDataset

from mgpu.comm.engine import wrap_model
from mgpu.config.schema import (
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    TrainerConfig,
)
from mgpu.data.sampler import ShardedSampler
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.runtime.preempt import Preemption
from mgpu.telemetry.board import TensorBoard
from mgpu.telemetry.metrics import Recorder
from mgpu.train.trainer import Trainer

STEPS = 3
CASES = {  # name: (engine, with a Preemption)
    "mgpu": (Engine.mgpu, True),
    "none_preemptible": (Engine.none, True),
    "none": (Engine.none, False),
}


def collectives_in_fit(rt, engine: Engine, preemptible: bool, steps: int) -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    ocfg = OptimConfig(name=OptimizerName.adamw, warmup_steps=0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, max_steps=steps)
    dcfg = DistConfig(engine=engine, bucket_cap_mb=1e3, first_bucket_mb=1e3)  # one bucket
    model = wrap_model(model, dcfg, rt)
    # Logging only at the last step, no evaluation, no checkpoints.
    tcfg = TrainerConfig(
        precision=Precision.fp32, max_steps=steps, log_every=10**6, stall_timeout_s=0
    )
    board = TensorBoard(Path("."), enabled=False)
    recorder = Recorder(rt, board, samples_per_step=8, tokens_per_sample=None, max_steps=steps)
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 4, (64,)))
    sampler = ShardedSampler(len(data), rt.rank, rt.world_size, shuffle=True, seed=0, even=True)
    loader = DataLoader(data, batch_size=4, sampler=sampler)
    with Preemption(rt) as preemption:
        stop = preemption if preemptible else None
        trainer = Trainer(tcfg, model, optimizer, schedule, rt, recorder=recorder, preemption=stop)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            trainer.fit(loader, None)
    return sum(e.name.startswith("c10d::") for e in prof.events())


def collectives_per_step(rt, engine: Engine, preemptible: bool) -> float:
    more = collectives_in_fit(rt, engine, preemptible, 4 + STEPS)
    return (more - collectives_in_fit(rt, engine, preemptible, 4)) / STEPS


def worker(rank: int, port: int, out: str):
    with gloo_runtime(rank, port, 2) as rt:
        counts = {name: collectives_per_step(rt, *case) for name, case in CASES.items()}
        torch.save(counts, f"{out}/{rank}.pt")


@pytest.fixture(scope="module")
def counts(tmp_path_factory):
    out = tmp_path_factory.mktemp("agreement")
    spawn(worker, free_port(), str(out), nprocs=2)
    return [torch.load(out / f"{rank}.pt", weights_only=True) for rank in (0, 1)]


def test_a_step_is_one_bucket_and_one_agreement(counts):
    for per_rank in counts:
        assert per_rank["mgpu"] == 2  # the gradient bucket's all_reduce + the agreement


def test_ranks_that_train_apart_meet_only_to_agree_on_preemption(counts):
    for per_rank in counts:
        assert per_rank["none_preemptible"] == 1
        assert per_rank["none"] == 0  # the scaling baseline: no per-step collective at all
