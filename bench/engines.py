"""Gradient engines side by side in one torchrun job: each GPU training alone (`none`, the scaling
baseline), torch DDP (default and tuned), and mgpu's reducer, on GPT-2-small and ResNet-50.

    torchrun --nproc_per_node=2 bench/engines.py [--models gpt2_small resnet50] [--compile]
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 bench/engines.py --tag slowlink

All engines of a model are built up front and timed in interleaved rounds, so drift in the
machine's state hits them alike. Batches are random tensors already on the GPU: this measures
compute and gradient communication, not input. Rank 0 prints the table and writes
bench/results/engines-<tag>-<time>.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mgpu.comm import MgpuDataParallel, wrap_model  # noqa: E402
from mgpu.config import (  # noqa: E402
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    ReduceDtype,
    TrainerConfig,
)
from mgpu.dist import distributed  # noqa: E402
from mgpu.models import GPT, ResNet, compile_mode, compile_model  # noqa: E402
from mgpu.optim import build_optimizer, build_schedule  # noqa: E402
from mgpu.preempt import Preemption  # noqa: E402
from mgpu.trainer import Trainer, set_math_modes  # noqa: E402

ENGINES = {
    "none": DistConfig(engine=Engine.none),
    "torch_ddp": DistConfig(engine=Engine.torch_ddp),
    "torch_ddp_tuned": DistConfig(
        engine=Engine.torch_ddp, ddp_bucket_view=True, ddp_static_graph=True
    ),
    "mgpu": DistConfig(engine=Engine.mgpu),
    # levers, measured one at a time against "mgpu": the wire dtype and the bucket size
    "mgpu_bf16": DistConfig(engine=Engine.mgpu, reduce_dtype=ReduceDtype.bf16),
    "mgpu_cap10": DistConfig(engine=Engine.mgpu, bucket_cap_mb=10),
    "mgpu_cap50": DistConfig(engine=Engine.mgpu, bucket_cap_mb=50),
    "mgpu_cap100": DistConfig(engine=Engine.mgpu, bucket_cap_mb=100),
    "mgpu_ctas2": DistConfig(engine=Engine.mgpu, nccl_max_ctas=2),
    "mgpu_ctas4": DistConfig(engine=Engine.mgpu, nccl_max_ctas=4),
    "mgpu_ctas8": DistConfig(engine=Engine.mgpu, nccl_max_ctas=8),
    # BatchNorm statistics kept per rank: one collective less per step (ResNet-50), for both
    "mgpu_own_buffers": DistConfig(engine=Engine.mgpu, broadcast_buffers=False),
    "torch_ddp_tuned_own_buffers": DistConfig(
        engine=Engine.torch_ddp,
        ddp_bucket_view=True,
        ddp_static_graph=True,
        broadcast_buffers=False,
    ),
    # diagnostic: mgpu's hooks, buckets, events and stream waits with the all-reduce left out,
    # to split mgpu's overhead into its own machinery and the cost of communicating
    "mgpu_nocomm": DistConfig(engine=Engine.mgpu),
    # diagnostic: every GPU training alone, plus the one per-step collective that every
    # data-parallel engine adds on top of its gradient reduction (the non-finite agreement):
    # what a single meeting point per step costs, with no gradient traffic at all
    "none_agree": DistConfig(engine=Engine.none),
    # the reduction's NCCL kernels on a high-priority stream (ProcessGroupNCCL's
    # is_high_priority_stream): the GPU's block scheduler serves them before backward's queued
    # kernels, instead of after
    "mgpu_hipri": DistConfig(engine=Engine.mgpu),
    # diagnostic: every bucket packed into a flat buffer, a bucket of one parameter included
    # (mgpu's default reduces such a bucket in the parameter's own .grad, with no copy)
    "mgpu_packed": DistConfig(engine=Engine.mgpu),
    # with --compile: the whole model compiled as one graph, as torch DDP's engines are, so
    # every gradient appears at the end of backward (mgpu's default compiles block by block)
    "mgpu_whole_compile": DistConfig(engine=Engine.mgpu, broadcast_buffers=False),
    "torch_ddp_bf16": DistConfig(
        engine=Engine.torch_ddp, ddp_bucket_view=True, ddp_static_graph=True
    ),  # + bf16 compress hook, see build()
}
CORE = ["none", "torch_ddp", "torch_ddp_tuned", "mgpu"]

MODELS = {  # (factory, per-GPU batch, sample shape or seq len, optimizer)
    "gpt2_small": (
        lambda: GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        16,
        1024,
        "adamw",
    ),
    "resnet50": (lambda: ResNet(num_classes=1000), 128, (3, 224, 224), "sgd"),
}


class _Done:
    def wait(self) -> None:
        pass


def skip_collectives(reducer) -> None:
    """Everything the reducer does per bucket except the all-reduce (wrong math; timing only)."""
    reducer._all_reduce = lambda bucket: setattr(bucket, "work", _Done())


def make_batch(name: str, device: torch.device):
    _, batch, shape, _ = MODELS[name]
    if name.startswith("gpt"):
        tokens = torch.randint(0, 50304, (batch, shape + 1), device=device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    images = torch.randn(batch, *shape, device=device).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 1000, (batch,), device=device)


def build(name: str, engine: str, rt, use_compile: bool):
    factory, _, _, optim = MODELS[name]
    torch.manual_seed(0)
    model = factory().to(rt.device)
    if isinstance(model, ResNet):
        model = model.to(memory_format=torch.channels_last)
    ocfg = OptimConfig(name=OptimizerName(optim), lr=1e-4, warmup_steps=0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, max_steps=10**6)
    cfg = ENGINES[engine]
    # The Trainer compiles the loss when compile is on (as train.py's does) and leaves it eager
    # when off, so eager engines measure eager steps.
    tcfg = TrainerConfig(precision=Precision.bf16, grad_clip=1.0, compile=use_compile)
    if use_compile:
        mode = compile_mode(tcfg.compile_mode, tcfg.compile_backend, model, rt.device)
        if cfg.engine is Engine.mgpu and engine != "mgpu_whole_compile":
            model = compile_model(model, tcfg.compile_backend, mode)  # what train.py does
        elif cfg.engine is Engine.none:
            # The scaling baseline is the fastest single-GPU path measured (bench/vs_plain.py):
            # the whole model as one graph, replayed as CUDA graphs.
            model = torch.compile(model, mode="reduce-overhead")
        else:
            model = torch.compile(model)  # torch DDP splits the graph at its buckets itself
    model = wrap_model(model, cfg, rt)
    if engine == "torch_ddp_bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    if engine == "mgpu_nocomm":
        skip_collectives(model.reducer)
    if engine == "mgpu_hipri":  # a collective: every rank builds its engines in one order
        options = torch.distributed.ProcessGroupNCCL.Options(is_high_priority_stream=True)
        model.reducer.group = torch.distributed.new_group(backend="nccl", pg_options=options)
    if engine == "mgpu_packed":
        model.reducer.in_place = False
        model.reducer._build(list(reversed(range(len(model.reducer.params)))))
    # none_agree: ranks that train apart still agree on preemption, one collective a step
    preemption = Preemption(rt) if engine == "none_agree" else None
    trainer = Trainer(tcfg, model, optimizer, schedule, rt, preemption=preemption)
    return model, trainer


def timed(trainer: Trainer, batch, steps: int) -> tuple[float, float]:
    """ms per optimizer step on the GPU's own clock (the host waits only at the end), and how
    far ahead of the GPU the host was when it had launched the last step: the GPU work still
    queued, in ms. Near zero, the host is what bounds the step (launch-bound), not the GPU."""
    batches = iter([batch] * steps)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        trainer.train_step(batches)
    end.record()
    launched = time.perf_counter()
    end.synchronize()
    ahead_ms = (time.perf_counter() - launched) * 1e3
    return start.elapsed_time(end) / steps, ahead_ms


def profiled(trainer: Trainer, batch, steps: int, warmup: int = 2):
    """torch.profiler (CUDA activity) over `steps` training steps. Tracing starts `warmup` steps
    before the recorded ones: a profiler starts at a different moment on each rank, and an NCCL
    kernel would count that difference as its own time. The recorded window opens on an empty
    queue with the ranks together (the host is otherwise a step ahead, and the queued step's
    kernels would fall into the window), and closes once its last kernel has run."""
    from torch.profiler import ProfilerActivity, profile, schedule

    plan = schedule(wait=0, warmup=warmup, active=steps, repeat=1)  # one cycle: kept after
    batches = iter([batch] * (warmup + steps))
    with profile(activities=[ProfilerActivity.CUDA], schedule=plan) as prof:
        for i in range(warmup + steps):
            trainer.train_step(batches)
            if i == warmup - 1:
                torch.cuda.synchronize()
                torch.distributed.barrier()
                torch.cuda.synchronize()  # the barrier's own kernel stays out of the window
            if i == warmup + steps - 1:
                torch.cuda.synchronize()
            prof.step()
    return prof


def kernel_table(trainer: Trainer, batch, steps: int = 3, top: int = 25) -> dict:
    """GPU time per step by kernel (and copy/memset), from torch.profiler over `steps` steps
    taken after the timed rounds. Kernels on different streams can run at once, so the total
    is GPU work, not step time: it shows what an engine adds to the GPU's work."""
    prof = profiled(trainer, batch, steps)
    rows = [
        (e.key, e.self_device_time_total / steps / 1e3, e.count / steps)
        for e in prof.key_averages()
        if e.self_device_time_total > 0
    ]
    rows.sort(key=lambda r: -r[1])
    return {
        "gpu_work_ms": sum(ms for _, ms, _ in rows),
        "kernels_per_step": sum(n for _, _, n in rows),
        "top": [{"kernel": k[:120], "ms": ms, "calls": n} for k, ms, n in rows[:top]],
    }


def idle_table(trainer: Trainer, batch, steps: int = 3, top: int = 12) -> dict:
    """Where the GPU sits idle: from torch.profiler over `steps` steps (after the timed rounds),
    every moment between the first and the last kernel when no kernel, copy or memset runs on
    any stream of this GPU, per step, with the gaps grouped by the kernels around them (the one
    that ended before, the one that started after). A gap before a forward's first kernel is
    the host launching late. An NCCL kernel that waits for another rank counts as busy: its
    wait shows as its length in --kernels, not here."""
    from torch.autograd import DeviceType

    prof = profiled(trainer, batch, steps)
    spans = sorted(
        (e.start_ns(), e.start_ns() + e.duration_ns(), e.device_resource_id(), e.name())
        for e in prof.profiler.kineto_results.events()
        if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
    )
    every = gaps(spans, steps, top)
    # The compute stream (the busiest): its own gaps are waits on the host, on another stream
    # (the reducer's) or on a collective of its own, whatever else the GPU is doing meanwhile.
    busiest = max(every["busy_ms_by_stream"], key=every["busy_ms_by_stream"].get, default=None)
    compute = gaps([s for s in spans if str(s[2]) == busiest], steps, top)
    return {
        **every,
        "compute_stream": busiest,
        "compute_idle_ms": compute["idle_ms"],
        "compute_gaps": compute["gaps"],
        "steps": steps,
    }


def gaps(spans: list[tuple[int, int, int, str]], steps: int, top: int) -> dict:
    """GPU idle time from (start_ns, end_ns, stream, name) spans sorted by start: per step, by
    stream (busy time), and the largest groups of gaps keyed by the kernels around them."""
    busy: dict[int, float] = {}
    groups: dict[tuple[str, str], list[float]] = {}
    idle_ns, reach, last = 0, None, ""
    for start, end, stream, name in spans:
        busy[stream] = busy.get(stream, 0) + (end - start) / 1e6 / steps
        if reach is not None and start > reach:
            idle_ns += start - reach
            groups.setdefault((last[:70], name[:70]), []).append((start - reach) / 1e6)
        if reach is None or end > reach:
            reach, last = end, name
    rows = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return {
        "idle_ms": idle_ns / 1e6 / steps,
        "span_ms": (reach - spans[0][0]) / 1e6 / steps if spans else 0.0,
        "busy_ms_by_stream": {str(k): v for k, v in sorted(busy.items())},
        "gaps": [
            {"after": a, "before": b, "ms": sum(v) / steps, "count": len(v) / steps}
            for (a, b), v in rows[:top]
        ],
    }


def exposed_ms(model) -> float | None:
    if not isinstance(model, MgpuDataParallel):
        return None
    marks = model.reducer.take_exposed()
    total = sum(a.elapsed_time(b) for a, b in marks)  # all events are complete here
    return total / max(len(marks), 1)


def peak_memory_gib(name, engine, rt, use_compile, batch) -> float:
    """Peak memory of one engine: its model, optimizer, gradients, buckets and activations,
    measured above whatever was allocated before it was built."""
    gc.collect()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model, trainer = build(name, engine, rt, use_compile)
    timed(trainer, batch, 3)
    peak = (torch.cuda.max_memory_allocated() - before) / 2**30
    if isinstance(model, MgpuDataParallel):
        model.reducer.remove()  # its hooks and the parameters refer to each other
    del model, trainer
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def bench_model(name, engines, rt, args) -> list[dict]:
    batch = make_batch(name, rt.device)
    memory = {e: peak_memory_gib(name, e, rt, args.compile, batch) for e in engines}
    built = {e: build(name, e, rt, args.compile) for e in engines}
    for _model, trainer in built.values():
        timed(trainer, batch, args.warmup)
    times: dict[str, list[float]] = {e: [] for e in engines}
    ahead: dict[str, list[float]] = {e: [] for e in engines}
    exposed: dict[str, list[float]] = {e: [] for e in engines}
    for _ in range(args.rounds):
        for e in engines:
            model, trainer = built[e]
            exposed_ms(model)  # drop marks from earlier rounds
            ms, queued = timed(trainer, batch, args.steps)
            times[e].append(ms)
            ahead[e].append(queued)
            x = exposed_ms(model)
            if x is not None:
                exposed[e].append(x)
    kernels = {e: kernel_table(built[e][1], batch) for e in engines} if args.kernels else {}
    idle = {e: idle_table(built[e][1], batch) for e in engines} if args.idle else {}
    # Every rank's own median: a synchronous engine runs at its slowest rank's pace, while
    # `none` shows each GPU's (efficiency is taken against rank 0's, the one that reports).
    local = torch.tensor([statistics.median(times[e]) for e in engines], device=rt.device)
    by_rank = [torch.empty_like(local) for _ in range(rt.world_size)]
    torch.distributed.all_gather(by_rank, local)
    by_rank = torch.stack(by_rank).T.tolist()  # sync point: after timing
    _, per_gpu_batch, shape, _ = MODELS[name]
    units = per_gpu_batch * (shape if isinstance(shape, int) else 1)
    base = statistics.median(times["none"]) if "none" in times else None
    rows = []
    for e in engines:
        ms = statistics.median(times[e])
        rows.append(
            {
                "model": name,
                "engine": e,
                "step_ms": ms,
                "step_ms_all": times[e],
                "per_gpu_throughput": units / (ms / 1e3),
                "unit": "tokens/s" if isinstance(shape, int) else "images/s",
                "scaling_efficiency": base / ms if base else None,
                "peak_memory_gib": memory[e],
                "exposed_comm_ms": statistics.median(exposed[e]) if exposed[e] else None,
                "host_ahead_ms": statistics.median(ahead[e]),
                "step_ms_by_rank": by_rank[engines.index(e)],
                **({"kernels": kernels[e]} if e in kernels else {}),
                **({"idle": idle[e]} if e in idle else {}),
            }
        )
    return rows


def versions() -> dict:
    # Where the tree was copied without .git (a lent GPU machine), the caller passes it.
    commit = (
        os.environ.get("MGPU_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent
        ).stdout.strip()
    )
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout
    return {
        "device": torch.cuda.get_device_name(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "git_commit": commit + ("-dirty" if dirty.strip() else ""),
        "env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
    }


def report(rows: list[dict], meta: dict, args) -> None:
    print(
        f"\n{meta['device']} x{meta['world_size']}, torch {meta['torch']}, "
        f"NCCL {meta['nccl']}, {meta['env'] or 'default NCCL env'}"
    )
    print(
        f"{'model':<11} {'engine':<28} {'ms/step':>8} {'per GPU':>12} {'eff':>6} "
        f"{'vs best ddp':>11} {'peak GiB':>8} {'exposed ms':>10} {'host ahead ms':>13}"
    )
    for row in rows:
        ddp = [
            r["step_ms"]
            for r in rows
            if r["model"] == row["model"] and r["engine"].startswith("torch_ddp")
        ]
        ratio = min(ddp) / row["step_ms"] if ddp else None
        row["speed_vs_best_torch_ddp"] = ratio
        eff, exp = row["scaling_efficiency"], row["exposed_comm_ms"]
        print(
            f"{row['model']:<11} {row['engine']:<28} {row['step_ms']:8.2f} "
            f"{row['per_gpu_throughput']:12,.0f} {eff or 0:6.3f} {ratio or 0:11.3f} "
            f"{row['peak_memory_gib']:8.2f} {exp if exp is not None else float('nan'):10.2f} "
            f"{row['host_ahead_ms']:13.1f}"
        )
    for row in rows:
        if "kernels" in row:
            k = row["kernels"]
            print(
                f"\n{row['model']} {row['engine']}: GPU work {k['gpu_work_ms']:.2f} ms/step in "
                f"{k['kernels_per_step']:.0f} kernels and copies"
            )
            for t in k["top"][:12]:
                print(f"  {t['ms']:7.3f} ms {t['calls']:6.1f}x  {t['kernel'][:90]}")
    for row in rows:
        ranks = " ".join(f"{ms:.2f}" for ms in row["step_ms_by_rank"])
        print(f"{row['model']} {row['engine']}: ms/step by rank {ranks}")
        if "idle" in row:
            g = row["idle"]
            streams = ", ".join(f"{k}: {v:.2f}" for k, v in g["busy_ms_by_stream"].items())
            print(
                f"  GPU idle {g['idle_ms']:.3f} of {g['span_ms']:.2f} ms/step; "
                f"busy ms/step by stream {streams}"
            )
            print(f"  compute stream {g['compute_stream']} idle {g['compute_idle_ms']:.3f} ms/step")
            for t in g["compute_gaps"]:
                print(
                    f"  {t['ms']:7.3f} ms {t['count']:5.1f}x  after {t['after'][:45]!r} "
                    f"before {t['before'][:45]!r}"
                )
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    path = out / f"engines-{args.tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=CORE, choices=list(ENGINES))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile: per block for mgpu, whole model otherwise",
    )
    parser.add_argument("--tag", default="nvlink")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="after timing, profile 3 steps per engine: GPU time by kernel (in the JSON)",
    )
    parser.add_argument(
        "--idle",
        action="store_true",
        help="after timing, profile 3 steps per engine: where the GPU sits idle (in the JSON)",
    )
    parser.add_argument(
        "--cpu-affinity", action="store_true", help="dist.cpu_affinity: each rank its own CPUs"
    )
    args = parser.parse_args()
    set_math_modes(TrainerConfig(), torch.device("cuda"))  # train.py's defaults: TF32, autotuning
    with distributed("nccl", timeout_s=600, cpu_affinity=args.cpu_affinity) as rt:
        rows = [row for name in args.models for row in bench_model(name, args.engines, rt, args)]
        if rt.is_primary:
            meta = {
                **versions(),
                "world_size": rt.world_size,
                "compile": args.compile,
                "cpu_affinity": args.cpu_affinity,
                "command": " ".join(["torchrun", f"--nproc_per_node={rt.world_size}", *sys.argv]),
                "steps": args.steps,
                "rounds": args.rounds,
            }
            report(rows, meta, args)


if __name__ == "__main__":
    main()
