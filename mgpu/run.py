"""One training run assembled from a validated Config: where it resumes, the model (compiled and
wrapped for data parallelism), data, optimizer, telemetry and the Trainer, in the order train.py
and the benchmarks share, so that what is measured is what users run.
"""

from __future__ import annotations

import logging
import os
import random
import secrets
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf

from mgpu.board import TensorBoard
from mgpu.checkpoint import CheckpointError, Loaded, checkpoint_root, load, resolve_resume
from mgpu.comm import MgpuDataParallel, wrap_model
from mgpu.config import CheckpointConfig, Config, Engine
from mgpu.dist import Runtime, all_ok, broadcast_object
from mgpu.goodput import Goodput
from mgpu.loader import DeviceLoader, build_dataset, build_loader
from mgpu.metrics import Recorder
from mgpu.models import build_model, compile_mode, compile_model
from mgpu.models.flops import peak_tflops
from mgpu.optim import build_optimizer, build_schedule
from mgpu.preempt import Preemption
from mgpu.profiling import StepProfiler
from mgpu.resume import CheckpointPlan
from mgpu.shard import ShardedOptimizer
from mgpu.trainer import Trainer, set_math_modes

log = logging.getLogger("mgpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resume_point(cfg: CheckpointConfig, root: Path, rt: Runtime) -> tuple[Loaded | None, str]:
    """Where this launch starts, the same on every rank, and its checkpoint token.

    Rank 0 resolves ckpt.resume (after a torchrun restart, the newest valid checkpoint in the run
    directory comes first) and makes the token, new for every launch and restart; every rank
    then loads its part of that one checkpoint. A collective: an error stops every rank."""
    decision = None
    if rt.is_primary:
        token = f"{os.getpid()}-{secrets.token_hex(4)}"  # secrets: leaves the seeded RNGs alone
        try:
            path = resolve_resume(cfg.resume, root, restarted=rt.restart_count > 0)
            decision = (token, str(path) if path else None, None)
        except CheckpointError as err:
            decision = (token, None, (str(err.file), err.check))
    token, path, error = broadcast_object(decision, rt)
    if error is not None:
        raise CheckpointError(*error)
    if path is None:
        return None, token
    loaded, error = None, None
    try:
        loaded = load(Path(path), rank=rt.rank, map_location=rt.device)
    except CheckpointError as err:
        error = err
    if not all_ok(error is None, rt):
        raise error or CheckpointError(path, "unreadable on another rank (its log says why)")
    return loaded, token


def mfu_inputs(cfg: Config, model, train_set, rt: Runtime) -> tuple[float | None, float | None]:
    """The model's training FLOPs per sample and the device's peak TFLOP/s, for MFU; None
    where either is unknown (said once in the log)."""
    flops = None
    count = getattr(model, "flops_per_sample", None)
    # The dataset's declared input shape: fetching a sample to look would be a side effect on
    # a user's dataset (and a read of their data) before training starts.
    shape = getattr(train_set, "sample_shape", None)
    if count is not None and shape is not None:
        flops = count(tuple(shape))
    peak = cfg.trainer.peak_tflops or None
    if peak is None and rt.device.type == "cuda":
        low = cfg.trainer.precision.value != "fp32"  # auto on CUDA: bf16 or fp16 autocast
        peak = peak_tflops(torch.cuda.get_device_name(rt.device), low)
    if rt.is_primary and (flops is None or peak is None):
        why = "the device's peak"
        if flops is None:
            why = "the model's flops_per_sample or the dataset's sample_shape"
        log.info("MFU not reported: %s is unknown (trainer.peak_tflops sets a peak)", why)
    return flops, peak


def describe(cfg: Config, rt: Runtime, params: int, config_text: str) -> str:
    """The run in a few lines of Markdown, for TensorBoard's text tab."""
    device = torch.cuda.get_device_name(rt.device) if rt.device.type == "cuda" else "CPU"
    return "\n".join(
        [
            f"- model: `{cfg.model._target_}`, {params / 1e6:.2f}M parameters",
            f"- {rt.world_size} process(es) on {device}, backend {rt.backend}, "
            f"engine {cfg.dist.engine.value}, precision {cfg.trainer.precision.value}, "
            f"compiled {cfg.trainer.compiles(rt.device.type)}",
            f"- batch {cfg.data.batch_size} per device x {cfg.trainer.grad_accum_steps} "
            f"accumulation x {rt.world_size} processes per optimizer step",
            f"- torch {torch.__version__}",
            "",
            "```yaml",
            config_text,
            "```",
        ]
    )


@dataclass
class Run:
    """A built run: fit() trains it to trainer.max_steps (from its checkpoint, if it resumed)."""

    trainer: Trainer
    train_loader: DeviceLoader
    eval_loader: DeviceLoader
    board: TensorBoard
    goodput: Goodput

    def fit(self) -> None:
        try:
            self.trainer.fit(self.train_loader, self.eval_loader)
        finally:
            self.goodput.save()  # every way out: the end, preemption, an error
            self.board.close()


def build_run(
    cfg: Config,
    rt: Runtime,
    run_dir: Path,
    config_text: str,
    *,
    preemption: Preemption | None = None,
    started_at: float | None = None,
) -> Run:
    """Everything a run needs, built in this order on every rank. `started_at` (time.time()
    when the process started) is where goodput's start-up time counts from."""
    root = checkpoint_root(run_dir)
    loaded, token = resume_point(cfg.ckpt, root, rt)  # before anything is written
    if rt.is_primary:
        (run_dir / "config.yaml").write_text(config_text)
    # Rank 0 keeps the run's goodput file; the others count in memory only.
    goodput = Goodput(run_dir / "goodput.json" if rt.is_primary else None, started_at=started_at)
    set_math_modes(cfg.trainer, rt.device)
    seed_everything(cfg.trainer.seed)  # the same initial weights on every rank
    model = build_model(cfg.model).to(rt.device)
    if rt.device.type == "cuda" and getattr(model, "channels_last", False):
        model = model.to(memory_format=torch.channels_last)  # convolutions run faster in NHWC
    seed_everything(cfg.trainer.seed + rt.rank)  # then independent dropout per rank
    train_set = build_dataset(cfg.data, "train")
    eval_set = build_dataset(cfg.data, "eval")
    train_loader = build_loader(cfg.data, train_set, rt, seed=cfg.trainer.seed, train=True)
    eval_loader = build_loader(cfg.data, eval_set, rt, seed=cfg.trainer.seed, train=False)
    flops, peak = mfu_inputs(cfg, model, train_set, rt)
    optimizer = build_optimizer(cfg.optim, model, rt.device)
    if cfg.trainer.compiles(rt.device.type):
        tc = cfg.trainer
        ddp = cfg.dist.engine is Engine.torch_ddp and rt.world_size > 1
        mode = compile_mode(tc.compile_mode, tc.compile_backend, model, rt.device, ddp)
        model = compile_model(model, tc.compile_backend, mode)
    model = wrap_model(model, cfg.dist, rt)
    if isinstance(model, MgpuDataParallel) and model.reducer.shards is not None:
        # dist.shard_optimizer: the optimizer steps this rank's shards of the reducer's buckets
        optimizer = ShardedOptimizer(optimizer, model.reducer.shards)
    schedule = build_schedule(cfg.optim, optimizer, cfg.trainer.max_steps)
    # A resumed run's TensorBoard drops what an earlier attempt logged after the checkpoint.
    purge_step = loaded.step + 1 if loaded is not None else None
    board = TensorBoard(run_dir, enabled=rt.is_primary, purge_step=purge_step)
    samples_per_step = cfg.data.batch_size * cfg.trainer.grad_accum_steps * rt.world_size
    recorder = Recorder(
        rt,
        board,
        samples_per_step=samples_per_step,
        tokens_per_sample=getattr(train_set, "tokens_per_sample", None),
        max_steps=cfg.trainer.max_steps,
        comm_marks=model.reducer.take_exposed if isinstance(model, MgpuDataParallel) else None,
        flops_per_sample=flops,
        peak_tflops=peak,
        goodput=goodput,
    )
    tc = cfg.trainer
    profiler = StepProfiler(tc.profile, tc.profile_start, tc.profile_steps, run_dir, rt)
    trainer = Trainer(
        cfg.trainer,
        model,
        optimizer,
        schedule,
        rt,
        recorder=recorder,
        input_transform=getattr(train_set, "device_transform", None),
        checkpoints=CheckpointPlan(
            root, cfg.ckpt.every, cfg.ckpt.keep_last, token=token, config=config_text
        ),
        preemption=preemption,
        profiler=profiler,
        goodput=goodput,
    )
    if loaded is not None:
        trainer.resume(loaded, train_loader)
        del loaded  # its tensors are in the model and optimizer now
    params = sum(p.numel() for p in model.parameters())
    tree = OmegaConf.to_container(OmegaConf.create(config_text))
    board.describe_run(tree, describe(cfg, rt, params, config_text))
    log.info(
        "run dir %s | %d process(es), backend %s, device %s | %s, %.2fM parameters",
        run_dir,
        rt.world_size,
        rt.backend,
        rt.device,
        cfg.model._target_,
        params / 1e6,
    )
    return Run(trainer, train_loader, eval_loader, board, goodput)
