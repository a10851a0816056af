"""Networks with grouped and depthwise convolutions, written without torchvision.

* :func:`mobilenet_v2` -- MobileNetV2 (Sandler et al. 2018): inverted residuals
  with depthwise 3x3 convolutions, width 1.0;
* :func:`resnext50_32x4d` -- ResNeXt-50 32x4d (Xie et al. 2017): bottlenecks
  whose 3x3 convolution has 32 groups of width 4 (at the first stage);
* :func:`efficientnet_b0` -- EfficientNet-B0 (Tan & Le 2019): MBConv blocks
  with depthwise 3x3/5x5 convolutions and squeeze-and-excitation, SiLU
  (no stochastic depth).

Each takes ``small_input=True`` for 32x32 images (CIFAR): a stride-1 stem (and,
for MobileNetV2 and EfficientNet-B0, a stride-1 second stage; for ResNeXt no
max-pool), so the last feature map is 4x4 instead of 1x1. K-FAC
preconditions every convolution (grouped and depthwise ones with
block-diagonal factors, one block per group) and the classifier; the batch
norms get the base update alone (``SPDKFACOptimizer.kfac_summary()`` lists them).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .imagenet import _init_weights

__all__ = ["efficientnet_b0", "mobilenet_v2", "resnext50_32x4d"]


class ConvNormAct(nn.Sequential):
    """``Conv2d(bias=False)`` (``groups``), ``BatchNorm2d`` and an activation (None: none)."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: type[nn.Module] | None = nn.ReLU6) -> None:
        layers: list[nn.Module] = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        if act is not None:
            layers.append(act(inplace=True) if act in (nn.ReLU, nn.ReLU6, nn.SiLU) else act())
        super().__init__(*layers)


# --------------------------------------------------------------------------- MobileNetV2
class InvertedResidual(nn.Module):
    """1x1 expansion (unless ``expand == 1``), depthwise 3x3 (carries the stride), linear 1x1 projection."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [] if expand == 1 else [ConvNormAct(cin, hidden, 1)]
        layers += [ConvNormAct(hidden, hidden, 3, stride, groups=hidden), ConvNormAct(hidden, cout, 1, act=None)]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return x + out if self.residual else out


class MobileNetV2(nn.Sequential):
    """MobileNetV2 1.0: 3,504,872 parameters for 1000 classes."""

    SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))

    def __init__(self, num_classes: int = 1000, small_input: bool = False) -> None:
        layers: list[nn.Module] = [ConvNormAct(3, 32, 3, 1 if small_input else 2)]
        cin = 32
        for i, (expand, cout, repeats, stride) in enumerate(self.SETTINGS):
            for r in range(repeats):
                s = stride if r == 0 and not (small_input and i == 1) else 1
                layers.append(InvertedResidual(cin, cout, s, expand))
                cin = cout
        layers.append(ConvNormAct(cin, 1280, 1))
        super().__init__(
            nn.Sequential(*layers),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Dropout(0.2),
            nn.Linear(1280, num_classes),
        )
        _init_weights(self)


def mobilenet_v2(num_classes: int = 1000, small_input: bool = False) -> nn.Module:
    """MobileNetV2 (depthwise convolutions: 17 of them, channel multiplier 1)."""
    return MobileNetV2(num_classes, small_input)


# --------------------------------------------------------------------------- ResNeXt
class ResNeXtBottleneck(nn.Module):
    """1x1 reduce to ``groups * width``, grouped 3x3 (carries the stride), 1x1 expand to ``4 * planes``, shortcut."""

    def __init__(self, cin: int, planes: int, stride: int, groups: int, base_width: int) -> None:
        super().__init__()
        width = planes * base_width // 64 * groups
        cout = planes * 4
        self.body = nn.Sequential(
            ConvNormAct(cin, width, 1, act=nn.ReLU),
            ConvNormAct(width, width, 3, stride, groups=groups, act=nn.ReLU),
            ConvNormAct(width, cout, 1, act=None),
        )
        needs_proj = stride != 1 or cin != cout
        self.shortcut = ConvNormAct(cin, cout, 1, stride, act=None) if needs_proj else nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.body(x) + self.shortcut(x))
        return out


class ResNeXt(nn.Sequential):
    """ResNeXt with bottleneck stages of ``depths`` blocks (planes 64..512), ``groups`` x ``base_width``."""

    def __init__(self, depths: tuple[int, ...], groups: int, base_width: int, num_classes: int = 1000, small_input: bool = False) -> None:
        stem: nn.Module = (
            ConvNormAct(3, 64, 3, 1, act=nn.ReLU)
            if small_input
            else nn.Sequential(ConvNormAct(3, 64, 7, 2, act=nn.ReLU), nn.MaxPool2d(3, 2, 1))
        )
        stages: list[nn.Module] = [stem]
        cin = 64
        for i, (depth, planes) in enumerate(zip(depths, (64, 128, 256, 512))):
            blocks = []
            for b in range(depth):
                blocks.append(ResNeXtBottleneck(cin, planes, 2 if (b == 0 and i > 0) else 1, groups, base_width))
                cin = planes * 4
            stages.append(nn.Sequential(*blocks))
        super().__init__(*stages, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, num_classes))
        _init_weights(self)


def resnext50_32x4d(num_classes: int = 1000, small_input: bool = False) -> nn.Module:
    """ResNeXt-50 32x4d: 25,028,904 parameters for 1000 classes; 16 grouped 3x3 convolutions (32 groups)."""
    return ResNeXt((3, 4, 6, 3), 32, 4, num_classes, small_input)


# --------------------------------------------------------------------------- EfficientNet
class SqueezeExcite(nn.Module):
    """Channel gates from globally pooled features: 1x1 reduce (SiLU), 1x1 expand (sigmoid); both with bias."""

    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, squeezed, 1)
        self.expand = nn.Conv2d(squeezed, channels, 1)
        self.act = nn.SiLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(self.expand(self.act(self.reduce(x.mean(dim=(2, 3), keepdim=True)))))
        return x * scale


class MBConv(nn.Module):
    """1x1 expansion (unless ``expand == 1``), depthwise kxk (stride), squeeze-excite, linear 1x1 projection."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = [] if expand == 1 else [ConvNormAct(cin, hidden, 1, act=nn.SiLU)]
        layers += [
            ConvNormAct(hidden, hidden, kernel, stride, groups=hidden, act=nn.SiLU),
            SqueezeExcite(hidden, max(1, cin // 4)),
            ConvNormAct(hidden, cout, 1, act=None),
        ]
        self.body = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return x + out if self.residual else out


class EfficientNetB0(nn.Sequential):
    """EfficientNet-B0: 5,288,548 parameters for 1000 classes."""

    #: (expansion, kernel, stride, channels, repeats) per stage.
    STAGES = (
        (1, 3, 1, 16, 1),
        (6, 3, 2, 24, 2),
        (6, 5, 2, 40, 2),
        (6, 3, 2, 80, 3),
        (6, 5, 1, 112, 3),
        (6, 5, 2, 192, 4),
        (6, 3, 1, 320, 1),
    )

    def __init__(self, num_classes: int = 1000, small_input: bool = False) -> None:
        layers: list[nn.Module] = [ConvNormAct(3, 32, 3, 1 if small_input else 2, act=nn.SiLU)]
        cin = 32
        for i, (expand, kernel, stride, cout, repeats) in enumerate(self.STAGES):
            for r in range(repeats):
                s = stride if r == 0 and not (small_input and i == 1) else 1
                layers.append(MBConv(cin, cout, kernel, s, expand))
                cin = cout
        layers.append(ConvNormAct(cin, 1280, 1, act=nn.SiLU))
        super().__init__(nn.Sequential(*layers), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(1280, num_classes))
        _init_weights(self)


def efficientnet_b0(num_classes: int = 1000, small_input: bool = False) -> nn.Module:
    """EfficientNet-B0 (16 depthwise convolutions, 3x3 and 5x5; squeeze-excite 1x1 convolutions with bias)."""
    return EfficientNetB0(num_classes, small_input)
