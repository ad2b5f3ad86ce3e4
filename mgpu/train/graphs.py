"""CUDA graphs for a model trained uncompiled (`trainer.cuda_graphs`): its forward with the loss,
and their backward, captured once from the first batch and replayed at every step after.

Owns: whether a run replays (use_graphs), the capture, and what a replay needs: a batch shaped as
the captured one, BatchNorm statistics untouched by the capture's warm-up, and gradients that a
replay cannot overwrite while they are still being summed.

Why: an uncompiled step launches each kernel from Python, one after another. ResNet-50 launches
~1,500 a step, and the launching thread, not the GPU, bounds it: on one H100 an eager plain loop
ran 36.08 ms a step and the same kernels replayed as CUDA graphs 33.49 ms; GPT-2-small, whose GPU
is the bound, ran 51.68 and 51.53 ms (bench/results/vs_plain-NVIDIA_H100_80GB_HBM3-20261125-
132406.json). The graphs hold the eager kernels themselves, recorded from the eager step, so a
replayed step computes what the eager step computes.

Lifetime rules. A replay writes the loss, and the gradients it hands to autograd, into buffers the
graphs own; the next replay overwrites them. The Trainer adds the loss into its step total on the
same stream before the next micro-step, and the optimizer reads the gradients before the next
step's forward replay. Autograd may keep a graph's gradient buffer as a parameter's .grad (no
copy); with several micro-batches a step, the forward replay copies such a .grad out first
(_Replay.forward): the forward replay may write its temporaries over that buffer (the two graphs
share one memory pool) and the backward replay writes it anew.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch import nn

from mgpu.comm.engine import MgpuDataParallel
from mgpu.config.checks import ConfigError
from mgpu.runtime.dist import RunStopped, release_before_leaving
from mgpu.train.model_loss import ModelLoss
from mgpu.train.replay_checks import Signature, difference, unreplayed_hooks

log = logging.getLogger(__name__)


class CaptureError(RuntimeError, RunStopped):
    """The model's step could not be captured as CUDA graphs; the message says how to go on.
    Said by the rank it happened on: ranks training apart (dist.engine=none) capture apart."""

    every_rank = False


def use_graphs(
    setting: bool | str,
    device: torch.device,
    compiled: bool,
    wrapped: bool,
    checkpointed: int = 0,
    captures_reduction: bool = False,
) -> bool:
    """Whether the run replays its model as CUDA graphs. auto: on a GPU, for a model neither
    compiled (a compiled model's graphs are trainer.compile_mode's) nor wrapped for data
    parallelism (whose buckets are reduced while backward runs: a replayed backward would hand
    every gradient over at its end), nor with `checkpointed` blocks (model.activation_checkpointing:
    torch.utils.checkpoint takes the CUDA generator's state on the host in forward and sets it
    back before it recomputes, so that dropout draws the same masks; a capture records neither,
    and torch refuses to set a generator's state while capturing). true where that does not
    hold is an error that says why.

    `captures_reduction` (reduction_in_graphs says when): the model is wrapped by mgpu's reducer,
    whose bucket reductions the backward capture records on the communication stream, so the
    replayed backward overlaps them as an eager one does. Such a model replays under auto and
    `true`, compiled (whole by default, without CUDA graphs of torch.compile's own) or not: on 4
    H200s it kept 0.968 of one GPU's step for ResNet-50 eager against 0.892 uncaptured, and
    GPT-2-small compiled ran 35.8 ms a step against 41.6 (bench/README.md, "Reductions inside
    CUDA graphs")."""
    if captures_reduction:
        compiled = wrapped = False  # nothing of either stands in the replay's way
    if setting == "auto":
        if device.type == "cuda" and not compiled and not wrapped and checkpointed:
            log.info(
                "trainer.cuda_graphs=auto: off, since model.activation_checkpointing "
                "recomputes %d block(s) in backward, which a CUDA graph replay cannot repeat",
                checkpointed,
            )
            return False
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
            "records mgpu's gradient reductions into the replayed backward only with "
            "dist.engine=mgpu on several processes, trainer.grad_accum_steps=1, "
            "dist.shard_optimizer=false and dist.find_unused=false (and no compile_mode with "
            "CUDA graphs of its own); elsewhere a replayed backward would hand every gradient "
            "over at its end. Use auto (off here) or false",
        )
    if checkpointed:
        raise ConfigError(
            key,
            setting,
            f"cannot replay model.activation_checkpointing's recompute of {checkpointed} "
            "block(s) (it sets the CUDA generator's state from the host, which a capture does "
            "not record); set model.activation_checkpointing=none or trainer.cuda_graphs=auto",
        )
    return True


WARMUP_STEPS = 3  # uncaptured steps before capturing, on a side stream (see _capture)


def reduction_in_graphs(model: nn.Module, distributed: bool, accum: int, own_graphs: bool) -> bool:
    """Whether the backward capture can record mgpu's gradient reductions: a model wrapped by
    mgpu's reducer (MgpuDataParallel) on several processes, one micro-batch a step (a replayed
    backward reduces what it computed; accumulation reduces the sum of several), a reducer that
    reduces the same buckets every step (GradReducer.capturable), and no CUDA graphs of
    torch.compile's own (`own_graphs`: trainer.compile_mode's reduce-overhead) inside."""
    if not (isinstance(model, MgpuDataParallel) and distributed and accum == 1):
        return False
    return model.reducer.capturable() and not own_graphs


class _Replay(torch.autograd.Function):
    """One replay of the captured forward, and of the captured backward when autograd asks for
    the gradients; the parameters are inputs so that autograd hands them their gradients."""

    @staticmethod
    def forward(ctx, graphs: GraphedLoss, inputs, targets, *params):  # noqa: ANN001
        ctx.graphs = graphs
        # A .grad that autograd kept from the last backward replay is a buffer of the graphs'
        # memory pool, which this forward replay may write its temporaries into (forward and
        # backward share the pool) and the backward replay writes anew. Under gradient
        # accumulation it is copied out first, so that this micro-batch's gradients are added
        # to it; with one micro-batch a step, the optimizer has read it and zero_grad dropped it.
        # (A replay that reduces is never one of several micro-batches: reduction_in_graphs.)
        kept = [] if graphs.reduces else zip(graphs.params, graphs.grads, strict=True)
        for p, g in kept:
            if g is not None and p.grad is not None and p.grad.data_ptr() == g.data_ptr():
                p.grad = p.grad.clone()
        graphs.inputs.copy_(inputs)
        graphs.targets.copy_(targets)
        graphs.forward_graph.replay()
        return graphs.loss.detach()  # the graph's own buffer: the next replay overwrites it

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):  # noqa: ANN001
        graphs = ctx.graphs
        graphs.grad_loss.copy_(grad_loss)
        graphs.backward_graph.replay()
        if graphs.reduces:
            # The replay accumulated and reduced the gradients where the capture left them (the
            # reducer's buckets, or a parameter's own buffer): they are .grad again, as the
            # capture made them; autograd gets nothing to add.
            for p, g in zip(graphs.params, graphs.grads, strict=True):
                p.grad = g
            return None, None, None, *(None for _ in graphs.params)
        # The graph's gradient buffers, detached: autograd may keep them as .grad (the module
        # docstring says for how long that is safe).
        grads = [g.detach() if g is not None else None for g in graphs.grads]
        return None, None, None, *grads


class GraphedLoss:
    """ModelLoss replayed as CUDA graphs: captured at the first call, from that batch, under
    autocast to `amp_dtype` (None: fp32); called as ModelLoss is, inside the step's autocast.
    `required` (trainer.cuda_graphs=true): a model that cannot be replayed is an error; under
    auto it trains uncaptured, with a warning that says why. `reduces` (reduction_in_graphs):
    the backward capture records mgpu's reducer reducing the gradients, bucket by bucket on its
    communication stream while backward computes; a replay then leaves them reduced in .grad."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: Callable | None,
        amp_dtype: torch.dtype | None,
        required: bool = False,
        reduces: bool = False,
    ):
        self.model, self.amp_dtype, self.required = model, amp_dtype, required
        self.reduces = reduces
        if reduces:  # the reducer's buckets as a replay reduces them best (dist.bucket_cap_mb)
            model.use_large_buckets()
        self.eager = ModelLoss(model, loss_fn)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.captured: tuple = ()
        # What the capture assumed, taken again at every step (replay_checks.Signature)
        self.signature = Signature(model)
        self.off = False  # auto, and the model has hooks a replay would not run
        self.warned = False
        self.released = False  # release(): the process left its process group

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.released:
            raise RuntimeError("GraphedLoss called after release(): the process group is gone")
        if self.off:
            return self.eager(inputs, targets)
        if not self.captured:
            if not self._capture(inputs, targets):
                return self.eager(inputs, targets)
        now = self.signature(inputs, targets)
        if now != self.captured:
            # A graph replays fixed shapes, one train/eval mode, one set of parameters with
            # gradients, at fixed addresses. Training batches all have one shape (the loader
            # drops the last partial batch) and fit trains in train mode; a call that differs (a
            # loader given to fit that keeps partial batches, a module put in eval mode, a
            # parameter unfrozen or given new storage after the capture) runs uncaptured,
            # correctly and at eager speed.
            if self.reduces:
                raise CaptureError(
                    "trainer.cuda_graphs: a training step differs from the captured one "
                    f"({difference(self.captured, now)}); under data parallelism the "
                    "captured step reduces the gradients, so every step must replay it. Train "
                    "on batches of one shape (data loaders drop ragged last batches), or set "
                    "trainer.cuda_graphs=false"
                )
            if not self.warned:
                log.warning(
                    "trainer.cuda_graphs: a step differs from the captured one (%s); steps like "
                    "it run uncaptured",
                    difference(self.captured, now),
                )
                self.warned = True
            return self.eager(inputs, targets)
        return _Replay.apply(self, inputs, targets, *self.params)

    def replaying(self) -> bool:
        """Whether steps now replay the captured backward with its reductions: every parameter's
        .grad then the same tensor at every step (what mgpu.train.update_replay records)."""
        return self.reduces and bool(self.captured) and not (self.off or self.released)

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> bool:
        """Record the graphs from this batch; False where hooks keep the model uncaptured."""
        hooks = unreplayed_hooks(self.model)
        if hooks:
            why = (
                f"{type(self.model).__name__} has {', '.join(hooks[:3])}"
                f"{' and more' if len(hooks) > 3 else ''}, which a replay would not run as an "
                "eager step does"
            )
            if self.required:
                raise CaptureError(
                    f"trainer.cuda_graphs=true: {why}; remove the hooks, or set "
                    "trainer.cuda_graphs=auto (trains uncaptured) or false"
                )
            log.warning("trainer.cuda_graphs=auto: %s; training uncaptured", why)
            self.off = True
            return False
        # The warm-up draws dropout masks as eager steps do; the CUDA generator is put back
        # after, so that the replays draw what eager steps from here would (a replay advances it
        # by what its recorded kernels draw), and a run resumed from a checkpoint, which
        # captures again, draws what the uninterrupted run drew.
        rng = torch.cuda.get_rng_state(inputs.device)
        try:
            self._record(inputs, targets)
        except ConfigError:  # the model breaks mgpu's contract (ModelLoss): said as it is
            raise
        except Exception as err:
            raise CaptureError(
                f"trainer.cuda_graphs: capturing {type(self.model).__name__} and its loss as CUDA "
                f"graphs failed ({err}); a model whose step reads GPU values on the host or "
                "changes shape from step to step cannot be replayed, nor can a step recorded "
                "while another thread draws CUDA random numbers (a random transform on the "
                "device). Set trainer.cuda_graphs=false to train it uncaptured."
            ) from err
        torch.cuda.set_rng_state(rng, inputs.device)
        self.captured = self.signature(inputs, targets)
        log.info(
            "trainer.cuda_graphs: %s and its loss captured as CUDA graphs for batches of %s",
            type(self.model).__name__,
            self.captured[0],
        )
        return True

    def _record(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        """Warm up, record the forward and backward graphs, put BatchNorm's statistics back."""
        # The buffers every replay copies its batch into: copies of the first batch, not the
        # loader's own tensors, which it reuses for later batches.
        self.inputs, self.targets = inputs.clone(), targets.clone()
        # autocast's cache of cast weights is off while recording: a cast cached by an earlier
        # forward would be read, not recorded, and the replay would reuse a stale copy.
        autocast = torch.autocast(
            inputs.device.type,
            dtype=self.amp_dtype,
            enabled=self.amp_dtype is not None,
            cache_enabled=False,
        )
        # Warm-up, uncaptured, on a side stream: cuDNN picks its algorithms, cuBLAS its
        # workspaces, Triton compiles, none of which may happen while recording. It moves
        # BatchNorm's running statistics WARMUP_STEPS batches on: they are put back after, in
        # place, since the graphs hold the buffers' addresses. The synchronize calls around it
        # are the capture's sync points, once, at the first step.
        buffers = list(self.model.buffers())
        saved = [b.clone() for b in buffers]
        torch.cuda.synchronize()
        # Backward runs outside autocast, as the eager step's does (train_step): autocast would
        # otherwise recast what backward computes in fp32 (autocast reaches backward's thread).
        no_autocast = torch.autocast(inputs.device.type, enabled=False)
        with torch.cuda.stream(torch.cuda.Stream()):
            for _ in range(WARMUP_STEPS):
                with autocast:
                    loss = self.eager(self.inputs, self.targets)
                with no_autocast:
                    if self.reduces:
                        # The reducer's collectives run too: NCCL sets up what they need before
                        # it is recorded, and the reducer lays its buckets out in the gradient
                        # order it observed (at its second step) before the graph fixes them.
                        loss.backward()
                        for p in self.params:
                            p.grad = None
                    else:
                        torch.autograd.grad(loss, self.params, allow_unused=True)
            del loss
        torch.cuda.synchronize()
        if self.reduces:  # its stamps' kernel is built now: recording must not compile one
            self.model.reducer.stamp_replays()
        # thread_local: the loader's copy thread goes on issuing copies and allocations on its
        # own stream while this thread records; a process-wide ("global") capture would be
        # invalidated by them. Forward and backward share one memory pool, recorded in the
        # order they replay: the backward graph's gradients may sit where the forward graph's
        # temporaries go (what _Replay.forward copies out under accumulation).
        pool = torch.cuda.graph_pool_handle()
        self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward_graph, pool=pool, capture_error_mode="thread_local"):
            with autocast:
                loss = self.eager(self.inputs, self.targets)
        self.grad_loss = torch.ones_like(loss)
        if self.reduces:
            self.grads = self._record_reduced_backward(loss, pool, no_autocast)
        else:
            with (
                torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"),
                no_autocast,
            ):
                self.grads = torch.autograd.grad(
                    loss, self.params, grad_outputs=self.grad_loss, allow_unused=True
                )
        # The loss's buffer, without the recorded autograd graph behind it (whose gradient
        # accumulators were made on the capture's stream; the replays make their own).
        self.loss = loss.detach()
        with torch.no_grad():
            for buffer, value in zip(buffers, saved, strict=True):
                buffer.copy_(value)

    def _record_reduced_backward(self, loss: torch.Tensor, pool, no_autocast) -> list:
        """Record backward as a training step runs it, gradients accumulated into .grad, so that
        the reducer's hooks fire inside the capture: each bucket's copy into its flat tensor,
        its all-reduce on the communication stream as soon as backward has produced it, and the
        compute stream's wait for all of them at the end (the reducer's stream rules; NCCL
        collectives are captured like kernels). The ranks record the same collectives in the
        same order, since every rank captures at the same step. Returns each parameter's .grad
        as the capture left it: where every replay leaves that step's reduced gradient."""
        for p in self.params:
            p.grad = None  # accumulation starts from nothing, as after the optimizer's zero_grad
        with (
            torch.cuda.graph(self.backward_graph, pool=pool, capture_error_mode="thread_local"),
            no_autocast,
        ):
            loss.backward(self.grad_loss)
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None  # a capture computes nothing: what it left there is not a gradient
        # The replays reduce from here on: the reducer's hooks come off, or every replayed
        # step would reduce its buckets a second time, from Python, after the graph did (seen
        # on 2 H200s: GPT-2-small 41.8 ms a step with them against 39.9 uncaptured).
        self.model.reducer.remove()
        # These graphs hold NCCL's communicator: they must be gone before the process group.
        release_before_leaving(self.release)
        return grads

    def release(self) -> None:
        """Destroy the captured graphs (after the device has finished their last replay), so
        that the communicator their collectives recorded can be destroyed; nothing replays
        after this (the process is leaving its process group)."""
        torch.cuda.synchronize()
        self.forward_graph.reset()
        self.backward_graph.reset()
        self.released = True
