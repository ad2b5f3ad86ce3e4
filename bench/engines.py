"""Gradient engines side by side in one torchrun job: each GPU training alone (`none`, the scaling
baseline), torch DDP (default and tuned), and mgpu's reducer, plain and with its optimizer
sharded (`mgpu_sharded`, dist.shard_optimizer), on GPT-2-small, GPT-2 XL and ResNet-50.

    torchrun --nproc_per_node=2 bench/engines.py [--models gpt2_small resnet50] [--compile]
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node=2 bench/engines.py --tag slowlink
    torchrun --nproc_per_node=2 bench/engines.py --models gpt2_xl --compile --accum 4 \
        --one-at-a-time --engines none mgpu torch_ddp torch_ddp_view
    torchrun --nproc_per_node=2 bench/engines.py --quick   # tiny shapes on the CPU: checks it

All engines of a model are built up front and timed in interleaved rounds, so drift in the
machine's state hits them alike. GPT-2 XL's engines do not fit one GPU together (each holds
25 GB of weights, gradients and AdamW moments): --one-at-a-time builds, times and frees them in
turn, in the order given, each one's rounds back to back (drift then falls between engines; the
table says so); an engine named twice is built and timed twice, its rounds pooled, so that
`--engines mgpu mgpu_nocomm mgpu_nocomm mgpu` puts drift on both alike (A-B-B-A).
--accum N: N micro-batches a step, gradients reduced on the last one, as
trainer.grad_accum_steps does. Batches are random tensors already on the GPU: this measures
compute and gradient communication, not input. Rank 0 prints the table and writes
bench/results/engines-<tag>-<time>.json (or into --out).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from profile_tables import idle_table, kernel_table  # noqa: E402  (bench/, beside this file)

from mgpu.comm.engine import MgpuDataParallel, wrap_model  # noqa: E402
from mgpu.config.checks import ConfigError  # noqa: E402
from mgpu.config.schema import (  # noqa: E402
    Compression,
    DistConfig,
    Engine,
    OptimConfig,
    OptimizerName,
    Precision,
    ReduceDtype,
    TrainerConfig,
)
from mgpu.models import GPT, ResNet, compile_mode, compile_model, repeated_blocks  # noqa: E402
from mgpu.optim.optimizer import build_optimizer, build_schedule  # noqa: E402
from mgpu.run.build import compiled_for  # noqa: E402
from mgpu.run.config import check_dist_fits_trainer  # noqa: E402
from mgpu.runtime.dist import distributed, exit_process  # noqa: E402
from mgpu.runtime.launch import default_cuda_connections  # noqa: E402
from mgpu.runtime.orphan import end_with_agent  # noqa: E402
from mgpu.runtime.preempt import Preemption  # noqa: E402
from mgpu.telemetry.stamps import StampRange  # noqa: E402
from mgpu.train.numerics import set_math_modes  # noqa: E402
from mgpu.train.trainer import Trainer  # noqa: E402


@dataclass(frozen=True)
class Lever:
    """An engine, or a lever measured against one: its dist config, and what sets it up beyond
    that, through public APIs only."""

    dist: DistConfig
    # (model, dist config, runtime) -> the model wrapped for data parallelism
    wrap: Callable[[nn.Module, DistConfig, Any], nn.Module] = wrap_model
    whole_compile: bool = False  # with --compile: the whole model as one graph
    block_compile: bool = False  # with --compile: each repeated block its own graph
    # with --compile: compiled as train.py does (whole under accumulation), and each repeated
    # block compiled too, for the micro-batch whose backward reduces (ReducingByBlocks)
    reducing_by_blocks: bool = False
    preemptible: bool = False  # a Preemption takes part: the per-step agreement runs
    graphs: bool | None = None  # trainer.cuda_graphs for this lever; None: the run's --graphs
    compile_mode: str = "auto"  # trainer.compile_mode for this lever, with --compile
    replay_update: bool | str = "auto"  # trainer.replay_update for this lever


def whole_compiled(cap_mb: float, wire: ReduceDtype = ReduceDtype.fp32) -> Lever:
    """mgpu with the whole model compiled as one graph, `cap_mb` buckets and `wire` dtype."""
    dist = DistConfig(
        engine=Engine.mgpu, broadcast_buffers=False, bucket_cap_mb=cap_mb, reduce_dtype=wire
    )
    return Lever(dist, whole_compile=True)


def ddp_bf16_compressed(model: nn.Module, cfg: DistConfig, rt) -> nn.Module:
    """torch DDP with its bf16 compression hook: half the bytes on the wire."""
    model = wrap_model(model, cfg, rt)
    model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    return model


def mgpu_without_collectives(model: nn.Module, cfg: DistConfig, rt) -> nn.Module:
    """Everything the reducer does per bucket except the all-reduce (wrong math; timing only)."""
    return MgpuDataParallel(model, rt, cfg, communicate=False)


def mgpu_own_group(high_priority: bool = False, ctas: int = 0) -> Callable:
    """The reducer in an NCCL group of its own: its kernels on a high-priority stream, or on
    exactly `ctas` CTAs (minimum and maximum; more than NCCL picks for the all-reduce that a
    model compiled whole leaves exposed after backward, where nothing else wants the SMs).
    Creating a group is a collective: every rank builds its engines in one order."""

    def wrap(model: nn.Module, cfg: DistConfig, rt) -> nn.Module:
        options = torch.distributed.ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
        if ctas:
            options.config.min_ctas = options.config.max_ctas = ctas
        group = torch.distributed.new_group(backend="nccl", pg_options=options)
        return MgpuDataParallel(model, rt, cfg, group=group)

    return wrap


class ReducingByBlocks(MgpuDataParallel):
    """The micro-batch whose backward reduces runs the model's own forward, its blocks compiled
    one by one (Lever.reducing_by_blocks), so that buckets are reduced while backward runs; the
    others run the model compiled whole, which hands its gradients over at backward's end (their
    fusions across blocks kept). A lever for accumulation (GPT-2 XL): block by block costs a
    micro-batch ~17 ms and hides the ~38 ms reduction of a step on 4 H200s (bench/README.md)."""

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() and self.training and self.reducer.sync_enabled:
            self.reducer.prepare()
            return self.module.forward(*args, **kwargs)  # past the whole-model compile
        return super().forward(*args, **kwargs)


def mgpu_reducing_by_blocks(model: nn.Module, cfg: DistConfig, rt) -> nn.Module:
    return ReducingByBlocks(model, rt, cfg)


def mgpu_packed_buckets(model: nn.Module, cfg: DistConfig, rt) -> nn.Module:
    """Every bucket packed into a flat buffer, a bucket of one parameter too."""
    return MgpuDataParallel(model, rt, cfg, in_place=False)


ENGINES = {  # name: Lever(dist config, and how it is set up beyond that)
    "none": Lever(DistConfig(engine=Engine.none)),
    "torch_ddp": Lever(DistConfig(engine=Engine.torch_ddp)),
    "torch_ddp_tuned": Lever(
        DistConfig(engine=Engine.torch_ddp, ddp_bucket_view=True, ddp_static_graph=True)
    ),
    # gradient_as_bucket_view alone: the tuning that works with gradient accumulation (torch's
    # static graph fails on the micro-steps that skip the reduction)
    "torch_ddp_view": Lever(DistConfig(engine=Engine.torch_ddp, ddp_bucket_view=True)),
    # the same with 100 MB buckets: compiled, torch DDP splits the graph at each bucket, so
    # GPT-2 XL's ~250 buckets of 25 MB are ~250 graphs to compile (scaling.py's XL job ran out
    # of time there); a user tuning XL would raise the cap
    "torch_ddp_view_cap100": Lever(
        DistConfig(engine=Engine.torch_ddp, ddp_bucket_view=True, bucket_cap_mb=100)
    ),
    "mgpu": Lever(DistConfig(engine=Engine.mgpu)),
    # trainer.cuda_graphs=true: the step replayed as CUDA graphs with the reducer's bucket
    # reductions recorded inside the backward (mgpu.train.graphs; one micro-batch a step),
    # which auto does too wherever the reductions can be recorded
    "mgpu_graphs": Lever(DistConfig(engine=Engine.mgpu), graphs=True),
    # trainer.replay_update=false: the step replayed as auto does, the optimizer step's kernels
    # launched from Python after it (the default before the update was replayed too)
    "mgpu_update_launched": Lever(DistConfig(engine=Engine.mgpu), replay_update=False),
    # trainer.cuda_graphs=false: every kernel and every bucket's all-reduce launched from Python
    "mgpu_uncaptured": Lever(DistConfig(engine=Engine.mgpu), graphs=False),
    # with --compile, a model compiled whole (ResNet-50): torch.compile's default mode rather
    # than auto's reduce-overhead, so that mgpu's capture records the model and its reductions
    "mgpu_graphs_whole": Lever(DistConfig(engine=Engine.mgpu), graphs=True, compile_mode="default"),
    # levers of the captured step, one at a time against "mgpu_graphs": its machinery without
    # the all-reduce (what capture costs beyond one GPU's), the bf16 wire, fewer NCCL CTAs (SMs
    # left to backward), larger buckets, the reductions on a high-priority stream
    "mgpu_graphs_nocomm": Lever(
        DistConfig(engine=Engine.mgpu), wrap=mgpu_without_collectives, graphs=True
    ),
    "mgpu_graphs_bf16": Lever(
        DistConfig(engine=Engine.mgpu, reduce_dtype=ReduceDtype.bf16), graphs=True
    ),
    "mgpu_graphs_ctas8": Lever(DistConfig(engine=Engine.mgpu, nccl_max_ctas=8), graphs=True),
    "mgpu_graphs_cap100": Lever(DistConfig(engine=Engine.mgpu, bucket_cap_mb=100), graphs=True),
    "mgpu_graphs_cap50": Lever(DistConfig(engine=Engine.mgpu, bucket_cap_mb=50), graphs=True),
    # every parameter a bucket of its own, reduced in its own .grad: no copy into buckets, one
    # all-reduce per parameter (launched by the replay, not from Python)
    "mgpu_graphs_each": Lever(
        DistConfig(engine=Engine.mgpu, bucket_cap_mb=0.01, first_bucket_mb=0.01), graphs=True
    ),
    "mgpu_graphs_hipri": Lever(
        DistConfig(engine=Engine.mgpu), wrap=mgpu_own_group(high_priority=True), graphs=True
    ),
    # ZeRO-1 in the reducer: reduce-scatter, each rank steps 1/N, all-gather (mgpu.comm.shard)
    "mgpu_sharded": Lever(DistConfig(engine=Engine.mgpu, shard_optimizer=True)),
    # levers, measured one at a time against "mgpu": the wire dtype and the bucket size
    "mgpu_bf16": Lever(DistConfig(engine=Engine.mgpu, reduce_dtype=ReduceDtype.bf16)),
    "mgpu_cap10": Lever(DistConfig(engine=Engine.mgpu, bucket_cap_mb=10)),
    "mgpu_cap50": Lever(DistConfig(engine=Engine.mgpu, bucket_cap_mb=50)),
    "mgpu_cap100": Lever(DistConfig(engine=Engine.mgpu, bucket_cap_mb=100)),
    # every gradient in one bucket, reduced once backward is done: no overlap at all
    "mgpu_one_bucket": Lever(
        DistConfig(engine=Engine.mgpu, bucket_cap_mb=100_000, first_bucket_mb=100_000)
    ),
    # the all-reduce left exposed after a backward compiled whole, on 64 CTAs (NCCL picks fewer)
    "mgpu_ctas64": Lever(DistConfig(engine=Engine.mgpu), wrap=mgpu_own_group(ctas=64)),
    "mgpu_ctas2": Lever(DistConfig(engine=Engine.mgpu, nccl_max_ctas=2)),
    "mgpu_ctas4": Lever(DistConfig(engine=Engine.mgpu, nccl_max_ctas=4)),
    "mgpu_ctas8": Lever(DistConfig(engine=Engine.mgpu, nccl_max_ctas=8)),
    # NCCL's kernels scheduled before backward's where both wait for SMs
    "mgpu_nccl_priority": Lever(DistConfig(engine=Engine.mgpu, nccl_high_priority=True)),
    # BatchNorm statistics kept per rank: one collective less per step (ResNet-50), for both
    "mgpu_own_buffers": Lever(DistConfig(engine=Engine.mgpu, broadcast_buffers=False)),
    "torch_ddp_tuned_own_buffers": Lever(
        DistConfig(
            engine=Engine.torch_ddp,
            ddp_bucket_view=True,
            ddp_static_graph=True,
            broadcast_buffers=False,
        )
    ),
    # diagnostic: mgpu's hooks, buckets, events and stream waits with the all-reduce left out,
    # to split mgpu's overhead into its own machinery and the cost of communicating
    "mgpu_nocomm": Lever(DistConfig(engine=Engine.mgpu), wrap=mgpu_without_collectives),
    # diagnostic: every GPU training alone, plus the one per-step collective that every
    # data-parallel engine adds on top of its gradient reduction (the non-finite agreement):
    # what a single meeting point per step costs, with no gradient traffic at all
    "none_agree": Lever(DistConfig(engine=Engine.none), preemptible=True),
    # the reduction's NCCL kernels on a high-priority stream (ProcessGroupNCCL's
    # is_high_priority_stream): the GPU's block scheduler serves them before backward's queued
    # kernels, instead of after
    "mgpu_hipri": Lever(DistConfig(engine=Engine.mgpu), wrap=mgpu_own_group(high_priority=True)),
    # diagnostic: every bucket packed into a flat buffer, a bucket of one parameter included
    # (mgpu's default reduces such a bucket in the parameter's own .grad, with no copy)
    "mgpu_packed": Lever(DistConfig(engine=Engine.mgpu), wrap=mgpu_packed_buckets),
    # with --compile: the whole model compiled as one graph, as torch DDP's engines are, so
    # every gradient appears at the end of backward (mgpu's default compiles block by block)
    "mgpu_whole_compile": Lever(
        DistConfig(engine=Engine.mgpu, broadcast_buffers=False), whole_compile=True
    ),
    # the whole model as one graph and the step replayed by mgpu's capture (auto), so every
    # gradient is reduced after backward, as one GPU computes it: larger buckets (fewer NCCL
    # calls in that tail), and the bf16 wire (half its bytes)
    "mgpu_whole_compile_cap100": whole_compiled(100),
    "mgpu_whole_compile_cap100_bf16": whole_compiled(100, ReduceDtype.bf16),
    # with --accum (GPT-2 XL): the whole model as one graph (no capture with several
    # micro-batches), every gradient reduced once after the last micro-batch's backward in
    # 256 MB buckets (fewer, larger all-reduces in that tail), fp32 and bf16 on the wire
    "mgpu_whole_compile_cap256": whole_compiled(256),
    # every gradient of a model compiled whole in one all-reduce (GPT-2-small's ~500 MB): they
    # all arrive at backward's end anyway, and NCCL's bus bandwidth grows with the message
    "mgpu_whole_compile_cap1024": whole_compiled(1024),
    "mgpu_whole_compile_cap256_bf16": whole_compiled(256, ReduceDtype.bf16),
    # across nodes (two_nodes.py): the same at 25 MB, auto's size there until 256 measured faster
    "mgpu_whole_compile_cap25_bf16": whole_compiled(25, ReduceDtype.bf16),
    # with --accum: each block compiled on its own so that buckets are reduced while the last
    # micro-batch's backward runs (mgpu's default under accumulation before it compiled whole)
    "mgpu_block_compile": Lever(DistConfig(engine=Engine.mgpu), block_compile=True),
    # with --accum and --compile: the micro-batches that only accumulate run the model compiled
    # whole, the one whose backward reduces runs it block by block (ReducingByBlocks)
    "mgpu_reducing_by_blocks": Lever(
        DistConfig(engine=Engine.mgpu), wrap=mgpu_reducing_by_blocks, reducing_by_blocks=True
    ),
    # torch's PowerSGD hook (dist.compression=powersgd, rank 4): for slow links between nodes
    # (two_nodes.py). Compressed from its 3rd step on, the fewest plain steps torch allows, and
    # warm-up covers those (warmup_of): with train.py's default 10 plain steps, the few steps a
    # job times were mostly all-reduced uncompressed
    "torch_ddp_powersgd": Lever(
        DistConfig(engine=Engine.torch_ddp, compression=Compression.powersgd, powersgd_start_step=2)
    ),
    "torch_ddp_bf16": Lever(
        DistConfig(engine=Engine.torch_ddp, ddp_bucket_view=True, ddp_static_graph=True),
        wrap=ddp_bf16_compressed,
    ),
}
CORE = ["none", "torch_ddp", "torch_ddp_tuned", "mgpu", "mgpu_sharded"]

MODELS = {  # (factory, per-GPU batch, sample shape or seq len, optimizer)
    "gpt2_small": (
        lambda: GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768),
        16,
        1024,
        "adamw",
    ),
    # experiment=gpt2_xl's model and micro-batch (its bf16 residual stream included)
    "gpt2_xl": (
        lambda: GPT(
            vocab_size=50304,
            block_size=1024,
            n_layer=48,
            n_head=25,
            n_embd=1600,
            residual="autocast",
        ),
        16,
        1024,
        "adamw",
    ),
    "resnet50": (lambda: ResNet(num_classes=1000), 128, (3, 224, 224), "sgd"),
}
# The stand-ins' vocabulary: GPT-2's 50304 made the head and embedding most of a CPU step
# (~140 ms of gpt2_small's, against ~8 ms at 256), and no path here depends on its size.
QUICK_VOCAB = 256
QUICK = {  # CPU-sized stand-ins under the same names, to check the script (--quick)
    "gpt2_small": (
        lambda: GPT(vocab_size=QUICK_VOCAB, block_size=32, n_layer=2, n_head=2, n_embd=32),
        4,
        32,
        "adamw",
    ),
    "gpt2_xl": (
        lambda: GPT(
            vocab_size=QUICK_VOCAB,
            block_size=32,
            n_layer=3,
            n_head=5,
            n_embd=40,
            residual="autocast",
        ),
        4,
        32,
        "adamw",
    ),
    "resnet50": (
        lambda: ResNet(num_classes=1000, block="basic", layers=[1, 1, 1, 1], width=8),
        4,
        (3, 32, 32),
        "sgd",
    ),
}


def make_batch(name: str, device: torch.device, models: dict):
    _, batch, shape, _ = models[name]
    if name.startswith("gpt"):
        vocab = QUICK_VOCAB if models is QUICK else 50304
        tokens = torch.randint(0, vocab, (batch, shape + 1), device=device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    images = torch.randn(batch, *shape, device=device).contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 1000, (batch,), device=device)


def compiled(model: nn.Module, spec: Lever, tcfg: TrainerConfig, rt) -> nn.Module:
    if spec.reducing_by_blocks:
        model = compiled_for(tcfg, spec.dist, model, rt.device, rt.distributed)
        for block in repeated_blocks(model):  # in place: the whole model's graph inlines them
            block.compile(backend=tcfg.compile_backend)
        return model
    if spec.block_compile:  # buckets reduced while backward runs (mgpu's rule before accum)
        return compile_model(model, tcfg.compile_backend, None, overlap=True)
    if spec.dist.engine is Engine.mgpu and not spec.whole_compile:
        return compiled_for(tcfg, spec.dist, model, rt.device, rt.distributed)  # as train.py
    if spec.dist.engine is Engine.none:
        # The scaling baseline is the fastest single-GPU path measured (bench/vs_plain.py):
        # the whole model as one graph, replayed as CUDA graphs where one micro-batch makes a
        # step (compile_mode says why not with several).
        alone = compile_mode(
            tcfg.compile_mode,
            tcfg.compile_backend,
            model,
            rt.device,
            overlap=False,
            accum=tcfg.grad_accum_steps,
        )
        return torch.compile(model, backend=tcfg.compile_backend, mode=alone)
    # torch DDP splits the graph at its buckets itself
    return torch.compile(model, backend=tcfg.compile_backend)


def build(
    name: str,
    engine: str,
    rt,
    use_compile: bool,
    models: dict = MODELS,
    accum: int = 1,
    graphs: str | bool = "auto",
    compile_backend: str = "inductor",
):
    factory, _, _, optim = models[name]
    torch.manual_seed(0)
    model = factory().to(rt.device)
    if isinstance(model, ResNet):
        model = model.to(memory_format=torch.channels_last)
    ocfg = OptimConfig(name=OptimizerName(optim), lr=1e-4, warmup_steps=0)
    optimizer = build_optimizer(ocfg, model, rt.device)
    schedule = build_schedule(ocfg, optimizer, max_steps=10**6)
    spec = ENGINES[engine]
    # The Trainer compiles the loss when compile is on (as train.py's does) and replays steps
    # as CUDA graphs where trainer.cuda_graphs (--graphs, or the lever's own) says: under auto
    # the engines that train alone (one GPU's fastest path), as in train.py.
    precision = Precision.bf16 if rt.device.type == "cuda" else Precision.fp32
    tcfg = TrainerConfig(
        precision=precision,
        grad_clip=1.0,
        compile=use_compile,
        compile_backend=compile_backend,
        compile_mode=spec.compile_mode,
        cuda_graphs=graphs if spec.graphs is None else spec.graphs,
        replay_update=spec.replay_update,
        grad_accum_steps=accum,
    )
    if use_compile:
        model = compiled(model, spec, tcfg, rt)
    model = spec.wrap(model, spec.dist, rt)
    # none_agree: ranks that train apart still agree on preemption, one collective a step
    preemption = Preemption(rt) if spec.preemptible else None
    trainer = Trainer(tcfg, model, optimizer, schedule, rt, preemption=preemption)
    return model, trainer


def timed(trainer: Trainer, batch, steps: int) -> tuple[float, float]:
    """ms per optimizer step on the GPU's own clock (the host waits only at the end), and how
    far ahead of the GPU the host was when it had launched the last step: the GPU work still
    queued, in ms. Near zero, the host is what bounds the step (launch-bound), not the GPU.
    On a CPU (--quick): the host's clock, and nothing queued."""
    batches = itertools.repeat(batch)  # as many as the steps' micro-batches take
    if batch[0].device.type != "cuda":
        start = time.perf_counter()
        for _ in range(steps):
            trainer.train_step(batches)
        return (time.perf_counter() - start) * 1e3 / steps, 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        trainer.train_step(batches)
    end.record()
    launched = time.perf_counter()
    end.synchronize()
    ahead_ms = (time.perf_counter() - launched) * 1e3
    return start.elapsed_time(end) / steps, ahead_ms


def exposed_ms(model) -> float | None:
    """The reducer's exposed communication per synchronised step since the last call: timed
    events of steps launched from Python (host times on a CPU), the GPU's own stamps of replayed
    steps (a StampRange); None where no step left either."""
    if not isinstance(model, MgpuDataParallel):
        return None
    total, steps = 0.0, 0
    for mark in model.reducer.take_exposed():
        if isinstance(mark, StampRange):
            ms, n = mark.reading()
            total, steps = total + ms, steps + n
        elif isinstance(mark[0], float):  # host times, in seconds
            total, steps = total + (mark[1] - mark[0]) * 1e3, steps + 1
        else:  # CUDA events, all complete here
            total, steps = total + mark[0].elapsed_time(mark[1]), steps + 1
    return total / steps if steps else None


def memory_mark() -> int:
    """Frees what can be freed and restarts the GPU's peak count; returns what stays allocated,
    the floor an engine's peak is taken above."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def free(model) -> None:
    """Lets an engine's memory go: the reducer's hooks and the parameters refer to each other."""
    if isinstance(model, MgpuDataParallel):
        model.reducer.remove()


class Samples:
    """Each engine's timed rounds: step ms, GPU work queued when the host was done, and the
    reducer's exposed communication."""

    def __init__(self, engines: list[str]):
        self.times: dict[str, list[float]] = {e: [] for e in engines}
        self.ahead: dict[str, list[float]] = {e: [] for e in engines}
        self.exposed: dict[str, list[float]] = {e: [] for e in engines}
        # wall seconds before an engine's rounds: building it (compiling, capturing) and its
        # warm-up; where a job's time goes
        self.setup_s: dict[str, float] = dict.fromkeys(engines, 0.0)

    def round(self, engine: str, model, trainer: Trainer, batch, steps: int) -> None:
        exposed_ms(model)  # drop marks from earlier rounds
        ms, queued = timed(trainer, batch, steps)
        self.times[engine].append(ms)
        self.ahead[engine].append(queued)
        x = exposed_ms(model)
        if x is not None:
            self.exposed[engine].append(x)


def one_at_a_time(name, engines, rt, args, models, batch):
    """Each engine built, warmed up, timed over all its rounds, profiled if asked, and freed
    before the next is built: for models whose engines do not fit a GPU together. Its peak
    memory is that of its own warm-up and rounds, above what was allocated before it. An
    engine named more than once is built each time; its rounds are pooled, its peak is the
    highest, its profiles are the last build's."""
    samples, memory, kernels, idle = Samples(list(dict.fromkeys(engines))), {}, {}, {}
    cuda = rt.device.type == "cuda"
    for e in engines:
        before = memory_mark() if cuda else 0
        began = time.perf_counter()
        model, trainer = build(
            name, e, rt, args.compile, models, args.accum, args.graphs, args.compile_backend
        )
        timed(trainer, batch, warmup_of(e, args.warmup))  # ends when the GPU is done
        samples.setup_s[e] += time.perf_counter() - began
        for _ in range(args.rounds):
            samples.round(e, model, trainer, batch, args.steps)
        peak = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
        memory[e] = max(peak, memory.get(e) or 0.0) if cuda else None
        if args.kernels:
            kernels[e] = kernel_table(trainer, batch)
        if args.idle:
            idle[e] = idle_table(trainer, batch)
        if rt.is_primary:  # in the log as it comes, should a later engine not finish
            print(f"{name} {e}: ms/step {samples.times[e]}, peak {memory[e]} GiB", flush=True)
            save_partial(args, name, samples, memory)
        free(model)
        del model, trainer
        # Compiled graphs (and CUDA graph pools) of this engine are not needed again.
        torch.compiler.reset()
    return samples, memory, kernels, idle


def warmup_of(engine: str, warmup: int) -> int:
    """Steps before timing: `warmup`, and at least the steps an engine all-reduces uncompressed
    before compressing (PowerSGD's), so that only its compressed steps are timed."""
    lever = ENGINES.get(engine)
    if lever is None or lever.dist.compression is Compression.none:
        return warmup
    return max(warmup, lever.dist.powersgd_start_step)


def save_partial(args, name: str, samples: Samples, memory: dict) -> None:
    """The engines timed so far one at a time, rank 0's medians, into `<out>/engines-<tag>-
    partial.json` (rewritten after each): what a job cut short keeps (scaling.py reads it)."""
    cuda = torch.cuda.is_available() and not args.quick
    rows = [
        {"model": name, "engine": e, "step_ms": statistics.median(t), "step_ms_all": t}
        | {"peak_memory_gib": memory.get(e), "partial": True}
        for e, t in samples.times.items()
        if t
    ]
    meta = versions() if cuda else {"device": "cpu", "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"engines-{args.tag}-partial.json"
    # whole or not at all: a job killed while writing leaves the previous one
    path.with_suffix(".tmp").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    path.with_suffix(".tmp").replace(path)


def all_together(name, engines, rt, args, models, batch):
    """Every engine built up front and timed in interleaved rounds."""
    samples, memory, built = Samples(engines), {}, {}
    cuda = rt.device.type == "cuda"
    for e in engines:
        # Its peak: its model, optimizer, gradients, buckets, graphs and activations, over its
        # build and warm-up, above what the engines built before it keep (each built once).
        before = memory_mark() if cuda else 0
        began = time.perf_counter()
        built[e] = build(
            name, e, rt, args.compile, models, args.accum, args.graphs, args.compile_backend
        )
        timed(built[e][1], batch, warmup_of(e, args.warmup))  # ends when the GPU is done
        samples.setup_s[e] += time.perf_counter() - began
        memory[e] = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else None
    for _ in range(args.rounds):
        for e in engines:
            samples.round(e, *built[e], batch, args.steps)
    kernels = {e: kernel_table(built[e][1], batch) for e in engines} if args.kernels else {}
    idle = {e: idle_table(built[e][1], batch) for e in engines} if args.idle else {}
    return samples, memory, kernels, idle


def bench_model(name, engines, rt, args) -> list[dict]:
    models = QUICK if args.quick else MODELS
    batch = make_batch(name, rt.device, models)
    measure = one_at_a_time if args.one_at_a_time else all_together
    samples, memory, kernels, idle = measure(name, engines, rt, args, models, batch)
    times, ahead, exposed = samples.times, samples.ahead, samples.exposed
    engines = list(times)  # each engine once, in the order first given
    # Every rank's own median: a synchronous engine runs at its slowest rank's pace, while
    # `none` shows each GPU's (efficiency is taken against rank 0's, the one that reports).
    local = torch.tensor([statistics.median(times[e]) for e in engines], device=rt.device)
    by_rank = [torch.empty_like(local) for _ in range(rt.world_size)]
    torch.distributed.all_gather(by_rank, local)
    by_rank = torch.stack(by_rank).T.tolist()  # sync point: after timing
    _, per_gpu_batch, shape, _ = models[name]
    units = per_gpu_batch * (shape if isinstance(shape, int) else 1) * args.accum
    base = statistics.median(times["none"]) if "none" in times else None
    rows = []
    for e in engines:
        ms = statistics.median(times[e])
        rows.append(
            {
                "model": name,
                "engine": e,
                "accum": args.accum,
                "one_at_a_time": args.one_at_a_time,
                "step_ms": ms,
                "step_ms_all": times[e],
                "per_gpu_throughput": units / (ms / 1e3),
                "unit": "tokens/s" if isinstance(shape, int) else "images/s",
                "scaling_efficiency": base / ms if base else None,
                "peak_memory_gib": memory[e],
                "exposed_comm_ms": statistics.median(exposed[e]) if exposed[e] else None,
                "host_ahead_ms": statistics.median(ahead[e]),
                "setup_s": round(samples.setup_s[e], 3),
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
        f"NCCL {meta.get('nccl', '-')}, {meta.get('env') or 'default NCCL env'}, "
        f"{meta['accum']} micro-batch(es) a step"
    )
    if meta["one_at_a_time"]:
        print("engines built and timed one at a time, in this order (not interleaved)")
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
            f"{row['per_gpu_throughput']:12,.0f} {eff or 0:6.3f} "
            f"{ratio if ratio is not None else float('nan'):11.3f} "
            f"{row['peak_memory_gib'] or float('nan'):8.2f} "
            f"{exp if exp is not None else float('nan'):10.2f} "
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
    setup = ", ".join(f"{r['engine']} {r['setup_s']:.0f}" for r in rows)
    print(f"seconds to build, compile and warm up each engine (rank 0): {setup}")
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
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"engines-{args.tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (out / f"engines-{args.tag}-partial.json").unlink(missing_ok=True)  # the whole is here
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=CORE, choices=list(ENGINES))
    parser.add_argument("--steps", type=int, help="timed steps a round (20; --quick 2)")
    parser.add_argument("--rounds", type=int, help="timed rounds (5; --quick 1)")
    parser.add_argument("--warmup", type=int, help="warm-up steps (8; --quick 1)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile: per block for mgpu, whole model otherwise",
    )
    parser.add_argument(
        "--accum", type=int, default=1, help="micro-batches a step (trainer.grad_accum_steps)"
    )
    parser.add_argument(
        "--graphs",
        choices=["auto", "off"],
        default="auto",
        help="trainer.cuda_graphs for every engine without its own (auto: as train.py)",
    )
    parser.add_argument(
        "--one-at-a-time",
        action="store_true",
        help="build, time and free each engine in turn (models whose engines do not fit together)",
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
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny shapes, few steps, gloo on the CPU; --compile with the aot_eager backend",
    )
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    args.graphs = "auto" if args.graphs == "auto" else False
    if args.accum < 1:
        parser.error(f"--accum {args.accum}: a step takes at least one micro-batch")
    if len(set(args.engines)) < len(args.engines) and not args.one_at_a_time:
        parser.error("an engine named twice is timed twice only with --one-at-a-time")
    for e in args.engines:  # the pairings train.py refuses (torch DDP's static graph, --accum)
        try:
            check_dist_fits_trainer(ENGINES[e].dist, TrainerConfig(grad_accum_steps=args.accum))
        except ConfigError as err:
            parser.error(f"--engines {e} with --accum {args.accum}: {err}")
    backend, args.compile_backend = "nccl", "inductor"
    # The counts the command line left out: --quick's few, or a GPU's
    counts = (2, 1, 1) if args.quick else (20, 5, 8)
    for key, count in zip(("steps", "rounds", "warmup"), counts, strict=True):
        if getattr(args, key) is None:
            setattr(args, key, count)
    if args.quick:
        backend = "auto"
        # --compile on the CPU through torch.compile's aot_eager backend (as vs_plain.py and
        # fp8_layers.py --quick): dynamo and AOT autograd trace each engine's graphs as on a
        # GPU, but inductor's C++ kernels are not generated; those took scaling.py --quick's
        # compiled job ~100 s of CPU with a cold cache, against ~25 s here.
        args.compile_backend = "aot_eager"
    set_math_modes(TrainerConfig(), torch.device("cuda"))  # train.py's defaults: TF32, autotuning
    with distributed(backend, timeout_s=600, cpu_affinity=args.cpu_affinity) as rt:
        rows = [row for name in args.models for row in bench_model(name, args.engines, rt, args)]
        if rt.is_primary:
            cuda = rt.device.type == "cuda"
            meta = {
                **(versions() if cuda else {"device": "cpu", "torch": torch.__version__}),
                "world_size": rt.world_size,
                "compile": args.compile,
                "cpu_affinity": args.cpu_affinity,
                "command": " ".join(["torchrun", f"--nproc_per_node={rt.world_size}", *sys.argv]),
                "steps": args.steps,
                "rounds": args.rounds,
                "accum": args.accum,
                "graphs": args.graphs,
                "one_at_a_time": args.one_at_a_time,
            }
            report(rows, meta, args)


if __name__ == "__main__":
    end_with_agent()  # a worker ends with its torchrun (scaling.py stops a job past its limit)
    default_cuda_connections()  # as train.py: before anything asks CUDA for a device
    # Ends without the teardown of torch's communication threads, as train.py does
    # (mgpu.runtime.dist.exit_process: that teardown can abort a finished run).
    exit_process(main)
