"""mgpu's entry point: config -> typed objects -> process group -> build -> fit -> teardown.

torchrun --nproc_per_node=2 train.py [key=value ...]
"""

import logging
import os
import random
import secrets
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mgpu.checkpoint import (
    CheckpointError,
    CheckpointMismatch,
    Loaded,
    checkpoint_root,
    load,
    resolve_resume,
)
from mgpu.comm import MgpuDataParallel, wrap_model
from mgpu.config import CheckpointConfig, Config, to_config
from mgpu.dist import Runtime, all_ok, broadcast_object, check_same_config, distributed
from mgpu.loader import build_dataset, build_loader
from mgpu.metrics import NonFiniteLoss, Recorder, TensorBoard
from mgpu.models import build_model, compile_model
from mgpu.optim import build_optimizer, build_schedule
from mgpu.preempt import PREEMPTED_EXIT_CODE, Preempted, Preemption
from mgpu.trainer import CheckpointPlan, Trainer

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


def run(cfg: Config, rt: Runtime, run_dir: Path, config_text: str, preemption: Preemption) -> None:
    root = checkpoint_root(run_dir)
    loaded, token = resume_point(cfg.ckpt, root, rt)  # before anything is written
    if rt.is_primary:
        (run_dir / "config.yaml").write_text(config_text)
    seed_everything(cfg.trainer.seed)  # the same initial weights on every rank
    model = build_model(cfg.model).to(rt.device)
    if rt.device.type == "cuda" and getattr(model, "channels_last", False):
        model = model.to(memory_format=torch.channels_last)  # convolutions run faster in NHWC
    seed_everything(cfg.trainer.seed + rt.rank)  # then independent dropout per rank
    train_set = build_dataset(cfg.data, "train")
    eval_set = build_dataset(cfg.data, "eval")
    train_loader = build_loader(cfg.data, train_set, rt, seed=cfg.trainer.seed, train=True)
    eval_loader = build_loader(cfg.data, eval_set, rt, seed=cfg.trainer.seed, train=False)
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
    )
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
    )
    if loaded is not None:
        trainer.resume(loaded, train_loader)
        del loaded  # its tensors are in the model and optimizer now
    params = sum(p.numel() for p in model.parameters())
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
        board.close()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)  # already validated before Hydra made the run directory
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    exit_code = 0
    with distributed(cfg.dist.backend.value, cfg.dist.timeout_s) as rt:
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
        except (CheckpointError, CheckpointMismatch, NonFiniteLoss) as err:
            # Every rank meets these at the same point: all stop, no collective is left waiting.
            (log.error if primary else log.info)("%s", err)
            exit_code = 1
    if exit_code:
        raise SystemExit(exit_code)


if __name__ == "__main__":
    main()
