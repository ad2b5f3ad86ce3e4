"""MLP classifier: flatten, a Linear+GELU stack, then a Linear head; with its analytic FLOPs."""

import math

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int,
        num_classes: int,
        hidden: list[int] = (256, 256),
        dropout: float = 0.0,
    ):
        super().__init__()
        if in_features < 1 or num_classes < 1 or any(h < 1 for h in hidden):
            raise ValueError(
                f"MLP sizes must be positive, got in_features={in_features}, "
                f"num_classes={num_classes}, hidden={list(hidden)}"
            )
        self.in_features = in_features
        self.widths = [in_features, *hidden, num_classes]
        layers: list[nn.Module] = []
        for c_in, c_out in zip(self.widths[:-2], self.widths[1:-1], strict=True):
            layers += [nn.Linear(c_in, c_out), nn.GELU(), nn.Dropout(dropout)]
        layers.append(nn.Linear(self.widths[-2], num_classes))
        self.net = nn.Sequential(*layers)

    def _check_features(self, per_sample: int) -> None:
        if per_sample != self.in_features:
            raise ValueError(
                f"MLP expects {self.in_features} features per sample, got {per_sample}"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"MLP expects a batch [B, ...], got shape {tuple(x.shape)}")
        self._check_features(math.prod(x.shape[1:]))
        return self.net(x.flatten(1))

    def flops_per_sample(self, sample_shape: tuple[int, ...]) -> float:
        """Training FLOPs (fwd + bwd) for one sample: 2 FLOPs per weight multiply-accumulate,
        once forward and twice backward (grad of weight, grad of input).

        The first layer gets no input-gradient matmul, because the data does not require
        grad; autograd skips it, so it is left out here too (4 instead of 6 per MAC).
        """
        self._check_features(math.prod(sample_shape))
        macs = [c_in * c_out for c_in, c_out in zip(self.widths[:-1], self.widths[1:], strict=True)]
        return float(6 * sum(macs) - 2 * macs[0])
