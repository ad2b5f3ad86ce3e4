"""One training run assembled from a validated Config: where it resumes, the model (compiled and
wrapped for data parallelism), data, optimizer, telemetry and the Trainer, in the order train.py
and the benchmarks share, so that what is measured is what users run.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from torch import nn
from torch.utils.data import Dataset

from mgpu.ckpt.checkpoint import Loaded, checkpoint_root
from mgpu.ckpt.resume import (
    Checkpointer,
    CheckpointPlan,
    check_settings,
    resume_point,
)
from mgpu.ckpt.state import check_same_data, check_same_model
from mgpu.comm.engine import MgpuDataParallel, wrap_model
from mgpu.comm.sharded_optim import ShardedOptimizer
from mgpu.config.schema import DistConfig, Engine, Precision, TrainerConfig
from mgpu.data import decode_split
from mgpu.data.loader import build_dataset, build_loader
from mgpu.data.prefetch import DeviceLoader
from mgpu.data.tokenizer import BYTES, UNDECODED, copy_to_run
from mgpu.models import build_model, compile_model, compile_plan, whole_for_mgpu
from mgpu.models.config import VOCAB_MULTIPLE, GPTModelConfig
from mgpu.models.gpt import (
    FUSED_HEAD_MAX_COMPILED_WIDTH,
    checkpointed_blocks,
    fused_head_miscompiles,
)
from mgpu.optim.optimizer import build_optimizer, build_schedule
from mgpu.run.config import Config
from mgpu.runtime.ctrl_c import CtrlC
from mgpu.runtime.dist import Runtime, waiting
from mgpu.runtime.preempt import Preemption
from mgpu.telemetry.board import TensorBoard, set_aside_earlier_run
from mgpu.telemetry.goodput import GOODPUT_FILE, Goodput
from mgpu.telemetry.metrics import Recorder
from mgpu.telemetry.mfu import mfu_inputs
from mgpu.telemetry.profiling import StepProfiler
from mgpu.train import fp8
from mgpu.train.numerics import autocast_dtype, set_math_modes
from mgpu.train.trainer import Trainer

log = logging.getLogger("mgpu")


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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_parallel_model(cfg: Config, model: nn.Module, rt: Runtime) -> nn.Module:
    """The model compiled as trainer.compile says, then wrapped as dist.engine says."""
    if cfg.trainer.compiles(rt.device.type):
        model = compiled_for(cfg.trainer, cfg.dist, model, rt.device, rt.distributed)
    return wrap_model(model, cfg.dist, rt)


def compiled_for(
    tc: TrainerConfig, dc: DistConfig, model: nn.Module, device: torch.device, distributed: bool
) -> nn.Module:
    """`model` compiled for a run of these settings, before it is wrapped: whole, in torch's
    default mode, where mgpu reduces every gradient after backward (models.whole_for_mgpu); else
    block by block where buckets are reduced while backward runs (models.compile_model), in
    trainer.compile_mode's mode (models.compile_mode)."""
    reduces, ddp = dc.engine is not Engine.none, dc.engine is Engine.torch_ddp
    args = dict(distributed=distributed, reduces=reduces, ddp=ddp, recordable=dc.recordable())
    plan = compile_plan(tc, model, device, **args)
    whole, mode = plan.whole, plan.mode
    model = compile_model(model, tc.compile_backend, mode, plan.overlap)
    # torch.compile works inside the first step and prints nothing meanwhile: say so, or a
    # large model looks hung for minutes before the first progress line.
    log.info(
        "trainer.compile: the first step compiles the model (%s mode %s%s); the first progress "
        "line comes after it, minutes later for a large model (trainer.compile=false starts "
        "at once)", tc.compile_backend, mode or "default",
        ", whole, its gradients reduced after backward" if whole else "",
    )  # fmt: skip
    return model


def reduces_during_backward(cfg: Config, device: str, distributed: bool) -> bool:
    """Gradients reduced while backward runs: the model is wrapped for data parallelism on
    several processes and not compiled whole for mgpu (compile_model then compiles a
    GPT block by block)."""
    if cfg.dist.engine is Engine.none or not distributed:
        return False
    model, checkpointed = cfg.model, 0
    if isinstance(model, GPTModelConfig):
        checkpointed = checkpointed_blocks(model.activation_checkpointing, model.n_layer)
    recordable = cfg.dist.recordable()
    whole = whole_for_mgpu(cfg.trainer, torch.device(device), distributed, recordable, checkpointed)
    return not whole


def fused_head_risk(cfg: Config, device: str, distributed: bool) -> str | None:
    """Why GPT's fused head loss would train wrong in this run, or None: the whole model (its
    head included) compiled by inductor for a GPU into a graph known to miscompile it
    (gpt.fused_head_miscompiles; the race is in a Triton kernel: on a CPU inductor writes C++,
    and other backends no kernels). Compiled block by block (several processes), the head runs
    eager and is not at risk. model.head_loss=fused then stops before the run starts
    (mgpu.run.cli.check_config); `auto` takes the logits' loss instead (GPT.forward, which
    does so in any whole-model compile of such a GPT on a GPU), and build_run says so."""
    model, tc = cfg.model, cfg.trainer
    whole = tc.compiles(device) and not reduces_during_backward(cfg, device, distributed)
    inductor_gpu = device == "cuda" and tc.compile_backend == "inductor"
    if not (isinstance(model, GPTModelConfig) and whole and inductor_gpu):
        return None
    autocast = autocast_dtype(cfg.trainer.precision, torch.device(device)) is not None
    if not fused_head_miscompiles(model.n_embd, model.residual, autocast):
        return None
    return (
        f"torch.compile's inductor builds a racing kernel for the fused head loss of a GPT "
        f"wider than {FUSED_HEAD_MAX_COMPILED_WIDTH} channels (model.n_embd={model.n_embd}) "
        f"with the fp32 residual stream under autocast (trainer.precision="
        f"{cfg.trainer.precision.value}): its loss and gradients are wrong"
    )


def build_recorder(
    cfg: Config,
    rt: Runtime,
    board: TensorBoard,
    model: nn.Module,
    train_set: Dataset,
    mfu: tuple[float | None, float | None],
    goodput: Goodput,
) -> Recorder:
    """Telemetry: what a step holds (samples, tokens, FLOPs) and where it writes."""
    flops, peak = mfu
    return Recorder(
        rt,
        board,
        samples_per_step=cfg.data.batch_size * cfg.trainer.grad_accum_steps * rt.world_size,
        tokens_per_sample=getattr(train_set, "tokens_per_sample", None),
        max_steps=cfg.trainer.max_steps,
        comm_marks=model.reducer.take_exposed if isinstance(model, MgpuDataParallel) else None,
        flops_per_sample=flops,
        peak_tflops=peak,
        goodput=goodput,
        counters=getattr(train_set, "counters", None),
    )


def unused_vocabulary(cfg: Config) -> str | None:
    """One line where model.vocab_size was set above what the data's vocabulary needs: rows the
    data never uses, trained and saved for nothing (model.vocab_size=auto follows the data)."""
    rows = getattr(cfg.model, "vocab_size", None)
    tokens = getattr(cfg.data, "vocab_size", None)
    if not (isinstance(rows, int) and isinstance(tokens, int)):
        return None
    padded = -(-tokens // VOCAB_MULTIPLE) * VOCAB_MULTIPLE  # what model.vocab_size=auto takes
    if rows <= padded:
        return None
    return (
        f"model.vocab_size={rows} is above data.vocab_size={tokens}: {rows - tokens} embedding "
        f"rows no token of the data uses; model.vocab_size=auto follows the data ({padded})"
    )


def announce(
    cfg: Config, rt: Runtime, run_dir: Path, model: nn.Module, board: TensorBoard, text: str
) -> None:
    """The run, once: its summary and config in TensorBoard, one line in the log."""
    params = sum(p.numel() for p in model.parameters())
    tree = OmegaConf.to_container(OmegaConf.create(text))
    board.describe_run(tree, describe(cfg, rt, params, text))
    log.info(
        "run dir %s | %d process(es), backend %s, device %s | %s, %.2fM parameters",
        run_dir, rt.world_size, rt.backend, rt.device, cfg.model._target_, params / 1e6,
    )  # fmt: skip
    unused = unused_vocabulary(cfg)
    if unused is not None and rt.is_primary:
        log.warning("%s", unused)


def build_board(run_dir: Path, rt: Runtime, root: Path, loaded: Loaded | None) -> TensorBoard:
    """Rank 0's TensorBoard writer. A run that continues this directory's own checkpoints drops
    what an earlier attempt logged after the checkpoint (purge_step); any other start (step 0,
    or another directory's checkpoint) first moves the event files it finds aside, and the
    earlier run's goodput.json with them: before this run's Goodput reads that file."""
    if loaded is not None and loaded.path.resolve().parent == root.resolve():
        return TensorBoard(run_dir, enabled=rt.is_primary, purge_step=loaded.step + 1)
    if rt.is_primary:
        aside = set_aside_earlier_run(run_dir)
        if aside is not None:
            log.warning(
                "%s holds TensorBoard event files or a goodput.json of an earlier run or "
                "attempt, whose checkpoints this run does not continue: moved them into %s",
                run_dir, aside,
            )  # fmt: skip
    return TensorBoard(run_dir, enabled=rt.is_primary)


def keep_tokenizer(cfg: Config, run_dir: Path) -> None:
    """A copy of the data's tokenizer.json in the run directory, which the after-training
    commands decode with (config.yaml holds its sha256)."""
    tokenizer = getattr(cfg.data, "tokenizer", BYTES)
    if tokenizer not in (BYTES, *UNDECODED):
        copy_to_run(tokenizer, run_dir)


@dataclass
class Run:
    """A built run: fit() trains it to trainer.max_steps (from its checkpoint, if it resumed)."""

    trainer: Trainer
    train_loader: DeviceLoader
    eval_loader: DeviceLoader
    board: TensorBoard
    goodput: Goodput

    def fit(self) -> None:
        ended = False
        try:
            self.trainer.fit(self.train_loader, self.eval_loader)
            ended = True
        finally:
            self._close(failing=not ended)

    def _close(self, *, failing: bool) -> None:
        """Every way out (the end, preemption, an error) runs each of these, even where one
        before it raised (the events' last write on a full disk): persistent DataLoader workers
        left running would keep a plain `python train.py` from exiting. A run that ended raises
        the first error met here; a failing run's own error stays the one said, these logged."""
        first: Exception | None = None
        closes = (
            self.goodput.save,
            lambda: self.board.close(failing=failing),
            self.train_loader.close,
            self.eval_loader.close,
        )
        for close in closes:
            try:
                close()
            except Exception as err:  # noqa: BLE001 - each close runs; the first is raised
                if failing or first is not None:
                    log.error("while the run ends: %s: %s", type(err).__name__, err)
                first = first or err
        if first is not None and not failing:
            raise first


def build_run(
    cfg: Config,
    rt: Runtime,
    run_dir: Path,
    config_text: str,
    *,
    preemption: Preemption | None = None,
    ctrl_c: CtrlC | None = None,
    started_at: float | None = None,
) -> Run:
    """Everything a run needs, built in this order on every rank. `started_at` (time.time()
    when the process started) is where goodput's start-up time counts from."""
    root = checkpoint_root(run_dir)
    # Nothing is written to the run directory until every check of the resume passed (the
    # model's shapes, the data, the optimizer's type): a refused resume leaves it as it was.
    loaded, token = resume_point(cfg.ckpt, root, rt)
    gpt = isinstance(cfg.model, GPTModelConfig)
    if loaded is not None:  # first: token ids of another tokenizer are named as such
        check_settings(
            loaded, cfg.optim, cfg.trainer.max_steps, say=rt.is_primary,
            residual=cfg.model.residual if gpt else None, config_text=config_text,
        )  # fmt: skip
    set_math_modes(cfg.trainer, rt.device)
    seed_everything(cfg.trainer.seed)  # the same initial weights on every rank
    model = build_model(cfg.model).to(rt.device)
    risk = fused_head_risk(cfg, rt.device.type, rt.distributed)
    if risk and cfg.model.head_loss == "auto" and rt.device.type == "cuda" and rt.is_primary:
        # (model.head_loss=fused stopped before the run started: mgpu.run.cli.check_config)
        log.warning(
            "model.head_loss=auto takes the loss through the logits: %s. "
            "model.residual=autocast keeps the fused head (and is faster)",
            risk,
        )
    no_autocast = autocast_dtype(cfg.trainer.precision, rt.device) is None
    if gpt and cfg.model.residual != "fp32" and no_autocast:
        # known only here: trainer.precision=auto means no autocast on a CPU
        log.warning(
            "model.residual=%s does nothing: trainer.precision=%s runs without autocast on %s, "
            "so the residual stream stays fp32",
            cfg.model.residual,
            cfg.trainer.precision.value,
            rt.device.type,
        )
    if cfg.trainer.precision is Precision.fp8:
        fp8.check_fp8(rt.device)
        # its linear layers (but those trainer.fp8_skip names); names and shapes unchanged
        model = fp8.convert(model, cfg.trainer.fp8_recipe, cfg.trainer.fp8_skip)
    # The model's layout, decided here once for the model and its inputs: convolutions run
    # faster in NHWC on a GPU.
    layout = None
    if rt.device.type == "cuda" and getattr(model, "channels_last", False):
        layout = torch.channels_last
        model = model.to(memory_format=layout)
    if loaded is not None:
        check_same_model(loaded, model, config_text, cfg.ckpt.resume)
    seed_everything(cfg.trainer.seed + rt.rank)  # then independent dropout per rank
    train_set = build_dataset(cfg.data, "train")
    eval_set = build_dataset(cfg.data, "eval")
    seed = cfg.trainer.seed
    # data.cpu_decode_share=auto: measured (or the checkpoint's) before any worker starts; the
    # training loader may move every JPEG to its workers once the step's pace is known.
    workers_rate = decode_split.resolve_auto(
        getattr(cfg.data, "cpu_decode_share", None), cfg.data.num_workers, [train_set, eval_set],
        rt, loaded.shared.get("dataset") if loaded is not None else None,
    )  # fmt: skip
    train_loader = build_loader(
        cfg.data, train_set, rt, seed=seed, train=True, layout=layout, workers_rate=workers_rate
    )
    eval_loader = build_loader(cfg.data, eval_set, rt, seed=seed, train=False, layout=layout)
    if loaded is not None:
        check_same_data(
            loaded, train_loader.sampler, config_text, cfg.ckpt.resume,
            held_out=getattr(train_set, "held_out", None),
        )  # fmt: skip
    if rt.is_primary:
        (run_dir / "config.yaml").write_text(config_text)
        keep_tokenizer(cfg, run_dir)
    board = build_board(run_dir, rt, root, loaded)  # first: it may set an earlier run aside
    # Rank 0 keeps the run's goodput file; the others count in memory only.
    goodput = Goodput(run_dir / GOODPUT_FILE if rt.is_primary else None, started_at=started_at)
    mfu = mfu_inputs(cfg.trainer, model, train_set, rt)
    optimizer = build_optimizer(cfg.optim, model, rt.device)
    with waiting(rt.rank, "the broadcast of rank 0's parameters (dist.engine's start)"):
        model = build_parallel_model(cfg, model, rt)
    if isinstance(model, MgpuDataParallel) and model.reducer.shards is not None:
        # dist.shard_optimizer: the optimizer steps this rank's shards of the reducer's buckets
        optimizer = ShardedOptimizer(optimizer, model.reducer.shards)
    schedule = build_schedule(cfg.optim, optimizer, cfg.trainer.max_steps)
    recorder = build_recorder(cfg, rt, board, model, train_set, mfu, goodput)
    tc = cfg.trainer
    if cfg.dist.engine is Engine.none and rt.world_size > 1 and rt.is_primary:
        log.warning(
            "dist.engine=none: every rank trains a model of its own, and a checkpoint holds "
            "rank 0's alone: a resume starts every rank from rank 0's model"
        )
    plan = CheckpointPlan(
        root, cfg.ckpt.every, cfg.ckpt.keep_last, token=token, config=config_text,
        max_failed_saves=cfg.ckpt.max_failed_saves,
    )  # fmt: skip
    trainer = Trainer(
        tc,
        model,
        optimizer,
        schedule,
        rt,
        recorder=recorder,
        input_transform=getattr(train_set, "device_transform", None),
        checkpointer=Checkpointer(plan, rt, seed=tc.seed, loaded=loaded),
        preemption=preemption,
        ctrl_c=ctrl_c,
        profiler=StepProfiler(tc.profile, tc.profile_start, tc.profile_steps, run_dir, rt),
        goodput=goodput,
    )
    if loaded is not None:
        trainer.load_state_dict(loaded.shared, source=str(loaded.path))
        del loaded  # its tensors are in the model and optimizer now
    announce(cfg, rt, run_dir, model, board, config_text)
    return Run(trainer, train_loader, eval_loader, board, goodput)
