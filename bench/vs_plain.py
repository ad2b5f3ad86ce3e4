"""mgpu's real training path against the loop a strong user writes by hand, on one GPU, in one job.

    python bench/vs_plain.py [--models gpt2_small resnet50] [--modes eager compiled]
    python bench/vs_plain.py --quick            # tiny shapes on the CPU: checks the script

plain: the 60-line loop nanoGPT popularised: the same model class, whole-model torch.compile
(compiled mode), fused AdamW/SGD with the same hyperparameters and learning-rate schedule, the
same clipping and precision, TF32 and cuDNN autotuning on, one batch of the same dataset resident
on the GPU.
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
(mgpu throughput over plain throughput per model and mode) and "ratio_best" (over the fastest
plain side timed, whole or a variant; each row names it in "best_plain").
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import subprocess
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
from bench.profile_tables import table_of  # noqa: E402
from bench.real_text import python_text, tensorboard_scalars  # noqa: E402
from mgpu.config.schema import Precision  # noqa: E402
from mgpu.data.loader import build_dataset, worker_count  # noqa: E402
from mgpu.models import build_model, repeated_blocks  # noqa: E402
from mgpu.models.loss import cross_entropy  # noqa: E402
from mgpu.optim.optimizer import lr_factor  # noqa: E402
from mgpu.run.build import build_run  # noqa: E402
from mgpu.run.config import Config, to_config  # noqa: E402
from mgpu.runtime.dist import distributed, exit_process  # noqa: E402
from mgpu.runtime.launch import default_cuda_connections  # noqa: E402
from mgpu.telemetry.mfu import peak_tflops  # noqa: E402
from mgpu.train import fp8  # noqa: E402
from mgpu.train.numerics import autocast_dtype, set_math_modes  # noqa: E402

XL = ["experiment=gpt2_xl", "data=ngram", "data.vocab_size=50304", "data.seq_len=1024"]
MODELS = {  # the runs of the fast-path issue's table
    "gpt2_small": [
        "model=gpt2_small",
        "data=ngram",
        "data.vocab_size=50304",
        "data.seq_len=1024",
        "data.batch_size=16",
    ],
    "resnet50": ["experiment=resnet50"],
    # GPT-2 XL as experiment=gpt2_xl runs it (16 sequences a micro-step, 8 micro-steps a step,
    # bf16, its activation checkpointing), on synthetic tokens of GPT-2's vocabulary; the plain
    # loop takes the same accumulation, checkpointing and precision.
    "gpt2_xl": XL,
    "gpt2_xl_fp8": [*XL, "trainer.precision=fp8"],  # the block's linear layers in fp8, both sides
}
# --loss-steps: GPT-2 XL as experiment=gpt2_xl runs it, on a token file of real text.
LOSS_MODEL = ["experiment=gpt2_xl", "trainer.compile=true"]
# Models too large for the plain loop's and mgpu's copies to share the GPU: the plain loop's
# model is freed before mgpu's run and built again after it (not interleaved in one process's
# memory; its rounds still fall before and after mgpu's).
ALONE = {"gpt2_xl", "gpt2_xl_fp8"}
# (steps a round, rounds, warm-up steps) where --steps/--rounds/--warmup are not given: an XL
# step of 8 micro-steps of 16 sequences takes ~2.7 s, and each side compiles a 48-block model.
STEPS = {"gpt2_xl": (2, 3, 2), "gpt2_xl_fp8": (2, 3, 2)}
# gpt_tiny narrowed for --quick: the script's paths do not depend on the width, and a step on
# 2 CPU cores costs a fraction of gpt_tiny's (bf16 autocast is slow on a CPU)
TINY_WIDTH = ["model.n_embd=32", "model.n_head=2"]
QUICK = {  # CPU-sized stand-ins, to check the script
    "gpt2_small": [
        "model=gpt_tiny",
        *TINY_WIDTH,
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
    # the XL run's paths (accumulation, checkpointed blocks) at gpt_tiny's depth
    "gpt2_xl": [
        "model=gpt_tiny",
        *TINY_WIDTH,
        "data.vocab_size=256",
        "data.seq_len=64",
        "data.batch_size=4",
        "data.num_workers=0",
        "trainer.grad_accum_steps=2",
        "model.activation_checkpointing=blocks",
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

    def __init__(
        self, cfg: Config, device: torch.device, compiled: bool, variant: str, max_steps: int
    ):
        graphs = ("cudagraphs", "fused_loss", "coordinate", "autotune")
        if compiled and variant in graphs and cfg.trainer.grad_accum_steps > 1:
            # as trainer.compile_mode refuses it: a replayed backward's gradients, kept as
            # .grad, are overwritten by the next micro-step's replay
            raise SystemExit(
                f"--plain-variants {variant}: replays CUDA graphs, which overwrite one "
                f"micro-step's gradients with the next's (grad_accum_steps="
                f"{cfg.trainer.grad_accum_steps}); leave it out for this model"
            )
        torch.manual_seed(cfg.trainer.seed)
        model_cfg = cfg.model
        if hasattr(model_cfg, "attention") and variant != "attention":
            model_cfg = dataclasses.replace(model_cfg, attention="torch")
        if hasattr(model_cfg, "head_loss"):
            head_loss = "fused" if variant == "fused_loss" else "logits"
            model_cfg = dataclasses.replace(model_cfg, head_loss=head_loss)
        model = build_model(model_cfg).to(device)
        if cfg.trainer.precision is Precision.fp8:
            # torchao's float8 training on the blocks' linear layers, as mgpu converts them
            model = fp8.convert(model, cfg.trainer.fp8_recipe, cfg.trainer.fp8_skip)
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
        # The run's warm-up and decay over `max_steps` (mgpu_run's, the steps its timed run
        # trains), as nanoGPT's get_lr and mgpu take them: the same rate a step on both sides,
        # so that both multiply the same kind of numbers (a plain loop built again after mgpu's
        # run starts its schedule again: XL's rates are then those of mgpu's first steps).
        # At a constant optim.lr from the first step, the plain loop's first 6 steps moved its
        # weights by ~57x the sum of rates of mgpu's warm-up (200 steps), and an H100 held at
        # its power limit (XL, 680 W, job 02:37) may clock differently on different numbers.
        self.schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_factor(s, o.warmup_steps, max_steps, o.min_lr_ratio),
        )
        self.clip = 0.0 if variant == "noclip" else cfg.trainer.grad_clip
        self.accum = cfg.trainer.grad_accum_steps  # micro-steps a step, on the same batch
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
        for _ in range(self.accum):
            with autocast:
                loss = self.forward_loss(x, y)
            (loss / self.accum if self.accum > 1 else loss).backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.schedule.step()


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


def mgpu_run(cfg_overrides: list[str], rt, steps: int, rounds: int) -> dict:
    """train.py's path for (rounds + 1) log intervals of `steps` steps; the first is warm-up."""
    overrides = [
        *cfg_overrides,
        f"trainer.max_steps={steps * (rounds + 1)}",  # as bench() gives the plain loop
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
        "loss_all": scalars.get("train/loss", []),  # (step, loss) of every interval
        "eval_loss": scalars.get("eval/loss", []),
        "tokens_per_s": timed("throughput/tokens_per_sec"),
    }


def loss_run(entry: str) -> tuple[str, list[str]]:
    """A --loss-precisions entry: "bf16" or "fp8" (that trainer.precision), or
    "LABEL:KEY=VALUE,KEY=VALUE" (those overrides, on the experiment's own precision; commas
    inside brackets belong to a list value, e.g. trainer.fp8_skip=[attn.c_proj,c_fc])."""
    label, colon, extra = entry.partition(":")
    if not colon:
        return label, [f"trainer.precision={label}"]
    overrides, depth, part = [], 0, ""
    for char in extra:
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            overrides.append(part)
            part = ""
        else:
            part += char
    overrides.append(part)
    if not label or not all("=" in o for o in overrides):
        raise SystemExit(f"--loss-precisions {entry!r}: write LABEL:KEY=VALUE[,KEY=VALUE...]")
    return label, overrides


def loss_runs(args, rt) -> dict:
    """train.py's path for --loss-steps steps on Python's sources as byte-level tokens, once per
    precision, from the same seed and data order: the losses each precision reaches and what
    each run costs (tokens/s, MFU, peak memory)."""
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        text, tokens = Path(tmp) / "python.txt", Path(tmp) / "python.bin"
        size = python_text(text, limit=2**20 if args.quick else None)
        subprocess.run(
            [sys.executable, "-m", "mgpu.data.prepare", str(text), str(tokens)],
            check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        text.unlink()
        interval = max(1, args.loss_steps // 12)
        intervals = max(1, args.loss_steps // interval)
        for entry in args.loss_precisions:
            torch.compiler.reset()
            label, setting = loss_run(entry)
            overrides = [
                *LOSS_MODEL,
                f"data.path={tokens}",
                *setting,
                f"trainer.grad_accum_steps={args.loss_accum}",
                *args.override,
            ]
            if args.quick:
                overrides += [
                    *QUICK["gpt2_xl"],
                    "data.vocab_size=auto",
                    "trainer.grad_accum_steps=1",
                    "trainer.compile_backend=aot_eager",
                ]
            cuda = rt.device.type == "cuda"
            base = mark_memory(cuda)
            run = mgpu_run(overrides, rt, interval, intervals - 1)
            final = run["loss_all"][-1] if run["loss_all"] else (None, None)
            runs[label] = {
                "overrides": setting,
                "steps": final[0],
                "train_loss_last": final[1],
                "train_loss": run["loss_all"],
                "eval_loss": run["eval_loss"][-1][1] if run["eval_loss"] else None,
                "ms_per_step": statistics.median(run["ms"]) if run["ms"] else None,
                "tokens_per_s": statistics.median(run["tokens_per_s"])
                if run["tokens_per_s"]
                else None,
                "mfu_pct": statistics.median(run["mfu_pct"]) if run["mfu_pct"] else None,
                "peak_mem_gib": peak_gib(base) if cuda else None,
                "run_s": run["run_s"],
            }
            brief = {k: v for k, v in runs[label].items() if k != "train_loss"}
            print(json.dumps({"run": label, **brief}), flush=True)
    result = {"text_bytes": size, "overrides": LOSS_MODEL, "accum": args.loss_accum, "runs": runs}
    first, *others = runs  # every run against the first given (bf16 by default)
    for label in others:
        r, base = runs[label], runs[first]
        result[f"{label}_vs_{first}"] = {
            key: r[key] / base[key] - 1 if r[key] and base[key] else None
            for key in ("train_loss_last", "eval_loss", "tokens_per_s")
        }
    return result


def kernel_table(step, steps: int = 3, top: int = 15) -> dict:
    """GPU time per step by kernel over `steps` steps of `step()` (torch.profiler), and by
    group of kernels (profile_tables.KERNEL_GROUPS): what bounds a step's MFU."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    # The GPU's activity only (as profile_tables.profiled takes it): with the host's too, each
    # compiled kernel's launch is a host event of the kernel's own name, which key_averages()
    # merges with the kernel and whose device time is the kernel's: counted twice.
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    return table_of(prof, steps, top, width=100)


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


def time_steps(step, timer: Timer, args) -> dict:
    """`step` timed as the plain loop's steps are: warm-up, then the median of --rounds."""
    timer.run(step, args.warmup)
    ms = [timer.run(step, args.steps) for _ in range(args.rounds)]
    return {
        "ms_per_step": statistics.median(ms),
        "ms_rounds": ms,
        "host_ahead_ms": timer.ahead_ms[-1] if timer.ahead_ms else 0.0,
    }


def step_only(overrides: list[str], rt, timer: Timer, x, y, args) -> dict:
    """mgpu's Trainer.train_step on the resident batch, timed as the plain loop is: mgpu's step
    without its loader, to tell the step's own cost from the input pipeline's."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = mgpu_trainer(overrides, rt, tmp)
        batches = iter(lambda: (x, y), None)
        return time_steps(lambda: trainer.train_step(batches), timer, args)


def mgpu_step_alone(overrides: list[str], rt, timer: Timer, x, y, args) -> tuple[dict, dict]:
    """For a model that has the GPU to itself (ALONE): mgpu's Trainer.train_step on the resident
    batch, timed as the plain loop's step is (step_only) and its kernels by group over one step,
    from one build of the trainer (one more compile): where the two sides' steps differ."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = mgpu_trainer(overrides, rt, tmp)
        batches = iter(lambda: (x, y), None)
        timed = time_steps(lambda: trainer.train_step(batches), timer, args)
        timed["gpu_state"] = gpu_state(rt.device)  # right after its rounds: their clock
        if not (args.profile and rt.device.type == "cuda"):
            return timed, {}
        return timed, kernel_table(lambda: trainer.train_step(batches), steps=1)


def gpu_state(device: torch.device) -> dict | None:
    """`device`'s SM clock (MHz), temperature (C) and power (W) now, from nvidia-smi, found by its
    UUID (nvidia-smi's indices ignore CUDA_VISIBLE_DEVICES); None on a CPU device or where
    nvidia-smi is absent or does not list it."""
    if device.type != "cuda":
        return None
    uuid = str(torch.cuda.get_device_properties(device).uuid).lower()
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid,clocks.sm,temperature.gpu,power.draw",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10,
        ).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 4 and fields[0].lower().removeprefix("gpu-") == uuid:
            try:
                mhz, temp, watts = (float(v) for v in fields[1:])
            except ValueError:  # "[N/A]" on GPUs that don't report one of them
                return None
            return {"sm_mhz": mhz, "temp_c": temp, "power_w": watts}
    return None


def mark_memory(cuda: bool) -> int:
    """Frees what is unreferenced and restarts the peak count: the bytes allocated now."""
    gc.collect()
    if not cuda:
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def peak_gib(base: int) -> float:
    """GiB allocated at the peak since the last reset above `base` bytes."""
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def bench(name: str, mode: str, args, rt) -> dict:
    compiled = mode == "compiled"
    if not args.quick:  # this model's step counts where the command line gave none
        steps, rounds, warmup = STEPS.get(name, (20, 5, 10))
        given = vars(args)
        args = argparse.Namespace(**given)
        args.steps = steps if given["steps"] is None else given["steps"]
        args.rounds = rounds if given["rounds"] is None else given["rounds"]
        args.warmup = warmup if given["warmup"] is None else given["warmup"]
    # Each model compiles from nothing, as in a process of its own: the plain loop's WithLoss
    # (one code object for every model) compiled for GPT-2's inputs first would otherwise be
    # recompiled for ResNet-50's with its shapes marked dynamic (torch.compile's answer to a
    # function seen with changing shapes), and the reference would run general-shape kernels:
    # 36.4-38.0 ms a step instead of ~28 (vs_plain-*-20261125-120617 and -122330).
    torch.compiler.reset()
    overrides = [*MODELS[name], f"trainer.compile={str(compiled).lower()}", *args.override]
    if args.quick:
        # mgpu's run ends in an evaluation, which this does not time: a short one (its default
        # 1000 samples were a fifth of the quick run's CPU)
        overrides += [*QUICK[name], "data.eval_samples=16"]
    cfg = to_config(compose_config(overrides))
    set_math_modes(cfg.trainer, rt.device)
    timer = Timer(rt.device)
    # The block-wise levers only differ from "whole" for models with repeated blocks (GPT).
    alone = name in ALONE
    with torch.device("meta" if alone else "cpu"):  # XL's 1.56B parameters need not exist here
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
    cuda = rt.device.type == "cuda"
    run_steps = args.steps * (args.rounds + 1)  # what mgpu_run trains: its schedule's length
    base = mark_memory(cuda)
    plains = {v: PlainLoop(cfg, rt.device, compiled, v, run_steps) for v in variants}
    x, y, data = resident_batch(cfg, plains["whole"], rt.device)
    accum = cfg.trainer.grad_accum_steps
    # tokens a step: a GPT's batch is [sequences, positions] of token ids
    tokens = x.numel() * accum if not x.is_floating_point() else None
    plain_ms: dict[str, list[float]] = {v: [] for v in variants}
    plain_ahead: dict[str, list[float]] = {v: [] for v in variants}

    states: dict[str, list[dict]] = {"plain": [], "mgpu": []}

    def plain_rounds(n: int) -> None:
        for _ in range(n):
            for v, loop in plains.items():
                plain_ms[v].append(timer.run(lambda loop=loop: loop.step(x, y), args.steps))
                plain_ahead[v].append(timer.ahead_ms[-1] if timer.ahead_ms else 0.0)
            states["plain"].append(gpu_state(rt.device))

    def warm_up() -> dict[str, float]:
        seconds = {}
        for v, loop in plains.items():  # compiles, autotunes, fills the allocator
            started = time.perf_counter()
            timer.run(lambda loop=loop: loop.step(x, y), args.warmup)
            seconds[v] = time.perf_counter() - started  # what compiling costs a user, roughly
        return seconds

    warmup_s = warm_up()
    # Half the plain loop's rounds before mgpu's run and half after, for every model: a GPU
    # that warms up under a long run lowers its clocks, and a side always timed second paid
    # for it (XL on one H100, job 02:29: mgpu's step ran the plain loop's very kernels, each
    # 2-10 % slower, after 5 minutes of the plain loop's).
    first = max(1, args.rounds // 2)
    plain_rounds(first)
    plain_peak = peak_gib(base) if cuda else None
    samples = cfg.data.batch_size * accum
    flops = getattr(plains["whole"].raw, "flops_per_sample", None)
    flops = flops(tuple(data.sample_shape)) if flops is not None else None
    row_kernels: dict[str, dict] = {}
    if args.profile and cuda and alone:
        # mgpu's Trainer can't share the GPU with the plain loop's model here, so the plain
        # loop's step is profiled now and mgpu's after its run (mgpu_step_alone). One step: all
        # of its micro-steps.
        try:
            row_kernels["plain"] = kernel_table(lambda: plains["whole"].step(x, y), steps=1)
        except Exception as err:  # noqa: BLE001 - a diagnostic: the timings still count
            print(f"profile failed: {err!r}")
    if alone:  # the plain loop's model, gradients and optimizer state leave the GPU to mgpu
        plains.clear()
        torch.compiler.reset()  # nor may its compiled graphs hold on to them
    mgpu_base = mark_memory(cuda)
    mgpu = mgpu_run(overrides, rt, args.steps, args.rounds)
    mgpu_peak = peak_gib(mgpu_base) if cuda else None
    alone_step = None
    if alone and (args.step_only or (args.profile and cuda)):
        mark_memory(cuda)  # mgpu's run has ended: its model left the GPU with it
        try:
            alone_step, kernels = mgpu_step_alone(overrides, rt, timer, x, y, args)
            row_kernels.update({"mgpu": kernels} if kernels else {})
        except Exception as err:  # noqa: BLE001 - a diagnostic: the timings still count
            print(f"mgpu's step alone failed: {err!r}")
    if alone_step is not None and alone_step.get("gpu_state"):
        states["mgpu"].append(alone_step["gpu_state"])  # right after its timed rounds
    if alone and args.rounds > first:  # the plain loop again, built and compiled anew
        torch.compiler.reset()  # mgpu's compiled graphs may hold its model: freed first
        mark_memory(cuda)
        plains = {v: PlainLoop(cfg, rt.device, compiled, v, run_steps) for v in variants}
        warm_up()  # from inductor's cache now: not what compiling costs a user
    plain_rounds(args.rounds - first)
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
            "tokens_per_s": tokens / (med / 1e3) if tokens else None,
            "peak_mem_gib": plain_peak,  # every variant's together, where there are several
            "host_ahead_ms": statistics.median(plain_ahead[v]),
            "warmup_s": warmup_s[v],
        }
    mgpu_ms = statistics.median(mgpu["ms"])
    row["mgpu"] = {
        "ms_per_step": mgpu_ms,
        "tokens_per_s": tokens / (mgpu_ms / 1e3) if tokens else None,
        "peak_mem_gib": mgpu_peak,
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
    # Against the fastest plain side timed (a variant such as cudagraphs where it beat the plain
    # whole-model compile): the loop a user would keep once they had tried it.
    best = min(row["plain"], key=lambda v: row["plain"][v]["ms_per_step"])
    row["best_plain"] = best
    row["ratio_best"] = row["plain"][best]["ms_per_step"] / row["mgpu"]["ms_per_step"]
    # right after each plain round, and after mgpu's train_step timed alone where it was (its
    # train.py run ends in an evaluation and a checkpoint: the GPU idles by then)
    row["gpu_state"] = states
    row["settings"] = {
        "batch_size": cfg.data.batch_size,
        "grad_accum_steps": accum,
        "precision": cfg.trainer.precision.value,
        "activation_checkpointing": getattr(cfg.model, "activation_checkpointing", None),
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "interleaved": not alone,
        # what was still allocated when mgpu's run began (the resident batch, and where
        # interleaved the plain loop's model, gradients and optimizer state)
        "mgpu_start_gib": mgpu_base / 2**30,
    }
    if args.step_only and not alone:
        row["mgpu_step_only"] = step_only(overrides, rt, timer, x, y, args)
    elif alone_step is not None:
        row["mgpu_step_only"] = alone_step
    if "mgpu_step_only" in row:
        print(f"mgpu train_step alone: {row['mgpu_step_only']}")
    if args.profile and cuda and alone:
        row["kernels"] = row_kernels
    elif args.profile and cuda:
        try:
            row["kernels"] = profile_both(overrides, rt, plains["whole"], x, y)
        except Exception as err:  # noqa: BLE001 - a diagnostic: the timings above still count
            print(f"profile failed: {err!r}")
            row["kernels"] = {}
    for side, table in row.get("kernels", {}).items():
        print(f"{name} {mode} {side}: GPU work {table['gpu_work_ms']:.2f} ms/step, "
              f"{table['kernels_per_step']:.0f} kernels; by group: "
              + ", ".join(f"{g} {ms:.1f}" for g, ms in table["groups_ms"].items()))  # fmt: skip
        for k in table["top"][:10]:
            print(f"   {k['ms']:8.3f} ms {k['calls']:6.1f}x  {k['kernel']}")
    plains.clear()  # the next model's memory
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["gpt2_small", "resnet50"], choices=list(MODELS)
    )
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
    parser.add_argument(
        "--steps", type=int, default=None, help="steps per round and log interval (20; XL 2)"
    )
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (5; XL 3)")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps (10; XL 2)")
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
    parser.add_argument(
        "--loss-steps",
        type=int,
        default=0,
        help="instead of the timing: train GPT-2 XL this many steps on Python's own sources per "
        "--loss-precisions, and compare the losses",
    )
    parser.add_argument(
        "--loss-precisions",
        nargs="+",
        default=["bf16", "fp8"],
        help="a trainer.precision, or LABEL:KEY=VALUE,... (those overrides); each run is "
        "compared with the first",
    )
    parser.add_argument(
        "--loss-accum", type=int, default=1, help="micro-steps a step in the loss runs"
    )
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args()
    if args.loss_steps:
        labels = [loss_run(entry)[0] for entry in args.loss_precisions]
        if len(set(labels)) != len(labels):
            parser.error(f"--loss-precisions: each run needs its own label, got {labels}")
        with distributed("auto", timeout_s=600) as rt:
            cuda = rt.device.type == "cuda"
            meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
            result = loss_runs(args, rt)
            device = meta["device"].replace(" ", "_")
            path = Path(args.out) / f"vs_plain_loss-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            body = {**meta, "command": " ".join(["python", *sys.argv]), "args": vars(args)}
            path.write_text(json.dumps({**body, **result}, indent=1))
            print(f"wrote {path}", flush=True)
            for key, diff in result.items():
                if "_vs_" in key:
                    print(f"{key}: " + ", ".join(f"{k} {v:+.2%}" if v is not None else f"{k} -"
                                                 for k, v in diff.items()))  # fmt: skip
        return
    if args.quick:  # the counts the command line left out: a few (bench() gives a GPU's)
        for key, count in (("steps", 3), ("rounds", 2), ("warmup", 2)):
            if getattr(args, key) is None:
                setattr(args, key, count)
        args.override = [*args.override, "trainer.compile_backend=aot_eager"]
    rows: list[dict] = []
    with distributed("auto", timeout_s=600) as rt:
        cuda = rt.device.type == "cuda"
        meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
        device = meta["device"].replace(" ", "_")
        path = Path(args.out) / f"vs_plain-{device}-{time.strftime('%Y%m%d-%H%M%S')}.json"
        for name in args.models:
            if args.quick and name not in QUICK:
                print(f"{name}: no CPU stand-in (--quick): skipped", flush=True)
                continue
            for mode in args.modes:
                row = bench(name, mode, args, rt)
                rows.append(row)
                keys = ("model", "mode", "ratio", "best_plain", "ratio_best")
                print(json.dumps({k: row[k] for k in keys}), flush=True)
                write(rows, meta, args, path)  # after every row: a run cut short keeps its rows
    report(rows)


def write(rows: list[dict], meta: dict, args, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    ratio = {f"{r['model']}_{r['mode']}": r["ratio"] for r in rows}
    best = {f"{r['model']}_{r['mode']}": r["ratio_best"] for r in rows}
    command = " ".join(["python", *sys.argv])
    body = {**meta, "command": command, "args": vars(args), "ratio": ratio, "ratio_best": best}
    body["rows"] = rows
    if fp8 := fp8_speedup(rows):
        body["fp8_over_bf16"] = fp8
    path.write_text(json.dumps(body, indent=1))
    print(f"wrote {path}", flush=True)


def fp8_speedup(rows: list[dict]) -> dict:
    """Per mode where both XL rows ran: fp8's throughput over bf16's, each side's own."""
    by = {(r["model"], r["mode"]): r for r in rows}
    out = {}
    for (model, mode), r in by.items():
        bf16 = by.get((model.removesuffix("_fp8"), mode))
        if model.endswith("_fp8") and bf16:
            out[f"{model}_{mode}"] = {
                "plain": bf16["plain"]["whole"]["ms_per_step"] / r["plain"]["whole"]["ms_per_step"],
                "mgpu": bf16["mgpu"]["ms_per_step"] / r["mgpu"]["ms_per_step"],
            }
    return out


def report(rows: list[dict]) -> None:
    print(f"\n{'model':<11} {'mode':<9} {'side':<18} {'ms/step':>8} {'MFU %':>6} {'ratio':>6} "
          f"{'tokens/s':>9} {'peak GiB':>8}")  # fmt: skip

    def extra(side: dict) -> str:
        tok = f"{side['tokens_per_s']:9.0f}" if side.get("tokens_per_s") else f"{'-':>9}"
        mem = side.get("peak_mem_gib")
        mem = f"{mem:8.2f}" if mem is not None else f"{'-':>8}"
        return f"{tok} {mem}"

    for r in rows:
        for v, side in r["plain"].items():
            mfu = f"{side['mfu_pct']:.1f}" if side["mfu_pct"] else "-"
            print(f"{r['model']:<11} {r['mode']:<9} {'plain ' + v:<18} {side['ms_per_step']:>8.2f} "
                  f"{mfu:>6} {'':>6} {extra(side)} "
                  f"host ahead {side['host_ahead_ms']:.1f} ms")  # fmt: skip
        m = r["mgpu"]
        mfu = f"{m['mfu_pct']:.1f}" if m["mfu_pct"] else "-"
        wait = f" data wait {m['data_wait_pct']:.2f}%" if m["data_wait_pct"] is not None else ""
        print(f"{r['model']:<11} {r['mode']:<9} {'mgpu train.py':<18} {m['ms_per_step']:>8.2f} "
              f"{mfu:>6} {r['ratio']:>6.3f} {extra(m)}{wait}")  # fmt: skip
        if r["best_plain"] != "whole":
            print(f"{r['model']:<11} {r['mode']:<9} {'':<18} against plain {r['best_plain']}: "
                  f"{r['ratio_best']:.3f}")  # fmt: skip
    for key, speed in fp8_speedup(rows).items():
        print(f"{key}: fp8 over bf16 throughput: plain {speed['plain']:.3f}x, "
              f"mgpu {speed['mgpu']:.3f}x")  # fmt: skip


if __name__ == "__main__":
    default_cuda_connections()  # as train.py: before anything asks CUDA for a device
    # Ends without the teardown of torch's communication threads, as train.py does
    # (mgpu.runtime.dist.exit_process: that teardown can abort a finished run).
    exit_process(main)
