"""Run under torchrun on GPUs: a tiny GPT and a tiny ResNet (BatchNorm buffers, broadcast from
rank 0) trained with dist.engine=mgpu (with dist.shard_optimizer=true given "shard") and with
torch DDP from the same start on the same batches; rank 0 prints the largest difference of
parameters and buffers.
"graphs": one micro-batch a step, the mgpu runs replayed as CUDA graphs with the reduction
recorded inside (mgpu.train.graphs), and their optimizer step replayed too (mgpu.train.
update_replay), against torch DDP uncaptured; "compiled": the GPT alone,
compiled as train.py compiles it for that replay on several processes (whole, in torch's default
mode: mgpu.run.build.compiled_for), replayed with the reduction inside against the same compiled
model trained uncaptured (the reference sees the same kernels). "priority": the mgpu runs with
dist.nccl_high_priority=true (NCCL and the reducer on high-priority streams).
Used by test_reducer_gpu.py, also under TORCH_CUDA_SANITIZER=1."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mgpu.comm.engine import wrap_model  # noqa: E402
from mgpu.comm.sharded_optim import ShardedOptimizer  # noqa: E402
from mgpu.config.schema import (  # noqa: E402
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    TrainerConfig,
)
from mgpu.models import GPT, ResNet  # noqa: E402
from mgpu.optim.optimizer import build_optimizer, build_schedule  # noqa: E402
from mgpu.run.build import compiled_for  # noqa: E402
from mgpu.runtime.dist import distributed, exit_process  # noqa: E402
from mgpu.train.trainer import Trainer  # noqa: E402

GRAPHS = "graphs" in sys.argv[2:]
COMPILED = "compiled" in sys.argv[2:]
STEPS, ACCUM = int(sys.argv[1]), 1 if GRAPHS or COMPILED else 2
# Two trainings compared to 1e-5: no TF32 and no nondeterministic convolution algorithms.
torch.backends.cudnn.allow_tf32 = False
torch.backends.cudnn.deterministic = True
# "race": the negative control of the sanitizer test. The compute stream no longer waits for the
# communication stream before reading the reduced gradients, a race the sanitizer must report.
RACE = "race" in sys.argv[2:]
# "shard": the mgpu runs with dist.shard_optimizer=true (reduce-scatter, all-gather;
# mgpu.comm.shard)
SHARD = "shard" in sys.argv[2:]
PRIORITY = "priority" in sys.argv[2:]


def _finish_without_waiting(self) -> None:
    with torch.cuda.stream(self.stream):
        self._wait_all()
    self._reset()
    self.step_done = True


if RACE:
    from mgpu.comm.reducer import GradReducer  # noqa: E402

    GradReducer._finish_reductions = _finish_without_waiting


def batch(model: str, g: torch.Generator, device: torch.device) -> list:
    if model == "gpt":
        tokens = torch.randint(0, 64, (ACCUM, 4, 17), device=device, generator=g)
        return [(t[:, :-1], t[:, 1:]) for t in tokens]
    images = torch.randn(ACCUM, 4, 3, 16, 16, device=device, generator=g)
    labels = torch.randint(0, 10, (ACCUM, 4), device=device, generator=g)
    return list(zip(images, labels, strict=True))


def train(name: str, engine: Engine, rt, graphs: bool = False, compiled: bool = False) -> dict:
    torch.manual_seed(0)
    if name == "gpt":
        model = GPT(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
    else:
        model = ResNet(num_classes=10, block="basic", layers=[1, 1, 1, 1], width=8)
    model = model.to(rt.device)
    # tiny buckets: many buckets in flight at once, the hardest case for stream ordering
    shard = SHARD and engine is Engine.mgpu
    high = PRIORITY and engine is Engine.mgpu
    dcfg = DistConfig(
        engine=engine, bucket_cap_mb=0.01, shard_optimizer=shard, nccl_high_priority=high
    )
    if compiled:  # as train.py compiles it for the captured step, in both runs
        replayed = TrainerConfig(precision=Precision.fp32, compile=True, cuda_graphs=True)
        model = compiled_for(replayed, dcfg, model, rt.device, rt.distributed)
    # GPT with AdamW, the ResNet with SGD and momentum: both fused optimizers a replay records
    kind = OptimizerName.adamw if name == "gpt" else OptimizerName.sgd
    ocfg = OptimConfig(name=kind, lr=1e-3, warmup_steps=0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    model = wrap_model(model, dcfg, rt)
    if high and rt.is_primary:  # the reducer's stream (NCCL's own streams cannot be read)
        print(f"{name}: reducer stream priority={model.reducer.stream.priority}")
    if shard:
        optimizer = ShardedOptimizer(optimizer, model.reducer.shards)
    schedule = build_schedule(ocfg, optimizer, STEPS)
    tcfg = TrainerConfig(
        grad_accum_steps=ACCUM,
        precision=Precision.fp32,
        compile=compiled,
        cuda_graphs=graphs,
        replay_update="auto",  # replayed where the step's backward replays with its reductions
    )
    trainer = Trainer(tcfg, model, optimizer, schedule, rt)
    if graphs and rt.is_primary:  # what ran: the capture with the reduction inside
        loss = trainer.forward_loss
        print(f"{name}: {type(loss).__name__} reduces={getattr(loss, 'reduces', False)}")
    g = torch.Generator(device=rt.device).manual_seed(rt.rank)
    for _ in range(STEPS):
        trainer.train_step(iter(batch(name, g, rt.device)))
    if graphs and rt.is_primary:  # trainer.replay_update=auto: the update replayed as well
        print(f"{name}: update replayed={trainer.update.replayed()}")
    state = model.module.state_dict()
    return {f"{name}.{k}": v.detach().double().clone() for k, v in state.items()}


def main() -> None:
    with distributed("nccl", timeout_s=120) as rt:
        mine, ddp = {}, {}
        for name in ("gpt",) if COMPILED else ("gpt", "resnet"):
            if COMPILED:  # the reference: the same compiled model, uncaptured
                mine.update(train(name, Engine.mgpu, rt, graphs=True, compiled=True))
                ddp.update(train(name, Engine.mgpu, rt, compiled=True))
                continue
            mine.update(train(name, Engine.mgpu, rt, graphs=GRAPHS))
            ddp.update(train(name, Engine.torch_ddp, rt))
        # Rank 0's values, buffers included (rank 1's last statistics are its own under DDP).
        diff = max((mine[k] - v).abs().max().item() for k, v in ddp.items())
        scale = max(v.abs().max().item() for v in ddp.values() if v.is_floating_point())
        if rt.is_primary:
            print(f"max_abs_diff={diff:.3e} max_abs_param={scale:.3e}")


# Ends without the teardown of torch's communication threads, as train.py does: a process
# that captured NCCL collectives in CUDA graphs hung there once its work was done.
exit_process(main)
