"""The optimizer step's device work replayed as one CUDA graph (trainer.replay_update): the
global gradient norm, clipping, the ranks' agreement on a non-finite step (one collective) and the
fused optimizer's update, recorded once and replayed at every later step.

Owns: whether a run replays its update (replays_update), the capture, and the tensors a replay
reads (the step's loss, this rank's reason to stop, each parameter group's learning rate on the
device) and writes (the agreed flags, the verdict).

Why: with the forward and backward replayed, the update was the largest share of the training
thread's host time: on 2 H200s training ResNet-50 from a JPEG folder (py-spy, 50 Hz, every rank,
2026-11-28) 30-37 % of the main thread's samples fell in it (about 7 ms of a 21.7 ms step),
against 13-18 % in the replayed backward; a step whose host work comes near its GPU work leaves
no slack for the moments its host falls behind (bench/README.md, "The update replayed").

When: the update replays only where the step's backward is replayed with its reductions inside
(mgpu.train.graphs, GraphedLoss.replaying), so every gradient is the same tensor at every step,
where the capture read it; with a fused optimizer (its kernel takes the learning rate, the
clipping factor and the skip flag as device tensors); unsharded and without fp16's loss scaler
(whose step reads the host). The first update of a run runs uncaptured: it makes the optimizer's
state (AdamW's moments) outside the graph's memory, and NCCL has run the collective once.

Lifetime rules. A replay overwrites the flags and the verdict it returned last time; the guard
copies the flags to the host right after the replay, on the same stream (NonFiniteGuard.remember),
and the Recorder adds the verdict into its sums there too, before the next replay. The learning
rate is copied into its device tensor before each replay, on the compute stream, so a schedule's
new rate reaches the step it is meant for. The graph holds NCCL's communicator: it is destroyed
before the process group is (release).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from mgpu.config.checks import ConfigError
from mgpu.runtime.dist import release_before_leaving

log = logging.getLogger(__name__)

DeviceStep = Callable[[torch.Tensor, bool | torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def replays_update(
    setting: bool | str,
    device: torch.device,
    backward_replayed: bool,
    fused_optimizer: bool,
    sharded: bool,
    loss_scaled: bool,
) -> bool:
    """trainer.replay_update: auto replays where every condition holds (the module docstring
    says why each), true where one fails is an error naming it, false never replays."""
    why = None
    if device.type != "cuda":
        why = f"needs a CUDA device (this run is on {device})"
    elif not backward_replayed:
        why = (
            "replays the update of a step whose backward is replayed with its gradient "
            "reductions (trainer.cuda_graphs on several processes, dist.engine=mgpu, one "
            "micro-batch a step), so that every gradient is where the capture read it"
        )
    elif not fused_optimizer:
        why = "needs a fused optimizer (optim.name=adamw or sgd, as mgpu builds them)"
    elif sharded:
        why = "does not replay a sharded optimizer (dist.shard_optimizer=true)"
    elif loss_scaled:
        why = "does not replay fp16's loss scaler, whose step reads the host; use bf16"
    if setting == "auto" or not setting:
        return bool(setting) and why is None
    if why is not None:
        raise ConfigError("trainer.replay_update", setting, f"{why}; use auto or false")
    return True


class UpdateGraph:
    """`device_step(loss, stop)` (Update.device_step) replayed: called as it is, with the
    step's loss and this rank's reason to stop, it returns the agreed flags and the verdict.

    Uncaptured until `backward_replayed()` says the step's backward replays (GraphedLoss
    captures at the first step) and one update has run uncaptured; then captured from that
    step's call and replayed from it on."""

    def __init__(
        self,
        device_step: DeviceStep,
        optimizer: torch.optim.Optimizer,
        params: list[torch.nn.Parameter],
        backward_replayed: Callable[[], bool],
    ):
        self.device_step, self.optimizer, self.params = device_step, optimizer, params
        self.backward_replayed = backward_replayed
        self.graph: torch.cuda.CUDAGraph | None = None
        self.uncaptured = 0  # updates run uncaptured so far
        self.released = False

    def captured(self) -> bool:
        return self.graph is not None and not self.released

    def __call__(self, loss: torch.Tensor, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.released:
            raise RuntimeError("UpdateGraph called after release(): the process group is gone")
        if self.graph is None:
            if not self.uncaptured or not self.backward_replayed():
                self.uncaptured += 1
                return self.device_step(loss, stop)
            self._capture(loss)
        # The capture read the gradients at these tensors; a replay reads them there again.
        # The replayed backward hands over the same tensors every step (GraphedLoss): any other
        # would be read stale, so it stops the run instead.
        if any(p.grad is not g for p, g in zip(self.params, self.grads, strict=True)):
            raise RuntimeError(
                "trainer.replay_update: a parameter's gradient is not the tensor the update "
                "graph was captured with (the step's backward ran uncaptured, or .grad was "
                "replaced); set trainer.replay_update=false"
            )
        self.loss.copy_(loss)
        if stop:  # once asked, asked for the rest of the run (a Ctrl-C outranks a preemption)
            self.stop.fill_(stop)
        for rate, group in zip(self.rates, self.optimizer.param_groups, strict=True):
            rate.fill_(group["lr"])  # a kernel with the rate as its argument: no host sync
        self.graph.replay()
        return self.flags, self.bad

    def _capture(self, loss: torch.Tensor) -> None:
        """Record device_step with the group's learning rates as device tensors. A capture runs
        nothing: the replay that follows it does this step's update."""
        device = loss.device
        self.loss = loss.detach().clone()
        self.stop = torch.zeros((), dtype=torch.int32, device=device)
        # float32: the fused kernels read a device learning rate as one (a Python float is
        # rounded to it here, where the uncaptured step passes it as a double).
        groups = self.optimizer.param_groups
        self.rates = [torch.tensor(float(g["lr"]), device=device) for g in groups]
        self.grads = [p.grad for p in self.params]
        kept = [{k: g[k] for k in ("lr", "capturable") if k in g} for g in groups]
        # Sync point (once, at capture): the queued steps are done before recording starts.
        torch.cuda.synchronize(device)
        self.graph = torch.cuda.CUDAGraph()
        try:
            for group, rate in zip(groups, self.rates, strict=True):
                group["lr"] = rate  # read by the fused kernel from the device while recording
                if "capturable" in group:  # AdamW refuses a capture otherwise; its fused
                    group["capturable"] = True  # kernel is the same either way
            # thread_local: the loader's copy thread goes on allocating on its own stream.
            with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
                self.flags, self.bad = self.device_step(self.loss, self.stop)
        finally:
            for group, values in zip(groups, kept, strict=True):
                group.update(values)  # the schedule, checkpoints and logs keep a Python float
        release_before_leaving(self.release)
        log.info("trainer.replay_update: the optimizer step captured as a CUDA graph")

    def release(self) -> None:
        """Destroy the graph once the device has finished its last replay, so that the
        communicator its collective recorded can go; nothing replays after this."""
        torch.cuda.synchronize()
        if self.graph is not None:
            self.graph.reset()
        self.released = True
