"""What mgpu's telemetry costs: the same training loop (Trainer.fit, side-stream prefetch, mgpu
reducer when several processes) logging every step versus logging only at the end, and the
bare step with no Recorder at all, timed in interleaved rounds.

    torchrun --nproc_per_node=1 bench/telemetry_cost.py [--model gpt2_small] [--steps 50]

"Every step" pays for all of it each step: the step-breakdown events, the loss copy, the rank
all_gather, TensorBoard writes, memory counters and goodput. Rank 0 prints the table and writes
bench/results/telemetry_cost-<time>.json with the device, versions and git commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engines import MODELS, versions  # noqa: E402
from mgpu.comm.engine import MgpuDataParallel, wrap_model  # noqa: E402
from mgpu.config.schema import DistConfig, OptimConfig, OptimizerName, Precision, TrainerConfig  # noqa: E402
from mgpu.data.prefetch import DeviceLoader  # noqa: E402
from mgpu.data.sampler import (  # noqa: E402
    ShardedSampler,
    epochs,
)
from mgpu.models import GPT  # noqa: E402
from mgpu.optim.optimizer import build_optimizer, build_schedule  # noqa: E402
from mgpu.runtime.dist import distributed, exit_process  # noqa: E402
from mgpu.runtime.launch import default_cuda_connections  # noqa: E402
from mgpu.telemetry.board import TensorBoard  # noqa: E402
from mgpu.telemetry.metrics import Recorder  # noqa: E402
from mgpu.train.numerics import set_math_modes  # noqa: E402
from mgpu.train.trainer import Trainer  # noqa: E402

VARIANTS = ("log_every_step", "log_at_end", "no_recorder")
# The engines benchmark's models, and a tiny one to try the script on a CPU.
WORKLOADS = {
    **MODELS,
    "gpt_tiny": (lambda: GPT(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=128), 8,
                 64, "adamw"),
}  # fmt: skip


def dataset(name: str, n: int) -> TensorDataset:
    _, _, shape, _ = WORKLOADS[name]
    if name.startswith("gpt"):
        tokens = torch.randint(0, 256, (n, shape + 1))  # below every GPT's vocabulary
        return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())
    return TensorDataset(torch.randn(n, *shape), torch.randint(0, 1000, (n,)))


def build(name: str, rt, variant: str, board_dir: Path, steps: int):
    factory, batch, shape, optim = WORKLOADS[name]
    torch.manual_seed(0)
    model = factory().to(rt.device)
    layout = None  # the model's layout, for the model and its inputs (as build_run decides it)
    if getattr(model, "channels_last", False):
        layout = torch.channels_last
        model = model.to(memory_format=layout)
    ocfg = OptimConfig(name=OptimizerName(optim), lr=1e-4, warmup_steps=0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, max_steps=10**6)
    model = wrap_model(model, DistConfig(), rt)
    log_every = 1 if variant == "log_every_step" else steps
    tcfg = TrainerConfig(
        max_steps=steps,
        precision=Precision.bf16,
        log_every=log_every,
        stall_timeout_s=0,
        compile=False,  # the eager step, as this benchmark has always measured
        cuda_graphs=False,  # launched kernel by kernel: the host time telemetry competes with
    )
    recorder = None
    if variant != "no_recorder":
        recorder = Recorder(
            rt,
            TensorBoard(board_dir / variant, enabled=rt.is_primary),
            samples_per_step=batch * rt.world_size,
            tokens_per_sample=shape if isinstance(shape, int) else None,
            max_steps=steps,
            comm_marks=model.reducer.take_exposed if isinstance(model, MgpuDataParallel) else None,
            flops_per_sample=None,
            peak_tflops=None,
        )
    trainer = Trainer(tcfg, model, optimizer, schedule, rt, recorder=recorder)
    samples = dataset(name, batch * 8 * rt.world_size)
    sampler = ShardedSampler(len(samples), rt.rank, rt.world_size, shuffle=True, seed=0, even=True)
    pin = rt.device.type == "cuda"
    data = DataLoader(samples, batch_size=batch, sampler=sampler, pin_memory=pin, drop_last=True)
    loader = DeviceLoader(data, rt.device, memory_format=layout)
    return trainer, loader


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_fit(trainer: Trainer, loader: DeviceLoader, steps: int) -> float:
    """ms per step over `steps` steps of fit, from the host (synchronised only at both ends)."""
    trainer.start_step = trainer.step = 0  # every timed run starts a fresh fit at step 1
    trainer.cfg.max_steps = steps
    sync()
    start = time.perf_counter()
    if trainer.recorder is None:
        batches = epochs(loader)
        for step in range(1, steps + 1):
            trainer.train_step(batches, step)
        trainer.guard.settle()
    else:
        trainer.fit(loader, None)
    sync()
    return (time.perf_counter() - start) * 1e3 / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2_small", choices=list(WORKLOADS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    set_math_modes(TrainerConfig(), torch.device("cuda"))  # train.py's defaults: TF32, autotuning
    with distributed("auto", timeout_s=600) as rt, tempfile.TemporaryDirectory() as tmp:
        built = {v: build(args.model, rt, v, Path(tmp), args.steps) for v in VARIANTS}
        for trainer, loader in built.values():
            run_fit(trainer, loader, 5)  # warm-up: allocator, cuDNN autotune, buckets' order
        times: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                times[v].append(run_fit(*built[v], args.steps))
        if rt.is_primary:
            report(args, rt, times)


def report(args, rt, times: dict[str, list[float]]) -> None:
    never = statistics.median(times["log_at_end"])
    rows = []
    print(f"{'variant':<16} {'ms/step':>9} {'vs log_at_end':>14}")
    for v, samples in times.items():
        ms = statistics.median(samples)
        rows.append(
            {"variant": v, "ms_per_step": ms, "samples": samples, "vs_log_at_end": ms / never}
        )
        print(f"{v:<16} {ms:>9.2f} {ms / never:>14.4f}")
    out = args.out / f"telemetry_cost-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **(versions() if torch.cuda.is_available() else {"device": "cpu"}),
        "world_size": rt.world_size,
        "model": args.model,
        "steps": args.steps,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"written {out}")


if __name__ == "__main__":
    default_cuda_connections()  # as train.py: before anything asks CUDA for a device
    # Ends without the teardown of torch's communication threads, as train.py does
    # (mgpu.runtime.dist.exit_process: that teardown can abort a finished run).
    exit_process(main)
