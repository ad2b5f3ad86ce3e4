"""dist.compression=powersgd: torch's PowerSGD hook on dist.engine=torch_ddp, two gloo processes.
Its first dist.powersgd_start_step steps are plain all-reduces (the same parameters as without
compression), later ones low-rank approximations (different parameters), and the ranks' replicas
stay identical throughout."""

from __future__ import annotations

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from torch import nn

from mgpu.comm.engine import wrap_model
from mgpu.config.checks import ConfigError
from mgpu.config.schema import Compression, DistConfig, Engine

STEPS, START = 6, 3


def worker(rank: int, port: int, out: str) -> None:
    # Both runs in one pair of processes (each pair costs seconds of CPU to start), one after
    # the other on one process group: each wraps its own model, with its own hook state.
    with gloo_runtime(rank, port) as rt:
        for compression in ("none", "powersgd"):
            train(rt, rank, out, compression)


def train(rt, rank: int, out: str, compression: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 8))
    cfg = DistConfig(
        engine=Engine.torch_ddp,
        compression=Compression(compression),
        powersgd_rank=1,
        powersgd_start_step=START,
    )
    model = wrap_model(model, cfg, rt)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    steps = []
    for _ in range(STEPS):
        x = torch.randn(16, 64, generator=data)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        steps.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.save(torch.stack(steps), f"{out}/{compression}-rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compression")
    spawn(worker, free_port(), str(out))
    return {
        (c, r): torch.load(out / f"{c}-rank{r}.pt") for c in ("none", "powersgd") for r in (0, 1)
    }


def test_powersgd_is_plain_for_its_first_steps_then_compresses(runs):
    plain, compressed = runs["none", 0], runs["powersgd", 0]
    for step in range(START):
        torch.testing.assert_close(compressed[step], plain[step], rtol=1e-6, atol=1e-7)
    later = (compressed[START:] - plain[START:]).abs().max().item()
    assert later > 1e-4, later  # a rank-1 approximation of 64 x 64 gradients is not the mean


def test_powersgd_keeps_every_ranks_replica_identical(runs):
    torch.testing.assert_close(runs["powersgd", 1], runs["powersgd", 0], rtol=0, atol=0)


def test_compression_needs_torch_ddp_and_two_plain_steps():
    with pytest.raises(ConfigError, match=r"dist.compression.*dist.engine=torch_ddp"):
        DistConfig(engine=Engine.mgpu, compression=Compression.powersgd)
    with pytest.raises(ConfigError, match=r"dist.powersgd_start_step.*>= 2"):
        DistConfig(engine=Engine.torch_ddp, compression=Compression.powersgd, powersgd_start_step=1)
    with pytest.raises(ConfigError, match=r"dist.powersgd_rank"):
        DistConfig(engine=Engine.torch_ddp, compression=Compression.powersgd, powersgd_rank=0)
