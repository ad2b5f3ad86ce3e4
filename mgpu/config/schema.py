"""The trainer, dist, optim and ckpt groups' typed schemas behind `conf/`, with their checks
(building a `_target_` from config is mgpu.config.targets'). The data and model groups' schemas
are their folders' own (mgpu.data.config, mgpu.models.config); the whole Config composes them
all (mgpu.run.config).

Every key a user can set is a field with a docstring-comment; a bad value fails before any
process group or run directory exists, with one line naming the key, the value and how to fix it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from mgpu.config.checks import auto_or_bool, non_negative, positive, require

log = logging.getLogger(__name__)


# Enum member names are what users type (`trainer.precision=bf16`); OmegaConf rejects any other
# value at composition time with the allowed list.
class Precision(Enum):
    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
    fp8 = "fp8"  # linear layers' matrix multiplies in fp8 (torchao, mgpu.train.fp8), bf16 elsewhere


class Engine(Enum):
    mgpu = "mgpu"
    torch_ddp = "torch_ddp"
    none = "none"


class ReduceDtype(Enum):
    fp32 = "fp32"
    bf16 = "bf16"


class Compression(Enum):
    none = "none"
    powersgd = "powersgd"  # torch's PowerSGD communication hook (dist.engine=torch_ddp)


class Backend(Enum):
    auto = "auto"
    nccl = "nccl"
    gloo = "gloo"


class NonFinite(Enum):
    stop = "stop"
    skip = "skip"


class OptimizerName(Enum):
    adamw = "adamw"
    sgd = "sgd"


COMPILE_MODES = ("auto", "default", "reduce-overhead", "max-autotune-no-cudagraphs", "max-autotune")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that replay CUDA graphs
# torchao's float8 training recipes (trainer.fp8_recipe; mgpu.train.fp8.convert says what each
# scales)
FP8_RECIPES = ("tensorwise", "tensorwise_with_gw_hp", "rowwise", "rowwise_with_gw_hp")


@dataclass
class TrainerConfig:
    max_steps: int = 300  # optimizer steps to train for
    grad_accum_steps: int = 1  # micro-batches per optimizer step; gradients sync on the last only
    # auto: bf16 autocast on CUDA, fp32 on CPU; fp8: the linear layers' matrix multiplies in
    # fp8 through torchao's float8 training, bf16 elsewhere (Ada/Hopper GPUs only; mgpu.train.fp8)
    precision: Precision = Precision.auto
    # trainer.precision=fp8 only (read nowhere else): torchao's scaling recipe, tensorwise (one
    # scale per tensor), rowwise (one per row), or either with _with_gw_hp (the weight
    # gradient's matrix multiply in bf16); and the linear layers kept in bf16, by the end of
    # their names (attn.c_proj: every block's attention output; c_proj: the MLP's as well). A
    # name that matches no linear layer stops the run.
    fp8_recipe: str = "tensorwise"
    fp8_skip: list[str] = field(default_factory=list)
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off
    log_every: int = 10  # steps between TensorBoard/console records
    eval_every: int = 100  # steps between evaluations (also one at the end); 0: only at the end
    seed: int = 0  # model init, sampler shuffle and dropout all derive from it
    # torch.compile before wrapping for data parallelism (mgpu.models.compile_model says what is
    # compiled, and the loss with it): true, false, or auto (on for CUDA, off on CPU, where
    # compiling costs more than it saves on the small models a CPU trains).
    compile: Any = "auto"
    # torch.compile's backend for the model and the loss: inductor generates fused GPU kernels;
    # aot_eager captures the same graphs without generating code (checks compile on any host).
    compile_backend: str = "inductor"
    # torch.compile's mode for the model and the loss (inductor only): default, reduce-overhead
    # (each compiled region replayed as a CUDA graph, for steps bound by the host's launches),
    # max-autotune-no-cudagraphs, max-autotune; auto: mgpu.models.compile_mode decides (CUDA
    # graphs for a model compiled whole on a GPU, one micro-batch a step, where mgpu does not
    # replay the data-parallel step itself).
    compile_mode: str = "auto"
    # The forward, loss and backward captured from the first batch and replayed as CUDA graphs
    # (mgpu.train.graphs). auto: on a GPU, for a model neither compiled nor wrapped for data
    # parallelism, and on several processes with dist.engine=mgpu and one micro-batch a step,
    # where the replay records the reductions too (the model eager or compiled); true
    # where neither holds is an error.
    cuda_graphs: Any = "auto"
    # The optimizer step replayed as one CUDA graph (mgpu.train.update_replay): auto where the
    # backward replays its reductions (above), with a fused optimizer, unsharded, not fp16;
    # true elsewhere is an error; false never replays. auto measured on 4 H200s (docs/speed.md).
    replay_update: Any = "auto"
    # CUDA math modes, set once per process before the model is built. tf32: float32 matrix
    # multiplies and convolutions (what autocast leaves in fp32) on TF32 tensor cores.
    # cudnn_benchmark: cuDNN times its convolution algorithms per input shape and keeps the
    # fastest (results may differ in the last bits between processes: false repeats them).
    tf32: bool = True
    cudnn_benchmark: bool = True
    # torch's deterministic kernels only (torch.use_deterministic_algorithms; cuBLAS with a fixed
    # workspace, CUBLAS_WORKSPACE_CONFIG=:4096:8 unless set): a GPU run, resumed or not, repeats
    # bit for bit. Off by default: replayed steps then differ between runs in the last bits (the
    # GPT of tests/test_resume.py on one H200: up to 3e-5 in its weights after 20 steps). An op
    # with no deterministic kernel stops the run with torch's error naming it.
    deterministic: bool = False
    # A step whose loss or gradients are NaN/inf, on any rank: stop before the optimizer step,
    # or skip that step on every rank (at most max_consecutive_skips in a row, then stop).
    nonfinite: NonFinite = NonFinite.stop
    max_consecutive_skips: int = 5
    # fp16 only: the loss scale to start from; overflowing steps halve it, 2000 clean ones
    # double it (torch's GradScaler). Lower it if the first steps of a run all overflow.
    loss_scale_init: float = 65536.0
    # Seconds a rank may make no progress (a data loader that never yields, a stuck evaluation,
    # a host blocked behind a hung NCCL collective) before it fails naming the phase and the
    # rank behind; 0 turns it off. Below dist.timeout_s, so that on NCCL it reports before the
    # NCCL watchdog ends the process without a word about the other ranks.
    stall_timeout_s: float = 300.0
    # torch.profiler traces per rank (into <run dir>/profile/) for profile_steps steps from
    # step profile_start; NVTX ranges mark the phases of each step for Nsight Systems.
    profile: bool = False
    profile_start: int = 10
    profile_steps: int = 5
    # The device's peak dense TFLOP/s for MFU at the training precision; 0: from mgpu's table
    # of common GPUs (MFU is not reported on a device the table lacks, unless set here).
    peak_tflops: float = 0.0

    def __post_init__(self) -> None:
        positive("trainer.max_steps", self.max_steps, "1000")
        positive("trainer.max_consecutive_skips", self.max_consecutive_skips, "5")
        positive("trainer.loss_scale_init", self.loss_scale_init, "65536")
        non_negative("trainer.stall_timeout_s", self.stall_timeout_s, "300 (0 turns it off)")
        positive("trainer.profile_start", self.profile_start, "10")
        positive("trainer.profile_steps", self.profile_steps, "5")
        non_negative("trainer.peak_tflops", self.peak_tflops, "989 (0: mgpu's table)")
        positive("trainer.grad_accum_steps", self.grad_accum_steps, "4")
        non_negative("trainer.grad_clip", self.grad_clip, "1.0 (0 turns clipping off)")
        positive("trainer.log_every", self.log_every, "10")
        non_negative("trainer.eval_every", self.eval_every, "500 (0: only at the end)")
        non_negative("trainer.seed", self.seed, "0")
        require(
            not (self.deterministic and self.cudnn_benchmark),
            "trainer.cudnn_benchmark",
            self.cudnn_benchmark,
            "picks cuDNN's convolution algorithms by their speed in this process, which "
            "trainer.deterministic=true cannot repeat; set trainer.cudnn_benchmark=false with it",
        )
        self.compile = auto_or_bool("trainer.compile", self.compile)
        self.cuda_graphs = auto_or_bool("trainer.cuda_graphs", self.cuda_graphs)
        self.replay_update = auto_or_bool("trainer.replay_update", self.replay_update)
        require(
            self.compile_mode in COMPILE_MODES,
            "trainer.compile_mode",
            self.compile_mode,
            f"must be one of {', '.join(COMPILE_MODES)}",
        )
        # torch.compile's CUDA graphs hand backward's gradients over in buffers the next replay
        # writes again, and autograd keeps such a buffer as a parameter's .grad: a second
        # micro-batch overwrites the first's gradients before they are summed (GPT-2 XL with 16
        # micro-batches stopped at its first step on one H100, torch 2.11: "accessing tensor
        # output of CUDAGraphs that has been overwritten"). auto leaves the graphs out there.
        require(
            self.compile_mode not in CUDA_GRAPH_MODES or self.grad_accum_steps == 1,
            "trainer.compile_mode",
            self.compile_mode,
            f"replays backward as CUDA graphs, which overwrite one micro-batch's gradients with "
            f"the next's (trainer.grad_accum_steps={self.grad_accum_steps}); use "
            "trainer.compile_mode=auto or max-autotune-no-cudagraphs, or "
            "trainer.grad_accum_steps=1",
        )
        require(
            self.compile_mode in ("auto", "default") or self.compile_backend == "inductor",
            "trainer.compile_mode",
            self.compile_mode,
            f"needs trainer.compile_backend=inductor (it is {self.compile_backend}); "
            "or set trainer.compile_mode=default",
        )
        require(
            self.fp8_recipe in FP8_RECIPES,
            "trainer.fp8_recipe",
            self.fp8_recipe,
            f"must be one of {', '.join(FP8_RECIPES)}",
        )
        require(
            not isinstance(self.fp8_skip, str | bytes),
            "trainer.fp8_skip",
            self.fp8_skip,
            "is a list of names, e.g. trainer.fp8_skip=[attn.c_proj]",
        )
        for name in self.fp8_skip:
            require(
                isinstance(name, str) and name.strip(".") == name and bool(name),
                "trainer.fp8_skip",
                name,
                "each entry names a linear layer by the end of its name, e.g. "
                "trainer.fp8_skip=[attn.c_proj]",
            )
        require(
            bool(self.compile_backend),
            "trainer.compile_backend",
            self.compile_backend,
            "must name a torch.compile backend, e.g. inductor",
        )

        if self.precision is not Precision.fp8 and (
            self.fp8_skip or self.fp8_recipe != FP8_RECIPES[0]
        ):
            log.warning(
                "trainer.fp8_recipe=%s and trainer.fp8_skip=%s do nothing: they are read under "
                "trainer.precision=fp8 only, and this run's precision is %s",
                self.fp8_recipe,
                list(self.fp8_skip),
                self.precision.value,
            )

    def compiles(self, device_type: str) -> bool:
        """Whether `trainer.compile` means compiling on this device ("cuda", "cpu")."""
        return device_type == "cuda" if self.compile == "auto" else self.compile


BUCKET_CAP_MB = 25.0  # dist.bucket_cap_mb=auto: buckets launched by hooks during backward
LARGE_BUCKET_CAP_MB = 100.0  # auto on one node, the step replayed or the model compiled whole
WHOLE_ACROSS_NODES_CAP_MB = 256.0  # auto across nodes for a model compiled whole


@dataclass
class DistConfig:
    engine: Engine = Engine.mgpu  # how gradients are averaged across processes
    backend: Backend = Backend.auto  # auto: nccl when CUDA GPUs are visible, else gloo
    timeout_s: float = 600.0  # a collective that waits longer than this fails instead of hanging
    # Gradient bucket size in MB (mgpu and torch_ddp). auto, for mgpu on one node: 100 where the
    # step is replayed as CUDA graphs with its reductions inside (trainer.cuda_graphs: fewer,
    # larger all-reduces, launched by the replay, not from Python) or the model is compiled
    # whole; across nodes: 256 for a model compiled whole; else (torch_ddp always) 25.
    bucket_cap_mb: Any = "auto"
    first_bucket_mb: float = 1.0  # mgpu: the first bucket is small so communication starts early
    reduce_dtype: ReduceDtype = ReduceDtype.fp32  # mgpu: bf16 halves the bytes on the wire
    find_unused: bool = False  # reduce zeros for parameters that get no gradient in a step
    # Buffers (BatchNorm running statistics) follow rank 0's at the start of every optimizer
    # step. false: each rank keeps its own statistics (one collective less per step; rank 0's
    # are the ones checkpointed and evaluated).
    broadcast_buffers: bool = True
    # Each worker (and its DataLoader workers) on its own equal block of the node's CPUs, so
    # the ranks' launch threads and loader workers do not compete or migrate. auto: on where
    # DataLoader workers decode the user's images (Config.pins_cpus says why), else off.
    cpu_affinity: Any = "auto"
    # mgpu: at most this many SMs for NCCL's kernels (on a communicator of mgpu's own), leaving
    # the rest to the backward kernels they overlap with; 0: NCCL's own choice
    nccl_max_ctas: int = 0
    # mgpu: NCCL's kernels (and the reducer's stream) at high priority, on a communicator of
    # mgpu's own: the GPU's scheduler gives the reductions SMs before backward's or the decode's
    nccl_high_priority: bool = False
    ddp_bucket_view: bool = False  # torch_ddp: gradient_as_bucket_view
    ddp_static_graph: bool = False  # torch_ddp: static_graph
    # mgpu: ZeRO-1. Gradients reduce-scattered, each rank steps and keeps optimizer state for
    # 1/N of the parameters, which are all-gathered back (mgpu.comm.shard). fp16 scales its loss
    # with mgpu.optim.loss_scale (overflow agreed across ranks); one process runs it with one shard.
    shard_optimizer: bool = False
    # torch_ddp: gradients compressed on the wire by torch's PowerSGD hook (low-rank, with error
    # feedback), for slow links between nodes. powersgd_rank: the rank of its approximation;
    # powersgd_start_step: optimizer steps all-reduced uncompressed first (at least 2). A run
    # resumed from a checkpoint starts PowerSGD afresh (its error feedback is not saved).
    compression: Compression = Compression.none
    powersgd_rank: int = 4
    powersgd_start_step: int = 10

    def __post_init__(self) -> None:
        positive("dist.timeout_s", self.timeout_s, "600")
        cap = self.bucket_cap_mb
        number = isinstance(cap, int | float) and not isinstance(cap, bool)
        ok = cap == "auto" or (number and cap > 0)
        require(ok, "dist.bucket_cap_mb", cap, "must be auto or a size in MB > 0, e.g. 25")
        positive("dist.first_bucket_mb", self.first_bucket_mb, "1")
        self.cpu_affinity = auto_or_bool("dist.cpu_affinity", self.cpu_affinity)
        non_negative("dist.nccl_max_ctas", self.nccl_max_ctas, "4 (0: NCCL's choice)")
        ok = not self.nccl_high_priority or self.engine is Engine.mgpu
        why = f"sets mgpu's reducer only (dist.engine={self.engine.value}); set it false"
        require(ok, "dist.nccl_high_priority", self.nccl_high_priority, why)
        ok = not self.shard_optimizer or self.engine is Engine.mgpu
        why = f"needs dist.engine=mgpu (not {self.engine.value}); or set dist.shard_optimizer=false"
        require(ok, "dist.shard_optimizer", self.shard_optimizer, why)
        ok = self.compression is Compression.none or self.engine is Engine.torch_ddp
        why = (
            "runs as torch DDP's communication hook; set dist.engine=torch_ddp (mgpu's reducer "
            "compresses only to bf16: dist.reduce_dtype=bf16), or dist.compression=none"
        )
        require(ok, "dist.compression", self.compression.value, why)
        positive("dist.powersgd_rank", self.powersgd_rank, "4")
        start, why = self.powersgd_start_step, "must be >= 2 (torch's PowerSGD needs 2 plain steps)"
        require(start >= 2, "dist.powersgd_start_step", start, why)

    def recordable(self) -> bool:
        """Whether mgpu reduces the same buckets every step, which a CUDA graph can then record
        (mgpu.train.graphs): not under shard_optimizer (its shards are gathered after the
        optimizer) nor find_unused (which parameters get no gradient may change)."""
        return self.engine is Engine.mgpu and not self.shard_optimizer and not self.find_unused

    def bucket_cap(self, large: bool, one_node: bool = True, whole: bool = False) -> float:
        """dist.bucket_cap_mb in MB, auto resolved for ranks all on `one_node` or not, and for
        `large` buckets or not: large where the step is replayed with its reductions inside (no
        host launch per bucket) or the model is compiled `whole` (every gradient comes at
        backward's end, so a small first bucket starts nothing early). On one node on 4 H200s,
        100 MB beat 25 in every captured job that measured both: GPT-2-small eager 39.73 against
        40.94 ms and 39.64 against 40.39, compiled whole 35.21 against 36.20, ResNet-50 eager
        29.88 against 30.06; GPT-2 XL compiled whole with 4 micro-batches ran 1,260 ms with 256
        MB buckets against 1,286 block by block with 25 (bench/README.md). Across nodes a model
        compiled whole gets 256: GPT-2 XL so, 64 micro-batches, bf16 wire, over 2 x 2 H200 with
        NCCL sockets between them, ran 20,420 ms a step against 20,909 with 25 (alone 20,127).
        A replayed step across nodes is not measured: 25."""
        if self.bucket_cap_mb != "auto":
            return float(self.bucket_cap_mb)
        if large and one_node:
            return LARGE_BUCKET_CAP_MB
        return WHOLE_ACROSS_NODES_CAP_MB if large and whole else BUCKET_CAP_MB  # across nodes


@dataclass
class OptimConfig:
    name: OptimizerName = OptimizerName.adamw
    lr: float = 1e-3  # peak learning rate, reached after warmup
    weight_decay: float = 0.1  # applied to matrices and embeddings only, not to biases and norms
    warmup_steps: int = 20  # linear warmup from 0 to optim.lr
    min_lr_ratio: float = 0.1  # cosine decay ends at optim.lr * min_lr_ratio at trainer.max_steps
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])  # adamw
    eps: float = 1e-8  # adamw
    momentum: float = 0.9  # sgd

    def __post_init__(self) -> None:
        positive("optim.lr", self.lr, "3e-4")
        non_negative("optim.weight_decay", self.weight_decay, "0.1")
        non_negative("optim.warmup_steps", self.warmup_steps, "100")
        ok = 0 <= self.min_lr_ratio <= 1
        require(ok, "optim.min_lr_ratio", self.min_lr_ratio, "must be in [0, 1], e.g. 0.1")
        ok = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        require(ok, "optim.betas", self.betas, "must be two numbers in [0, 1), e.g. [0.9,0.95]")
        positive("optim.eps", self.eps, "1e-8")
        ok = 0 <= self.momentum < 1
        require(ok, "optim.momentum", self.momentum, "must be in [0, 1), e.g. 0.9")


@dataclass
class CheckpointConfig:
    every: int = 100  # steps between checkpoints; 0: only the final one at the end of training
    keep_last: int = 3  # newest valid checkpoints kept in <run dir>/checkpoints/; older deleted
    # auto: the newest valid one in the run dir, if any; never: start at step 0; or a run
    # directory (its newest valid checkpoint), or one checkpoint (<run dir>/checkpoints/step-N).
    # After a torchrun restart the newest valid one in the run dir comes first, whatever this is.
    resume: str = "auto"
    # Saves that may fail in a row (a full disk, a lost mount) before the run stops, naming the
    # directory and its free space: training on with no checkpoint would lose every step.
    max_failed_saves: int = 3

    def __post_init__(self) -> None:
        non_negative("ckpt.every", self.every, "100 (0: only the final checkpoint)")
        positive("ckpt.keep_last", self.keep_last, "3")
        positive("ckpt.max_failed_saves", self.max_failed_saves, "3")
        if self.resume not in ("auto", "never") and not os.path.exists(self.resume):
            why = "does not exist; name a run directory or one of its checkpoints"
            require(False, "ckpt.resume", self.resume, why)
        ok = self.resume in ("auto", "never") or os.path.isdir(self.resume)
        why = (
            "must be auto, never, a run directory (its newest valid checkpoint) or one of its "
            "checkpoints, <run dir>/checkpoints/step-NNNNNNNN"
        )
        require(ok, "ckpt.resume", self.resume, why)
        path = Path(self.resume)
        if ok and self.resume not in ("auto", "never") and not path.name.startswith("step-"):
            has = (path / "checkpoints").is_dir() or path.name == "checkpoints"
            why = (
                "is a directory with no checkpoints/ (it is not a run directory, or its run "
                "saved none yet); name a run directory or <run dir>/checkpoints/step-NNNNNNNN"
            )
            require(has or (path / "manifest.json").is_file(), "ckpt.resume", self.resume, why)
