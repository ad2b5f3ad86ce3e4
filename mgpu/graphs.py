"""CUDA graphs for a model trained uncompiled (`trainer.cuda_graphs`): its forward with the loss,
and their backward, captured once from the first batch and replayed at every step after.

Owns: whether a run replays (use_graphs), the capture, and what a replay needs: a batch shaped as
the captured one, BatchNorm statistics untouched by the capture's warm-up, and gradients that a
replay cannot overwrite while they are still being summed.

Why: an uncompiled step launches each kernel from Python, one after another. ResNet-50 launches
~1,500 a step, and the launching thread, not the GPU, bounds it: on one H100 an eager plain loop
ran 36.08 ms a step and the same kernels replayed as CUDA graphs 33.49 ms; GPT-2-small, whose GPU
is the bound, ran 51.68 and 51.53 ms (bench/results/vs_plain-NVIDIA_H100_80GB_HBM3-20261125-
132406.json). The graphs hold the eager kernels themselves (torch.cuda.make_graphed_callables
records them), so a replayed step computes what the eager step computes.

Lifetime rules. A replay writes the loss, and the gradients it hands to autograd, into buffers the
graphs own; the next replay overwrites them. The Trainer adds the loss into its step total on the
same stream before the next micro-step, and the optimizer reads the gradients before the next
step's backward. With one micro-batch a step that is all: autograd may keep a graph's gradient
buffer as a parameter's .grad, and the step is done with it before the next replay. With several,
each .grad must be a tensor of its own (keep_grads), else the second replay would overwrite the
first micro-batch's gradients in .grad before they are added to.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from mgpu.config_checks import ConfigError
from mgpu.dist import RunStopped

log = logging.getLogger(__name__)


class CaptureError(RuntimeError, RunStopped):
    """The model's step could not be captured as CUDA graphs; the message says how to go on."""


def use_graphs(setting: bool | str, device: torch.device, compiled: bool, wrapped: bool) -> bool:
    """Whether the run replays its uncompiled model as CUDA graphs. auto: on a GPU, for a model
    neither compiled (a compiled model's graphs are trainer.compile_mode's) nor wrapped for data
    parallelism (whose buckets are reduced while backward runs: a replayed backward hands every
    gradient over at its end). true where that does not hold is an error that says why."""
    if setting == "auto":
        return device.type == "cuda" and not compiled and not wrapped
    if not setting:
        return False
    key = "trainer.cuda_graphs"
    if device.type != "cuda":
        raise ConfigError(key, setting, f"needs a CUDA device (this run is on {device}); use auto")
    if compiled:
        raise ConfigError(
            key,
            setting,
            "replays an uncompiled model; a compiled model is replayed as CUDA graphs by "
            "trainer.compile_mode (reduce-overhead, which auto picks for a model compiled "
            "whole); set trainer.compile=false or trainer.cuda_graphs=auto",
        )
    if wrapped:
        raise ConfigError(
            key,
            setting,
            "a replayed backward hands every gradient over at its end, so data parallelism "
            "could not reduce gradient buckets while backward runs; use auto (off here) or false",
        )
    return True


class ModelLoss(nn.Module):
    """The model and its loss as one call: model(inputs, targets) for a model that computes its
    own loss (GPT's head fused with the cross-entropy), else loss_fn(model(inputs), targets)."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.loss_fn is None:
            return self.model(inputs, targets)
        return self.loss_fn(self.model(inputs), targets)


def _signature(*tensors: torch.Tensor) -> tuple:
    return tuple((t.shape, t.dtype, t.device) for t in tensors)


class GraphedLoss:
    """ModelLoss replayed as CUDA graphs: captured at the first call, from that batch, under
    autocast to `amp_dtype` (None: fp32); called as ModelLoss is, inside the step's autocast."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None, amp_dtype: torch.dtype | None):
        self.model, self.loss_fn, self.amp_dtype = model, loss_fn, amp_dtype
        self.eager = ModelLoss(model, loss_fn)
        self.replay: nn.Module | None = None
        self.captured: tuple = ()
        self.warned = False

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.replay is None:
            self._capture(inputs, targets)
        if _signature(inputs, targets) != self.captured:
            # A graph replays fixed shapes. Training batches all have one shape (the loader
            # drops the last partial batch); a loader given to fit that does not runs its other
            # batches uncaptured, correctly and at eager speed.
            if not self.warned:
                log.warning(
                    "trainer.cuda_graphs: a batch of %s differs from the captured %s; batches "
                    "like it run uncaptured",
                    _signature(inputs, targets),
                    self.captured,
                )
                self.warned = True
            return self.eager(inputs, targets)
        return self.replay(inputs, targets)

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        # The capture runs the step's forward and backward three times on a side stream to warm
        # up (cuDNN picks its algorithms there, not while recording) and synchronises the device:
        # a one-time sync point, at the first step. The warm-up would also move BatchNorm's
        # running statistics three batches on; they are put back, in place, since the graphs
        # hold the buffers' addresses.
        buffers = list(self.model.buffers())
        saved = [b.clone() for b in buffers]
        # The graphs keep their sample batch as the buffers every replay copies its inputs into:
        # copies of the batch, not the loader's own tensors, which it reuses for later batches.
        sample = (inputs.clone(), targets.clone())
        # make_graphed_callables refuses autocast's cache of cast weights (a replay cannot
        # consult it); a cast recorded in the graph is replayed instead.
        enabled = self.amp_dtype is not None
        autocast = torch.autocast(
            inputs.device.type, dtype=self.amp_dtype, enabled=enabled, cache_enabled=False
        )
        try:
            with autocast:
                self.replay = torch.cuda.make_graphed_callables(
                    ModelLoss(self.model, self.loss_fn), sample
                )
        except Exception as err:
            raise CaptureError(
                f"trainer.cuda_graphs: capturing {type(self.model).__name__} and its loss as CUDA "
                f"graphs failed ({err}); a model whose step reads GPU values on the host, changes "
                "shape from step to step or leaves parameters without gradients cannot be "
                "replayed. Set trainer.cuda_graphs=false to train it uncaptured."
            ) from err
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)
        # The capture made each parameter's gradient accumulator on its warm-up stream, and the
        # graphs keep those alive, so autograd runs them there, ordered after the replay by an
        # event each, and backward's end orders the current stream after them: correct, and
        # what torch warns of on the first backward; said here instead.
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
        self.captured = _signature(inputs, targets)
        log.info(
            "trainer.cuda_graphs: %s and its loss captured as CUDA graphs for batches of %s",
            type(self.model).__name__,
            self.captured,
        )


def keep_grads(params: Sequence[nn.Parameter]) -> None:
    """Give every parameter a zeroed .grad of its own where it has none, so that a replayed
    backward adds into it rather than lending it the graph's buffer (the module docstring says
    why). Called before the first micro-batch's backward of a step."""
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
