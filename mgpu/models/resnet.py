"""ResNet (basic or bottleneck v1.5 blocks) with an ImageNet or CIFAR stem, written from scratch.

ResNet(num_classes=1000) is the standard ResNet-50 (25,557,032 parameters).
"""

import torch
from torch import nn

from mgpu.models.flops import count_training_flops

BLOCKS = ("basic", "bottleneck")
STEMS = ("imagenet", "cifar")


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int = 1) -> nn.Sequential:
    # no conv bias: the BatchNorm right after it has its own shift
    conv = nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False)
    return nn.Sequential(conv, nn.BatchNorm2d(c_out))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        self.conv1 = _conv_bn(c_in, width, 3, stride)
        self.conv2 = _conv_bn(width, width, 3)
        self.last_bn = self.conv2[1]

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(torch.relu(self.conv1(x)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int):
        super().__init__()
        self.conv1 = _conv_bn(c_in, width, 1)
        # v1.5: stride on the 3x3 (not the first 1x1), so no input pixels are skipped
        self.conv2 = _conv_bn(width, width, 3, stride)
        self.conv3 = _conv_bn(width, width * self.expansion, 1)
        self.last_bn = self.conv3[1]

    def residual(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv3(torch.relu(self.conv2(torch.relu(self.conv1(x)))))


class Residual(nn.Module):
    """relu(residual(x) + shortcut(x)), with a 1x1 conv+BN shortcut when the shape changes."""

    def __init__(self, block: type[nn.Module], c_in: int, width: int, stride: int):
        super().__init__()
        self.body = block(c_in, width, stride)
        c_out = width * block.expansion
        needs_proj = stride != 1 or c_in != c_out
        self.shortcut = _conv_bn(c_in, c_out, 1, stride) if needs_proj else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body.residual(x) + self.shortcut(x))


class ResNet(nn.Module):
    # the trainer switches inputs and weights to channels_last on GPU for models that set this
    channels_last = True

    def __init__(
        self,
        num_classes: int,
        block: str = "bottleneck",
        layers: list[int] = (3, 4, 6, 3),
        width: int = 64,
        in_channels: int = 3,
        stem: str = "imagenet",
    ):
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"unknown ResNet block {block!r}; expected one of {BLOCKS}")
        if stem not in STEMS:
            raise ValueError(f"unknown ResNet stem {stem!r}; expected one of {STEMS}")
        if len(layers) == 0 or any(n < 1 for n in layers):
            raise ValueError(f"layers must be a non-empty list of positive ints, got {layers!r}")
        # kept so flops_per_sample can rebuild an identical model on the meta device
        self.init_kwargs = {
            "num_classes": num_classes,
            "block": block,
            "layers": list(layers),
            "width": width,
            "in_channels": in_channels,
            "stem": stem,
        }
        block_cls = BasicBlock if block == "basic" else Bottleneck
        self.stem = self._make_stem(stem, in_channels, width)
        stages, c_in = [], width
        for i, n_blocks in enumerate(layers):
            stage_width = width * 2**i
            for j in range(n_blocks):
                stride = 2 if (i > 0 and j == 0) else 1
                stages.append(Residual(block_cls, c_in, stage_width, stride))
                c_in = stage_width * block_cls.expansion
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(c_in, num_classes)
        self._init_weights()

    @staticmethod
    def _make_stem(stem: str, in_channels: int, width: int) -> nn.Sequential:
        if stem == "imagenet":
            return nn.Sequential(
                *_conv_bn(in_channels, width, 7, 2),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(kernel_size=3, stride=2, padding=1),
            )
        # cifar: 32x32 inputs are too small to downsample 4x before the first stage
        return nn.Sequential(*_conv_bn(in_channels, width, 3, 1), nn.ReLU(inplace=True))

    def _init_weights(self) -> None:
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        # zero the last BN gamma of each block: every block starts as identity, which
        # makes the deep network train like a shallow one early on (Goyal et al. 2017)
        for m in self.modules():
            if isinstance(m, Residual):
                nn.init.zeros_(m.body.last_bn.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(self.pool(x), 1))

    def flops_per_sample(self, sample_shape: tuple[int, ...]) -> float:
        """Training FLOPs (fwd + bwd) for one (C, H, W) image, counted on the meta device."""
        return count_training_flops(lambda: ResNet(**self.init_kwargs), tuple(sample_shape))
