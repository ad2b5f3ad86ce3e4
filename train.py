"""mgpu's entry point: config -> typed objects -> process group -> build -> fit -> teardown.

torchrun --nproc_per_node=2 train.py [key=value ...]
"""

import logging
import random
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from mgpu.comm import MgpuDataParallel, wrap_model
from mgpu.config import Config, to_config
from mgpu.dist import Runtime, check_same_config, distributed
from mgpu.loader import build_dataset, build_loader
from mgpu.metrics import Recorder, TensorBoard
from mgpu.models import build_model, compile_model
from mgpu.optim import build_optimizer, build_schedule
from mgpu.trainer import Trainer

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


def run(cfg: Config, rt: Runtime, run_dir: Path) -> None:
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
    board = TensorBoard(run_dir, enabled=rt.is_primary)
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
    )
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
    with distributed(cfg.dist.backend.value, cfg.dist.timeout_s) as rt:
        resolved = OmegaConf.masked_copy(dcfg, [k for k in dcfg if k != "hydra"])
        text = OmegaConf.to_yaml(resolved, resolve=True)
        check_same_config(text, rt, run_dir)  # before any work: stops every rank if they differ
        quiet_other_ranks(rt)
        if rt.is_primary:
            (run_dir / "config.yaml").write_text(text)
        run(cfg, rt, run_dir)


if __name__ == "__main__":
    main()
