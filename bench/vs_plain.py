"""mgpu's real training path against the loop a strong user writes by hand, on one GPU, in one job.

    python bench/vs_plain.py [--models gpt2_small resnet50] [--modes eager compiled]
    python bench/vs_plain.py --quick            # tiny shapes on the CPU: checks the script

plain: the 60-line loop nanoGPT popularised: the same model class, whole-model torch.compile
(compiled mode), fused AdamW/SGD with the same hyperparameters, the same clipping and precision,
TF32 and cuDNN autotuning on, one batch of the same dataset resident on the GPU.
mgpu: `Trainer.fit` built by mgpu.run.build.build_run from the same Hydra config, as train.py builds
it (DataLoader workers, side-stream prefetcher, non-finite guard, telemetry, LR schedule, clipping,
a final evaluation and checkpoint after the timed steps); its step time is what its own telemetry
wrote to TensorBoard (time/step_ms per log interval), the figure a user sees. Eager mode is
train.py's with trainer.compile=false: the uncompiled model replayed as CUDA graphs by
trainer.cuda_graphs=auto (`--override trainer.cuda_graphs=false` launches every kernel).

Order per model and mode: plain rounds, then mgpu's run (one interval per round after a warm-up
interval), then plain rounds again, so that drift in the machine's state falls on both sides.
Plain variants (--plain-variants) are levers timed in the same rounds (PlainLoop says what each
does).
Writes bench/results/vs_plain-<device>-<time>.json with a top-level "ratio" object
(mgpu throughput over plain throughput per model and mode).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.engines import versions  # noqa: E402
from mgpu.data.loader import build_dataset, worker_count  # noqa: E402
from mgpu.models import build_model, repeated_blocks  # noqa: E402
from mgpu.models.loss import cross_entropy  # noqa: E402
from mgpu.run.build import build_run  # noqa: E402
from mgpu.run.config import Config, to_config  # noqa: E402
from mgpu.runtime.dist import distributed, exit_process  # noqa: E402
from mgpu.telemetry.mfu import peak_tflops  # noqa: E402
from mgpu.train.numerics import autocast_dtype, set_math_modes  # noqa: E402

MODELS = {  # the runs of the fast-path issue's table
    "gpt2_small": [
        "model=gpt2_small",
        "data=ngram",
        "data.vocab_size=50304",
        "data.seq_len=1024",
        "data.batch_size=16",
    ],
    "resnet50": ["experiment=resnet50"],
}
QUICK = {  # CPU-sized stand-ins, to check the script
    "gpt2_small": [
        "model=gpt_tiny",
        "data.vocab_size=256",
        "data.seq_len=64",
        "data.batch_size=4",
        "data.num_workers=0",
    ],
    "resnet50": [
        "model=resnet_tiny",
        "data.num_classes=10",
        "data.image_size=32",
        "data.batch_size=8",
        "data.num_workers=0",
    ],
}


def compose_config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="config", overrides=overrides)


class WithLoss(nn.Module):
    """The model and its loss in one module, as nanoGPT's forward(idx, targets) returns the
    loss: a whole-model compile then fuses the loss into the model's graph."""

    def __init__(self, model: nn.Module, loss):
        super().__init__()
        self.model, self.loss = model, loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(x), y)


class PlainLoop:
    """The hand-written loop. `variant`: whole (torch.compile of the model and its loss, the
    reference; eager when compile is off), noclip (the same without gradient clipping),
    cudagraphs (the same replayed as CUDA graphs: torch.compile's reduce-overhead mode), blocks
    (each repeated block compiled alone, the loss eager: mgpu's old compile on one process),
    blocks_loss (each block and the loss compiled as regions of their own: mgpu's compile on
    several processes), attention (the reference with the attention kernels mgpu's GPT asks
    for, `model.attention`), fused_loss (cudagraphs with GPT's head and loss fused into one
    step, `model.head_loss=fused`), coordinate (cudagraphs with inductor's coordinate-descent
    tuning of its kernels' launch configurations), autotune (torch.compile's max-autotune
    mode: Triton matrix multiplies autotuned against cuBLAS, with CUDA graphs), graphed (eager
    only: the model and its loss captured by torch.cuda.make_graphed_callables on the first
    step, its eager kernels replayed as CUDA graphs).

    The reference's GPT calls scaled_dot_product_attention as nanoGPT does, leaving the kernel
    to torch (`model.attention=torch`), and returns logits that the loop's loss reads
    (`model.head_loss=logits`): a user's own model code does neither."""

    def __init__(self, cfg: Config, device: torch.device, compiled: bool, variant: str):
        torch.manual_seed(cfg.trainer.seed)
        model_cfg = cfg.model
        if hasattr(model_cfg, "attention") and variant != "attention":
            model_cfg = dataclasses.replace(model_cfg, attention="torch")
        if hasattr(model_cfg, "head_loss"):
            head_loss = "fused" if variant == "fused_loss" else "logits"
            model_cfg = dataclasses.replace(model_cfg, head_loss=head_loss)
        model = build_model(model_cfg).to(device)
        self.channels_last = getattr(model, "channels_last", False) and device.type == "cuda"
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.raw = model
        backend = cfg.trainer.compile_backend
        step = model if variant == "fused_loss" else WithLoss(model, cross_entropy)
        if compiled and variant in ("whole", "noclip", "attention"):
            step = torch.compile(step, backend=backend)
        elif compiled and variant in ("cudagraphs", "fused_loss"):
            step = torch.compile(step, backend=backend, mode="reduce-overhead")
        elif compiled and variant == "coordinate":
            options = {"coordinate_descent_tuning": True, "triton.cudagraphs": True}
            step = torch.compile(step, backend=backend, options=options)
        elif compiled and variant == "autotune":
            step = torch.compile(step, backend=backend, mode="max-autotune")
        elif compiled:
            for block in repeated_blocks(model) or [model]:
                block.compile(backend=backend)
            if variant == "blocks_loss":
                step = WithLoss(model, torch.compile(cross_entropy, backend=backend))
        self.forward_loss = step
        # Captured on the first step, from its batch (make_graphed_callables needs samples).
        self.capture = self.graphed = not compiled and variant == "graphed"
        self.model = model
        o = cfg.optim
        if o.name.value == "adamw":
            self.optimizer = torch.optim.AdamW(
                model.parameters(),
                lr=o.lr,
                betas=tuple(o.betas),
                eps=o.eps,
                weight_decay=o.weight_decay,
                fused=True,
            )
        else:
            self.optimizer = torch.optim.SGD(
                model.parameters(),
                lr=o.lr,
                momentum=o.momentum,
                weight_decay=o.weight_decay,
                fused=True,
            )
        self.clip = 0.0 if variant == "noclip" else cfg.trainer.grad_clip
        self.amp = autocast_dtype(cfg.trainer.precision, device)
        self.device = device

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        # make_graphed_callables refuses autocast's cast cache (a replay cannot consult it).
        autocast = torch.autocast(
            self.device.type, dtype=self.amp, enabled=self.amp is not None,
            cache_enabled=False if self.graphed else None,
        )  # fmt: skip
        if self.capture:
            with autocast:
                self.forward_loss = torch.cuda.make_graphed_callables(self.forward_loss, (x, y))
            self.capture = False
        with autocast:
            loss = self.forward_loss(x, y)
        loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class Timer:
    """ms between two points of the device's work (CUDA events; host time on CPU)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ahead_ms: list[float] = []

    def run(self, fn, steps: int) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            launched = time.perf_counter()
            end.synchronize()
            # GPU work still queued when the host had launched the last step: near 0, the host
            # is what bounds the step (launch-bound), not the GPU.
            self.ahead_ms.append((time.perf_counter() - launched) * 1e3)
            return start.elapsed_time(end) / steps
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        return (time.perf_counter() - t) * 1e3 / steps


def resident_batch(cfg: Config, plain: PlainLoop, device: torch.device):
    """One batch of the run's own dataset on the device, in the model's layout and dtype."""
    data = build_dataset(cfg.data, "train")
    items = [data[i] for i in range(cfg.data.batch_size)]
    x = torch.stack([item[0] for item in items]).to(device)
    y = torch.stack([item[1] for item in items]).to(device)
    transform = getattr(data, "device_transform", None)
    if transform is not None and cfg.data.device_transform == "auto":
        x = transform(x)
    if plain.channels_last and x.dim() == 4:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y, data


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})  # board.py writes here
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mgpu_run(cfg_overrides: list[str], rt, steps: int, rounds: int) -> dict:
    """train.py's path for (rounds + 1) log intervals of `steps` steps; the first is warm-up."""
    overrides = [
        *cfg_overrides,
        f"trainer.max_steps={steps * (rounds + 1)}",
        f"trainer.log_every={steps}",
        "trainer.eval_every=0",
        "ckpt.every=0",
    ]
    dcfg = compose_config(overrides)
    cfg = to_config(dcfg)
    text = OmegaConf.to_yaml(OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"]))
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp)
        started = time.perf_counter()
        build_run(cfg, rt, run_dir, text).fit()
        run_s = time.perf_counter() - started  # compile included
        scalars = tensorboard_scalars(run_dir)

    def timed(tag: str) -> list[float]:  # the intervals after the warm-up one
        return [v for s, v in scalars.get(tag, []) if s > steps]

    parts = ("data_wait", "compute", "exposed_comm", "optimizer", "other")
    return {
        "run_s": run_s,
        "breakdown_ms": {p: statistics.median(timed(f"time/{p}_ms") or [0.0]) for p in parts},
        "ms": timed("time/step_ms"),
        "mfu_pct": timed("throughput/mfu_pct"),
        "data_wait_pct": timed("time/data_wait_pct"),
        "loss": timed("train/loss"),
    }


def kernel_table(step, steps: int = 3, top: int = 15) -> dict:
    """GPU time per step by kernel over `steps` steps of `step()` (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [
        (e.key, e.self_device_time_total / steps / 1e3, e.count / steps)
        for e in prof.key_averages()
        # kernels, copies and memsets; the ops that launched them would count them twice
        if e.self_device_time_total > 0 and not e.key.startswith(("aten::", "Optimizer."))
    ]
    rows.sort(key=lambda r: -r[1])
    return {
        "gpu_work_ms": sum(ms for _, ms, _ in rows),
        "kernels_per_step": sum(n for _, _, n in rows),
        "top": [{"kernel": k[:100], "ms": round(ms, 3), "calls": n} for k, ms, n in rows[:top]],
    }


def mgpu_trainer(overrides: list[str], rt, tmp: str):
    """mgpu's Trainer built by build_run from the run's config, for stepping by hand."""
    dcfg = compose_config([*overrides, "trainer.max_steps=100000"])
    run = build_run(to_config(dcfg), rt, Path(tmp), OmegaConf.to_yaml(dcfg.trainer))
    run.board.close()
    run.trainer.model.train()
    return run.trainer


def profile_both(overrides: list[str], rt, plain: PlainLoop, x, y) -> dict:
    """Kernel tables of the plain loop's step and mgpu's Trainer.train_step on the same resident
    batch (no loader: what each side asks of the GPU)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = mgpu_trainer(overrides, rt, tmp)
        batches = iter(lambda: (x, y), None)
        mgpu = kernel_table(lambda: trainer.train_step(batches))
    return {"plain": kernel_table(lambda: plain.step(x, y)), "mgpu": mgpu}


def step_only(overrides: list[str], rt, timer: Timer, x, y, args) -> dict:
    """mgpu's Trainer.train_step on the resident batch, timed as the plain loop is: mgpu's step
    without its loader, to tell the step's own cost from the input pipeline's."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = mgpu_trainer(overrides, rt, tmp)
        batches = iter(lambda: (x, y), None)
        timer.run(lambda: trainer.train_step(batches), args.warmup)
        ms = [timer.run(lambda: trainer.train_step(batches), args.steps) for _ in range(3)]
    return {
        "ms_per_step": statistics.median(ms),
        "ms_rounds": ms,
        "host_ahead_ms": timer.ahead_ms[-1] if timer.ahead_ms else 0.0,
    }


def bench(name: str, mode: str, args, rt) -> dict:
    compiled = mode == "compiled"
    # Each model compiles from nothing, as in a process of its own: the plain loop's WithLoss
    # (one code object for every model) compiled for GPT-2's inputs first would otherwise be
    # recompiled for ResNet-50's with its shapes marked dynamic (torch.compile's answer to a
    # function seen with changing shapes), and the reference would run general-shape kernels:
    # 36.4-38.0 ms a step instead of ~28 (vs_plain-*-20261125-120617 and -122330).
    torch.compiler.reset()
    overrides = [*MODELS[name], f"trainer.compile={str(compiled).lower()}", *args.override]
    if args.quick:
        overrides += QUICK[name]
    cfg = to_config(compose_config(overrides))
    set_math_modes(cfg.trainer, rt.device)
    timer = Timer(rt.device)
    # The block-wise levers only differ from "whole" for models with repeated blocks (GPT).
    blocks = bool(repeated_blocks(build_model(cfg.model)))
    applies = {
        "noclip": True,
        "attention": hasattr(cfg.model, "attention"),
        "fused_loss": compiled and hasattr(cfg.model, "head_loss"),
        "blocks": compiled and blocks,
        "blocks_loss": compiled and blocks,
        "graphed": not compiled and rt.device.type == "cuda",
    }
    levers = [v for v in args.plain_variants if applies.get(v, compiled)]
    variants = ["whole", *levers]
    plains = {v: PlainLoop(cfg, rt.device, compiled, v) for v in variants}
    x, y, data = resident_batch(cfg, plains["whole"], rt.device)
    plain_ms: dict[str, list[float]] = {v: [] for v in variants}
    plain_ahead: dict[str, list[float]] = {v: [] for v in variants}

    def plain_rounds(n: int) -> None:
        for _ in range(n):
            for v, loop in plains.items():
                plain_ms[v].append(timer.run(lambda loop=loop: loop.step(x, y), args.steps))
                plain_ahead[v].append(timer.ahead_ms[-1] if timer.ahead_ms else 0.0)

    warmup_s: dict[str, float] = {}
    for v, loop in plains.items():  # warm-up: compiles, autotunes, fills the allocator
        started = time.perf_counter()
        timer.run(lambda loop=loop: loop.step(x, y), args.warmup)
        warmup_s[v] = time.perf_counter() - started  # what compiling costs a user, roughly
    first = args.rounds // 2
    plain_rounds(first)
    mgpu = mgpu_run(overrides, rt, args.steps, args.rounds)
    plain_rounds(args.rounds - first)
    samples = cfg.data.batch_size
    flops = getattr(plains["whole"].raw, "flops_per_sample", None)
    flops = flops(tuple(data.sample_shape)) if flops is not None else None
    peak = None
    if rt.device.type == "cuda":
        peak = peak_tflops(torch.cuda.get_device_name(rt.device), low_precision=True)
    row = {"model": name, "mode": mode, "plain": {}, "mgpu": {}}
    for v, ms in plain_ms.items():
        med = statistics.median(ms)
        mfu = 100 * flops * samples / (med / 1e3) / (peak * 1e12) if flops and peak else None
        row["plain"][v] = {
            "ms_per_step": med,
            "ms_rounds": ms,
            "mfu_pct": mfu,
            "host_ahead_ms": statistics.median(plain_ahead[v]),
            "warmup_s": warmup_s[v],
        }
    row["mgpu"] = {
        "ms_per_step": statistics.median(mgpu["ms"]),
        "ms_rounds": mgpu["ms"],
        "mfu_pct": statistics.median(mgpu["mfu_pct"]) if mgpu["mfu_pct"] else None,
        "data_wait_pct": statistics.median(mgpu["data_wait_pct"])
        if mgpu["data_wait_pct"]
        else None,
        "loss_last": mgpu["loss"][-1] if mgpu["loss"] else None,
        "run_s": mgpu["run_s"],
        "num_workers": worker_count(cfg.data.num_workers, rt.cpu_share),
    }
    row["mgpu"]["breakdown_ms"] = mgpu["breakdown_ms"]
    row["ratio"] = row["plain"]["whole"]["ms_per_step"] / row["mgpu"]["ms_per_step"]
    if args.step_only:
        row["mgpu_step_only"] = step_only(overrides, rt, timer, x, y, args)
        print(f"mgpu train_step alone: {row['mgpu_step_only']}")
    if args.profile and rt.device.type == "cuda":
        try:
            row["kernels"] = profile_both(overrides, rt, plains["whole"], x, y)
        except Exception as err:  # noqa: BLE001 - a diagnostic: the timings above still count
            print(f"profile failed: {err!r}")
            row["kernels"] = {}
        for side, table in row["kernels"].items():
            print(f"{name} {mode} {side}: GPU work {table['gpu_work_ms']:.2f} ms/step, "
                  f"{table['kernels_per_step']:.0f} kernels")  # fmt: skip
            for k in table["top"][:10]:
                print(f"   {k['ms']:8.3f} ms {k['calls']:6.1f}x  {k['kernel']}")
    plains.clear()  # the next model's memory
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"])
    parser.add_argument(
        "--plain-variants",
        nargs="*",
        default=[],
        choices=[
            "noclip",
            "cudagraphs",
            "blocks",
            "blocks_loss",
            "attention",
            "fused_loss",
            "coordinate",
            "autotune",
            "graphed",
        ],
    )
    parser.add_argument("--steps", type=int, default=20, help="steps per round (and log interval)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--override", nargs="*", default=[], help="extra Hydra overrides")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument(
        "--step-only",
        action="store_true",
        help="also time mgpu's Trainer.train_step on the resident batch (no loader)",
    )
    parser.add_argument(
        "--profile", action="store_true", help="kernel tables of both sides' steps (GPU)"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.warmup = 3, 2, 2
        args.override = [*args.override, "trainer.compile_backend=aot_eager"]
    rows: list[dict] = []
    with distributed("auto", timeout_s=600) as rt:
        cuda = rt.device.type == "cuda"
        meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
        device = meta["device"].replace(" ", "_")
        path = Path(args.out) / f"vs_plain-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        for name in args.models:
            for mode in args.modes:
                row = bench(name, mode, args, rt)
                rows.append(row)
                print(json.dumps({k: row[k] for k in ("model", "mode", "ratio")}), flush=True)
                write(rows, meta, args, path)  # after every row: a run cut short keeps its rows
    report(rows)


def write(rows: list[dict], meta: dict, args, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ratio = {f"{r['model']}_{r['mode']}": r["ratio"] for r in rows}
    command = " ".join(["python", *sys.argv])
    body = {**meta, "command": command, "args": vars(args), "ratio": ratio, "rows": rows}
    path.write_text(json.dumps(body, indent=1))
    print(f"wrote {path}", flush=True)


def report(rows: list[dict]) -> None:
    print(f"\n{'model':<11} {'mode':<9} {'side':<18} {'ms/step':>8} {'MFU %':>6} {'ratio':>6}")
    for r in rows:
        for v, side in r["plain"].items():
            mfu = f"{side['mfu_pct']:.1f}" if side["mfu_pct"] else "-"
            print(f"{r['model']:<11} {r['mode']:<9} {'plain ' + v:<18} {side['ms_per_step']:>8.2f} "
                  f"{mfu:>6} {'':>6} host ahead {side['host_ahead_ms']:.1f} ms")  # fmt: skip
        m = r["mgpu"]
        mfu = f"{m['mfu_pct']:.1f}" if m["mfu_pct"] else "-"
        wait = f" data wait {m['data_wait_pct']:.2f}%" if m["data_wait_pct"] is not None else ""
        print(f"{r['model']:<11} {r['mode']:<9} {'mgpu train.py':<18} {m['ms_per_step']:>8.2f} "
              f"{mfu:>6} {r['ratio']:>6.3f}{wait}")  # fmt: skip


if __name__ == "__main__":
    # Ends without the teardown of torch's communication threads, as train.py does
    # (mgpu.runtime.dist.exit_process: that teardown can abort a finished run).
    exit_process(main)
