"""Model zoo for mgpu: GPT (language), ResNet and MLP (vision), built from conf/model's
`_target_`; the model group's schemas (config), the loss they train with (loss, fused_loss),
their training-FLOP counts (flops), and how a model is compiled (here).

May import: config, runtime.
"""

from dataclasses import dataclass

import torch
from torch import nn

from mgpu.config.checks import ConfigError
from mgpu.config.schema import CUDA_GRAPH_MODES, TrainerConfig
from mgpu.config.targets import build_from_target
from mgpu.models.config import ModelConfig
from mgpu.models.flops import count_training_flops
from mgpu.models.gpt import GPT
from mgpu.models.mlp import MLP
from mgpu.models.resnet import ResNet

__all__ = [
    "GPT",
    "MLP",
    "CompilePlan",
    "ResNet",
    "build_model",
    "compile_mode",
    "compile_model",
    "compile_plan",
    "compiled_whole",
    "count_training_flops",
    "repeated_blocks",
    "whole_for_mgpu",
]


def build_model(cfg: ModelConfig) -> nn.Module:
    """`cfg._target_(**kwargs)`: a built-in model or the user's own, by import path."""
    return build_from_target("model", cfg._target_, cfg.model_kwargs())


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the elements of its outermost nn.ModuleLists (GPT's
    transformer blocks). A block's own insides are not searched again."""
    if isinstance(model, nn.ModuleList):
        return list(model)
    return [block for child in model.children() for block in repeated_blocks(child)]


def compiled_whole(model: nn.Module, overlap: bool) -> bool:
    """Whether compile_model compiles `model` as one graph: always where no gradient is
    reduced while backward runs (`overlap` false: one process, or `dist.engine=none`), else
    only a model without repeated blocks."""
    return not overlap or not repeated_blocks(model)


def whole_for_mgpu(
    tc: TrainerConfig, device: torch.device, distributed: bool, recordable: bool, checkpointed: int
) -> bool:
    """Whether a model under mgpu's reducer on several GPUs is compiled whole, in torch's
    default mode, with every gradient reduced after backward (in large buckets:
    DistConfig.bucket_cap): compiled, on GPUs, with reductions a graph can record (`recordable`:
    DistConfig.recordable), trainer.compile_mode auto or default, no block recomputed in
    backward (`checkpointed`); and either one micro-batch a step with trainer.cuda_graphs auto
    or true (mgpu then replays the step as CUDA graphs with the reductions inside:
    mgpu.train.graphs), or several micro-batches a step (trainer.grad_accum_steps), whose
    reductions come once, after the last one's backward.

    Compiled block by block, buckets are reduced while backward runs, but the step loses
    inductor's fusions across blocks, and GPT's embeddings and head run eager, in every
    micro-batch. On 4 H200s, one micro-batch a step and replayed: GPT-2-small 35.21 ms a step
    against 37.14 block by block (one GPU alone: 31.72), ResNet-50 (compiled whole either way)
    21.45 against 21.54 with torch's own CUDA graphs and its reductions launched from Python
    (bench/results/engines-x4-whole-20261127-074646.json, engines-x4-r50c-20261127-074929.json).
    GPT-2 XL with 4 micro-batches a step: 1,260 ms against 1,286 block by block (one GPU alone:
    1,216; engines-x4-xl-20261127-101041.json)."""
    whole = (
        distributed
        and recordable
        and device.type == "cuda"
        and tc.compiles(device.type)
        and tc.compile_mode in ("auto", "default")
        and not checkpointed
    )
    return whole and (tc.grad_accum_steps > 1 or tc.cuda_graphs is not False)


def compile_mode(
    setting: str,
    backend: str,
    model: nn.Module,
    device: torch.device,
    ddp: bool = False,
    overlap: bool = True,
    accum: int = 1,
) -> str | None:
    """torch.compile's mode for `trainer.compile_mode` (None: torch's default).

    auto: reduce-overhead (CUDA graphs) for a model compiled whole on a GPU with inductor. Such
    a model has no gradient to hand over before its backward ends, and replaying the step as a
    graph takes the host's launches out of it: compiled ResNet-50 on one H100 went from 30.7 to
    24.1 ms a step, which had been bound by the host launching ~1,500 kernels
    (bench/results/vs_plain-NVIDIA_H100_80GB_HBM3-20261124-19*.json). torch's default for a
    model compiled block by block: its blocks' graphs hand their outputs to each other, and
    replaying them as CUDA graphs failed (an output read after the next replay overwrote it);
    GPT-2-small is GPU-bound anyway (CUDA graphs: 35.2 to 34.7 ms in a plain loop). Nor under
    torch DDP (`ddp`): its compiled graph is split at DDP's buckets by torch, which mgpu does not
    replay as CUDA graphs unasked. `overlap`: as for compile_model. Nor with several
    micro-batches a step (`accum`, trainer.grad_accum_steps): a replayed backward's gradients,
    kept by autograd as .grad, are overwritten by the next micro-batch's replay (TrainerConfig
    refuses such a mode set by hand, saying so).

    Measured and left out of auto (GPT-2-small, one H100, bench/README.md): inductor's
    coordinate-descent tuning of its kernels took 0.4 ms off a 35 ms step but ~95 s onto the
    compile (it pays back after ~200k steps); max-autotune had not compiled the model after
    470 s, and cuBLAS beat its Triton products in 14 of the 15 shapes it had timed."""
    whole = compiled_whole(model, overlap)
    if setting == "default":
        return None
    if setting != "auto":
        if setting in CUDA_GRAPH_MODES and not whole:
            raise ConfigError(
                "trainer.compile_mode",
                setting,
                "replays each compiled block as a CUDA graph, which fails for a model compiled "
                "block by block (an output of one replay is read after the next overwrote it); "
                "use auto, default or max-autotune-no-cudagraphs",
            )
        return setting
    graphs = whole and not ddp and accum == 1 and device.type == "cuda" and backend == "inductor"
    return "reduce-overhead" if graphs else None


@dataclass(frozen=True)
class CompilePlan:
    """How trainer.compile compiles a model for a run (compile_plan)."""

    whole: bool  # one graph, its gradients reduced after backward (whole_for_mgpu)
    overlap: bool  # buckets reduced while backward runs: compiled block by block
    mode: str | None  # torch.compile's mode (compile_mode); None: torch's default


def compile_plan(
    tc: TrainerConfig,
    model: nn.Module,
    device: torch.device,
    *,
    distributed: bool,
    reduces: bool,
    ddp: bool,
    recordable: bool,
) -> CompilePlan:
    """The one decision that mgpu.run.build compiles `model` (unwrapped) by, and that the Trainer
    then compiles the loss and replays the step by. `reduces`: its gradients are averaged across
    processes (dist.engine is not none), `ddp` by torch DDP; `recordable`: by mgpu's reducer,
    the same buckets every step (DistConfig.recordable)."""
    # GPT's checkpointed blocks (model.activation_checkpointing); 0 for other models
    checkpointed = getattr(model, "checkpointed", 0)
    whole = whole_for_mgpu(tc, device, distributed, recordable, checkpointed)
    # A world of one (wrapped only under dist.shard_optimizer) reduces nothing during backward.
    overlap = reduces and distributed and not whole
    mode = None  # compiled whole in torch's default mode (mgpu replays the step: train.graphs)
    if not whole:
        ddp = ddp and distributed
        args = (model, device, ddp, overlap, tc.grad_accum_steps)
        mode = compile_mode(tc.compile_mode, tc.compile_backend, *args)
    return CompilePlan(whole, overlap, mode)


def compile_model(
    model: nn.Module, backend: str = "inductor", mode: str | None = None, overlap: bool = True
) -> nn.Module:
    """torch.compile that keeps gradient communication overlapped with backward.

    A whole-model compile runs backward as one graph that hands every gradient over at its end,
    so no bucket could be reduced while backward runs. Where buckets are reduced during
    backward (`overlap`: a model wrapped for data parallelism on several processes), each
    repeated block (every element of an nn.ModuleList) is compiled instead and yields gradients
    block by block; what lies between the blocks (GPT's embeddings and head) stays eager. Where
    nothing is reduced (one process, or `dist.engine=none`), the whole model is one graph, as
    a hand-written loop compiles it: GPT-2-small on one H100 ran at 35.85 ms a
    step block by block against 35.23 ms for the plain loop's single graph
    (bench/results/vs_plain-NVIDIA_H100_80GB_HBM3-20261124-195359.json). Module.compile works
    in place, so parameter names (and checkpoints) stay as they were.

    Models without a ModuleList are compiled whole, nn.Sequential stacks included. Compiling
    ResNet-50's 16 residual blocks one by one instead ran at 46.9 ms a step against 34.4 ms for
    the whole model under mgpu on 4 H200s, with 11 ms of communication left exposed against
    0.5 ms (bench/results/engines-nvlink-x4-resnet-compile-20261122-114556.json).
    """
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        examples = ", ".join(torch.compiler.list_backends())
        raise ConfigError(
            "trainer.compile_backend", backend, f"is not a torch.compile backend; e.g. {examples}"
        )
    for block in [model] if compiled_whole(model, overlap) else repeated_blocks(model):
        block.compile(backend=backend, mode=mode)
    return model
