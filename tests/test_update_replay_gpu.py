"""trainer.replay_update on one GPU: the optimizer step (norm, clipping, the non-finite verdict, the
fused update) replayed as a CUDA graph updates the parameters as the same step run uncaptured,
step for step, through a schedule whose rate changes every step, for fused AdamW and for SGD with
momentum; skips a non-finite step as the uncaptured step does; and stops where a gradient is not
the tensor it captured. The gradients are written into the same tensors every step, as the
replayed backward of several processes leaves them (tests/test_reducer_gpu.py runs that whole
path against torch DDP on 2 GPUs)."""

import pytest
import torch
from torch import nn

from mgpu.config.schema import NonFinite, OptimConfig, OptimizerName, TrainerConfig
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.runtime.dist import Runtime
from mgpu.train.guard import NonFiniteGuard
from mgpu.train.update import Update, build_scaler

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
STEPS = 8


def build(kind: OptimizerName, replay: bool | str):
    """A small model and its Update, from the same weights every time: replaying (auto, told
    that the backward replays) or not (false)."""
    rt = Runtime(0, 0, 1, "gloo", torch.device("cuda"), has_process_group=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).cuda()
    params = list(model.parameters())
    ocfg = OptimConfig(name=kind, lr=0.05, warmup_steps=3, weight_decay=0.1)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, STEPS)
    cfg = TrainerConfig(replay_update=replay, grad_clip=0.5, nonfinite=NonFinite.skip)
    guard = NonFiniteGuard(cfg.nonfinite, cfg.max_consecutive_skips, rt, scaler_owns_grads=False)
    scaler = build_scaler(cfg, rt.device, torch.bfloat16, sharded=False)
    replayed = (lambda: True) if replay else None
    update = Update(cfg, params, optimizer, schedule, scaler, guard, lambda: False, None, replayed)
    return params, update, guard


def train(kind: OptimizerName, replay: bool | str, nan_at: int | None = None, swap_at=None):
    """STEPS updates from the same gradients, each step's written into the same tensors and
    made .grad again, as the replayed backward does after the update's zero_grad; the
    parameters after each step, the update and its guard. `swap_at`: from that step, .grad is a
    new tensor."""
    params, update, guard = build(kind, replay)
    fixed = [torch.zeros_like(p) for p in params]
    seen = []
    for step in range(1, STEPS + 1):
        g = torch.Generator(device="cuda").manual_seed(step)
        for p, buffer in zip(params, fixed, strict=True):
            buffer.copy_(torch.randn(p.shape, device="cuda", generator=g))
            p.grad = buffer if step != swap_at else buffer.clone()
        if step == nan_at:
            fixed[1][0] = float("nan")
        loss = torch.tensor(float("nan") if step == nan_at else 1.5, device="cuda")
        update(loss, step)
        seen.append([p.detach().clone() for p in params])
        guard.poll()
    guard.settle()
    return seen, update, guard


@pytest.mark.parametrize("kind", [OptimizerName.adamw, OptimizerName.sgd])
def test_a_replayed_update_trains_as_the_uncaptured_update(kind):
    replayed, update, _ = train(kind, "auto")
    assert update.replayed()  # the path under test did run
    uncaptured, plain, _ = train(kind, False)
    assert not plain.replayed()
    for step, (a, b) in enumerate(zip(replayed, uncaptured, strict=True), 1):
        for x, y in zip(a, b, strict=True):
            # The replay reads the rate as float32 where the uncaptured step passes a double.
            torch.testing.assert_close(x, y, msg=lambda m, s=step: f"step {s}: {m}")


def test_a_non_finite_step_is_skipped_by_the_replay_as_by_the_uncaptured_update():
    """trainer.nonfinite=skip: the replayed verdict skips the same step, leaving every
    parameter (and AdamW's moments and step count) as they were, and the host learns of it."""
    replayed, update, guard = train(OptimizerName.adamw, "auto", nan_at=5)
    assert update.replayed() and guard.skipped == 1
    uncaptured, _, plain_guard = train(OptimizerName.adamw, False, nan_at=5)
    assert plain_guard.skipped == 1
    for x, y in zip(replayed[3], replayed[4], strict=True):
        assert torch.equal(x, y)  # step 5 changed nothing
    for a, b in zip(replayed, uncaptured, strict=True):
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y)


def test_a_gradient_that_is_not_the_captured_tensor_stops_the_run():
    """A replay would read the captured tensors, not the step's gradients: it stops instead."""
    with pytest.raises(RuntimeError, match="trainer.replay_update"):
        train(OptimizerName.sgd, "auto", swap_at=5)
