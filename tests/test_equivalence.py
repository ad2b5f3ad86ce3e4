"""Data parallelism must not change the math: two gloo processes with dist.engine=torch_ddp end
each step with the parameters of one process stepping on the concatenated batch, and gradient
accumulation over 4 micro-steps equals one step on the 4x batch, communicating once per step."""

import pytest
import torch
from conftest import free_port, gloo_runtime, spawn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mgpu.comm.engine import wrap_model
from mgpu.config.schema import (
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    TrainerConfig,
)
from mgpu.models import MLP
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.runtime.dist import Runtime
from mgpu.train.trainer import Trainer

WORLD, MICRO_BATCH, STEPS = 2, 3, 3
CASES = [  # (name, grad_accum_steps, optimizer, grad_clip)
    ("ddp_sgd", 1, "sgd", 0.0),
    ("ddp_adamw_clip", 1, "adamw", 0.05),
    ("ddp_accum4_adamw_clip", 4, "adamw", 0.05),
]


def global_batches(accum: int, step: int):
    """The whole batch of one optimizer step: WORLD * accum micro-batches, deterministic."""
    g = torch.Generator().manual_seed(100 + step)
    n = WORLD * accum * MICRO_BATCH
    return torch.randn(n, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


def build(rt: Runtime, accum: int, optim: str, clip: float, engine: str):
    torch.manual_seed(0)
    model = MLP(in_features=8, num_classes=5, hidden=[16])
    ocfg = OptimConfig(name=OptimizerName(optim), lr=0.05, warmup_steps=0, weight_decay=0.01)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, max_steps=STEPS)
    model = wrap_model(model, DistConfig(engine=Engine(engine)), rt)
    tcfg = TrainerConfig(grad_accum_steps=accum, grad_clip=clip, precision=Precision.fp32)
    return model, Trainer(tcfg, model, optimizer, schedule, rt)


def count_allreduce(state, bucket):
    state["calls"] += 1
    return default_hooks.allreduce_hook(None, bucket)


def worker(rank: int, port: int, out_dir: str):
    with gloo_runtime(rank, port, WORLD) as rt:
        # first, before any other wrapping: the warnings torch DDP gives (each pair of
        # processes costs seconds of CPU to start, so one pair runs both tests' work)
        torch.save(ddp_warnings(rt), f"{out_dir}/warnings.{rank}.pt")
        for name, accum, optim, clip in CASES:
            model, trainer = build(rt, accum, optim, clip, "torch_ddp")
            calls = {"calls": 0}
            model.register_comm_hook(calls, count_allreduce)
            for step in range(STEPS):
                x, y = global_batches(accum, step)
                # micro-step m of this rank: the slice after all ranks' earlier micro-batches
                micro = [
                    ((x[s : s + MICRO_BATCH], y[s : s + MICRO_BATCH]))
                    for s in ((m * WORLD + rank) * MICRO_BATCH for m in range(accum))
                ]
                trainer.train_step(iter(micro))
            state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
            torch.save({"params": state, "calls": calls["calls"]}, f"{out_dir}/{name}.{rank}.pt")


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    spawn(worker, free_port(), str(out), nprocs=WORLD)
    return out


@pytest.mark.parametrize("name, accum, optim, clip", CASES)
def test_two_processes_match_one_process_on_the_concatenated_batch(
    ddp_results, name, accum, optim, clip
):
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    model, reference = build(rt, 1, optim, clip, "none")
    for step in range(STEPS):
        reference.train_step(iter([global_batches(accum, step)]))
    expected = model.state_dict()
    for rank in range(WORLD):
        got = torch.load(ddp_results / f"{name}.{rank}.pt", weights_only=True)
        for key, value in expected.items():
            torch.testing.assert_close(
                got["params"][key], value, rtol=1e-5, atol=1e-6, msg=f"{name}: rank {rank} {key}"
            )
        # MLP(8 -> 16 -> 5) fits in one bucket: one all-reduce per optimizer step, none on the
        # accumulation micro-steps.
        assert got["calls"] == STEPS, (name, got["calls"])


def test_the_reference_is_sensitive_to_the_batch_split(ddp_results):
    """Guard against a vacuous comparison: stepping on only half the batch must differ."""
    rt = Runtime(0, 0, 1, "gloo", torch.device("cpu"), has_process_group=False)
    model, reference = build(rt, 1, "sgd", 0.0, "none")
    for step in range(STEPS):
        x, y = global_batches(1, step)
        reference.train_step(iter([(x[:MICRO_BATCH], y[:MICRO_BATCH])]))
    got = torch.load(ddp_results / "ddp_sgd.0.pt", weights_only=True)["params"]
    assert any(not torch.allclose(got[k], v, atol=1e-6) for k, v in model.state_dict().items())


def ddp_warnings(rt) -> list[str]:
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        wrap_model(
            MLP(in_features=4, num_classes=2, hidden=[8]), DistConfig(engine=Engine.torch_ddp), rt
        )
    return [str(w.message) for w in caught if "broadcast_buffers" in str(w.message)]


def test_torch_ddp_with_mgpus_defaults_warns_nothing(ddp_results):
    """dist.broadcast_buffers=true is torch DDP's own default: mgpu leaves the argument out, which
    torch 2.13 warns about as deprecated whenever it is given (false still passes it)."""
    assert torch.load(ddp_results / "warnings.0.pt") == []
