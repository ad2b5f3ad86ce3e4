"""The model and its loss as one call, the forward that every step runs (eagerly, compiled, or
captured by mgpu.train.graphs), with the contract a user's model keeps checked where it is met."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mgpu.comm.engine import unwrap
from mgpu.config.checks import ConfigError


class ModelLoss(nn.Module):
    """The model and its loss as one call: model(inputs, targets) for a model that computes its
    own loss (GPT's head fused with the cross-entropy), else loss_fn(model(inputs), targets)."""

    def __init__(self, model: nn.Module, loss_fn: Callable | None):
        super().__init__()
        self.model, self.loss_fn = model, loss_fn

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # A user's model that breaks the contract is said here in one line (exit 2), where the
        # loss or the backward would fail deep in the step. Host checks of what the (possibly
        # compiled) model returned; under CUDA graphs they run in the capture's warm-up.
        if self.loss_fn is None:
            loss = self.model(inputs, targets)
            if not isinstance(loss, torch.Tensor):
                why = "it computes its own loss (computes_loss), and forward(inputs, targets) "
                why += f"returned a {type(loss).__name__}, not the loss: return the loss alone"
                raise ConfigError("model", type(unwrap(self.model)).__name__, why)
            return loss
        logits = self.model(inputs)
        if not isinstance(logits, torch.Tensor):
            why = f"its forward returned a {type(logits).__name__}, not a tensor of logits, which "
            why += "mgpu's loss (cross-entropy over the last dim) takes: return the logits alone "
            why += "(a model that computes its loss sets computes_loss = True and returns it)"
            raise ConfigError("model", type(unwrap(self.model)).__name__, why)
        return self.loss_fn(logits, targets)
