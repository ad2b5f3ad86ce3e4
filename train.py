"""mgpu's entry point: config -> typed objects -> process group -> build -> fit -> teardown.

torchrun --nproc_per_node=2 train.py [key=value ...]
"""

# ruff: noqa: E402 - the start time is taken before the imports, which take seconds

import time

STARTED_AT = time.time()  # goodput's start-up counts from here
JOINED = False  # whether this process joined a process group (see the teardown rule below)

import logging
import os
import random
import secrets
import sys
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mgpu.board import TensorBoard
from mgpu.checkpoint import (
    CheckpointError,
    Loaded,
    checkpoint_root,
    load,
    resolve_resume,
)
from mgpu.comm import MgpuDataParallel, wrap_model
from mgpu.config import CheckpointConfig, Config, to_config
from mgpu.dist import Runtime, all_ok, broadcast_object, check_same_config, distributed
from mgpu.goodput import Goodput
from mgpu.guard import NonFiniteStep
from mgpu.loader import build_dataset, build_loader
from mgpu.metrics import Recorder
from mgpu.models import build_model, compile_model
from mgpu.models.flops import peak_tflops
from mgpu.optim import build_optimizer, build_schedule
from mgpu.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from mgpu.profiling import StepProfiler
from mgpu.resume import CheckpointPlan
from mgpu.state import (
    CheckpointMismatch,
)
from mgpu.trainer import Trainer
from mgpu.watchdog import CollectiveTimeout

log = logging.getLogger("mgpu")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def quiet_other_ranks(rt: Runtime) -> None:
    """Only rank 0 talks on the console; every rank keeps its full log file."""
    if not rt.is_primary:
        for handler in logging.getLogger().handlers:
            if type(handler) is logging.StreamHandler:
                handler.setLevel(logging.WARNING)


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
            f"engine {cfg.dist.engine.value}, precision {cfg.trainer.precision.value}",
            f"- batch {cfg.data.batch_size} per device x {cfg.trainer.grad_accum_steps} "
            f"accumulation x {rt.world_size} processes per optimizer step",
            f"- torch {torch.__version__}",
            "",
            "```yaml",
            config_text,
            "```",
        ]
    )


def run(
    cfg: Config,
    rt: Runtime,
    run_dir: Path,
    config_text: str,
    preemption: Preemption,
) -> None:
    root = checkpoint_root(run_dir)
    loaded, token = resume_point(cfg.ckpt, root, rt)  # before anything is written
    if rt.is_primary:
        (run_dir / "config.yaml").write_text(config_text)
    # Rank 0 keeps the run's goodput file; the others count in memory only.
    goodput = Goodput(run_dir / "goodput.json" if rt.is_primary else None, started_at=STARTED_AT)
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
    schedule = build_schedule(cfg.optim, optimizer, cfg.trainer.max_steps)
    if cfg.trainer.compile:
        model = compile_model(model)
    model = wrap_model(model, cfg.dist, rt)
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
        comm_marks=model.reducer.exposed if isinstance(model, MgpuDataParallel) else None,
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
    try:
        trainer.fit(train_loader, eval_loader)
    finally:
        goodput.save()  # every way out: the end, preemption, an error
        board.close()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)  # already validated before Hydra made the run directory
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    exit_code = 0
    with distributed(cfg.dist.backend.value, cfg.dist.timeout_s, cfg.dist.cpu_affinity) as rt:
        global JOINED
        JOINED = rt.has_process_group
        resolved = OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"])
        text = OmegaConf.to_yaml(resolved, resolve=True)
        check_same_config(text, rt, run_dir)  # before any work: stops every rank if they differ
        quiet_other_ranks(rt)
        # Rank 0 says why on the console; every rank's log file has it.
        primary = rt.is_primary
        try:
            with Preemption(rt) as preemption:  # SIGTERM/SIGUSR1: save at a step boundary
                run(cfg, rt, run_dir, text, preemption)
        except Preempted as err:
            (log.warning if primary else log.info)(
                "%s: checkpoint saved; exit code %d, run the same command to resume",
                err,
                PREEMPTED_EXIT_CODE,
            )
            exit_code = PREEMPTED_EXIT_CODE
        except CollectiveTimeout as err:
            log.error("%s", err)  # the rank that waited, on whichever rank it is
            exit_code = 1
        except (CheckpointError, CheckpointMismatch, NonFiniteStep) as err:
            # Every rank meets these at the same point: all stop, no collective is left waiting.
            (log.error if primary else log.info)("%s", err)
            exit_code = 1
    if exit_code:
        raise SystemExit(exit_code)


def exit_code_of(stop: SystemExit) -> int:
    if stop.code is None or isinstance(stop.code, int):
        return stop.code or 0
    print(stop.code, file=sys.stderr)  # sys.exit("message") prints it and exits 1
    return 1


if __name__ == "__main__":
    try:
        main()
        code = 0
    except SystemExit as stop:  # Hydra ends with sys.exit, errors included
        code = exit_code_of(stop)
    if not JOINED:  # no process group, no communication threads: a plain exit
        sys.exit(code)
    # Teardown rule: by here the process group is destroyed and every file this run writes is
    # closed. The process ends without Python's and C++'s teardown of torch's communication
    # threads, which can abort ("terminate called without an active exception") after the
    # work is done and turn a finished run into a failed one.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
