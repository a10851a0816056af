"""ImageNet-size CNNs for 3x224x224 input, written without torchvision.

The four networks of the SPD-KFAC paper's Table II:

* :func:`resnet50`, :func:`resnet152` -- bottleneck ResNets (He et al. 2016),
  stride on the 3x3 convolution ("v1.5") and 1x1 projection shortcuts;
* :func:`densenet201` -- DenseNet-BC (Huang et al. 2017), growth 32,
  blocks (6, 12, 48, 32), bottleneck width 4x growth, compression 0.5;
* :func:`inception_v4` -- Inception-v4 (Szegedy et al. 2016).

All convolutions have ``bias=False`` and are followed by batch norm, so K-FAC
sees every Conv2d with an ``A`` dimension of ``in_channels * kh * kw``; the
final Linear layer has a bias. Every network ends in global average pooling,
so any input resolution at or above the documented minimum works.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Union

import torch
import torch.nn as nn

__all__ = ["DenseNet", "InceptionV4", "ResNet", "densenet201", "inception_v4", "resnet50", "resnet152"]

Size2 = Union[int, tuple[int, int]]


def _pair(v: Size2) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


# --------------------------------------------------------------------------- shared blocks
class ConvBN(nn.Sequential):
    """``Conv2d(bias=False)`` + ``BatchNorm2d`` (+ ``ReLU`` unless ``relu=False``).

    ``padding=None`` pads by half the kernel size in each direction, which keeps
    the spatial size for odd kernels at stride 1; pass ``padding=0`` for a
    "valid" convolution.
    """

    def __init__(self, cin: int, cout: int, kernel: Size2, stride: int = 1, padding: Size2 | None = None, relu: bool = True) -> None:
        kh, kw = _pair(kernel)
        pad = (kh // 2, kw // 2) if padding is None else _pair(padding)
        layers = [nn.Conv2d(cin, cout, (kh, kw), stride, pad, bias=False), nn.BatchNorm2d(cout)]
        if relu:
            layers.append(nn.ReLU(inplace=True))
        super().__init__(*layers)


class BNReLUConv(nn.Sequential):
    """Pre-activation unit ``BatchNorm2d`` + ``ReLU`` + ``Conv2d(bias=False)`` (DenseNet order)."""

    def __init__(self, cin: int, cout: int, kernel: int) -> None:
        super().__init__(nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, kernel, 1, kernel // 2, bias=False))


class Concat(nn.Module):
    """Runs parallel branches on the same input and concatenates their outputs along channels."""

    def __init__(self, *branches: nn.Module) -> None:
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


def _head(cin: int, num_classes: int, dropout: float = 0.0) -> nn.Sequential:
    """Global average pooling, optional dropout, and the fully connected classifier."""
    layers = [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(cin, num_classes))
    return nn.Sequential(*layers)


def _init_weights(model: nn.Module) -> nn.Module:
    """He-normal convolutions, unit/zero batch norm, small-normal classifier with zero bias."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.01)
            nn.init.zeros_(m.bias)
    return model


# --------------------------------------------------------------------------- ResNet
class Bottleneck(nn.Module):
    """ResNet bottleneck: 1x1 reduce, 3x3 (carries the stride), 1x1 expand by 4, plus shortcut."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1) -> None:
        super().__init__()
        cout = width * self.expansion
        self.body = nn.Sequential(ConvBN(cin, width, 1), ConvBN(width, width, 3, stride), ConvBN(width, cout, 1, relu=False))
        needs_proj = stride != 1 or cin != cout
        self.shortcut = ConvBN(cin, cout, 1, stride, relu=False) if needs_proj else nn.Identity()
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.relu(self.body(x) + self.shortcut(x))
        return out


class ResNet(nn.Sequential):
    """Bottleneck ResNet: 7x7 stem, four stages of ``depths`` blocks (widths 64..512), linear head.

    Minimum input is 32x32 (total stride 32); 3x64x64 and up is a sensible test size.
    """

    def __init__(self, depths: Sequence[int], num_classes: int = 1000) -> None:
        stages: OrderedDict[str, nn.Module] = OrderedDict()
        stages["stem"] = nn.Sequential(ConvBN(3, 64, 7, 2), nn.MaxPool2d(3, 2, 1))
        cin = 64
        for i, (depth, width) in enumerate(zip(depths, (64, 128, 256, 512))):
            blocks = []
            for b in range(depth):
                blocks.append(Bottleneck(cin, width, 2 if (b == 0 and i > 0) else 1))
                cin = width * Bottleneck.expansion
            stages[f"layer{i + 1}"] = nn.Sequential(*blocks)
        stages["head"] = _head(cin, num_classes)
        super().__init__(stages)
        _init_weights(self)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50 (blocks 3, 4, 6, 3): 25,557,032 parameters for 1000 classes; 53 convs + 1 fc."""
    return ResNet((3, 4, 6, 3), num_classes)


def resnet152(num_classes: int = 1000) -> nn.Module:
    """ResNet-152 (blocks 3, 8, 36, 3): 60,192,808 parameters for 1000 classes."""
    return ResNet((3, 8, 36, 3), num_classes)


# --------------------------------------------------------------------------- DenseNet
class DenseLayer(nn.Module):
    """DenseNet-BC layer: BN-ReLU-1x1 conv to ``bn_size * growth``, BN-ReLU-3x3 conv to ``growth``;
    the ``growth`` new channels are appended to the input."""

    def __init__(self, cin: int, growth: int, bn_size: int) -> None:
        super().__init__()
        self.body = nn.Sequential(BNReLUConv(cin, bn_size * growth, 1), BNReLUConv(bn_size * growth, growth, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, self.body(x)], dim=1)


class DenseNet(nn.Sequential):
    """DenseNet-BC: 7x7 stem, dense blocks separated by compressing transitions, BN-ReLU, linear head.

    Minimum input is 32x32 (total stride 32); 3x64x64 and up is a sensible test size.
    """

    def __init__(
        self, blocks: Sequence[int], growth: int = 32, bn_size: int = 4, compression: float = 0.5, num_classes: int = 1000
    ) -> None:
        stages: OrderedDict[str, nn.Module] = OrderedDict()
        cin = 2 * growth
        stages["stem"] = nn.Sequential(ConvBN(3, cin, 7, 2), nn.MaxPool2d(3, 2, 1))
        for i, depth in enumerate(blocks):
            layers = []
            for _ in range(depth):
                layers.append(DenseLayer(cin, growth, bn_size))
                cin += growth
            stages[f"block{i + 1}"] = nn.Sequential(*layers)
            if i < len(blocks) - 1:
                cout = int(cin * compression)
                stages[f"transition{i + 1}"] = nn.Sequential(BNReLUConv(cin, cout, 1), nn.AvgPool2d(2, 2))
                cin = cout
        stages["final"] = nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True))
        stages["head"] = _head(cin, num_classes)
        super().__init__(stages)
        _init_weights(self)


def densenet201(num_classes: int = 1000) -> nn.Module:
    """DenseNet-201 (growth 32, blocks 6, 12, 48, 32): 20,013,928 parameters for 1000 classes."""
    return DenseNet((6, 12, 48, 32), 32, 4, 0.5, num_classes)


# --------------------------------------------------------------------------- Inception-v4
def _chain(cin: int, *specs: tuple[int, Size2]) -> tuple[nn.Sequential, int]:
    """A stride-1, size-preserving chain of ``ConvBN(out, kernel)`` specs; returns it and its width."""
    layers = []
    for cout, kernel in specs:
        layers.append(ConvBN(cin, cout, kernel))
        cin = cout
    return nn.Sequential(*layers), cin


def _avgpool_branch(cin: int, cout: int) -> nn.Sequential:
    """3x3 average pool (stride 1, padding not counted) followed by a 1x1 ConvBN."""
    return nn.Sequential(nn.AvgPool2d(3, 1, 1, count_include_pad=False), ConvBN(cin, cout, 1))


def _stem() -> nn.Sequential:
    """Inception-v4 stem: 3 channels -> 384 channels at 1/8 resolution (35x35 for 299x299 input)."""
    return nn.Sequential(
        ConvBN(3, 32, 3, 2, 0),
        ConvBN(32, 32, 3, 1, 0),
        ConvBN(32, 64, 3),
        Concat(nn.MaxPool2d(3, 2), ConvBN(64, 96, 3, 2, 0)),  # 160
        Concat(
            nn.Sequential(ConvBN(160, 64, 1), ConvBN(64, 96, 3, 1, 0)),
            nn.Sequential(_chain(160, (64, 1), (64, (7, 1)), (64, (1, 7)))[0], ConvBN(64, 96, 3, 1, 0)),
        ),  # 192
        Concat(ConvBN(192, 192, 3, 2, 0), nn.MaxPool2d(3, 2)),  # 384
    )


def _inception_a(cin: int = 384) -> Concat:
    """Inception-A (35x35 grid): four branches of 96 channels each -> 384."""
    return Concat(_avgpool_branch(cin, 96), ConvBN(cin, 96, 1), _chain(cin, (64, 1), (96, 3))[0], _chain(cin, (64, 1), (96, 3), (96, 3))[0])


def _reduction_a(cin: int = 384, k: int = 192, l: int = 224, m: int = 256, n: int = 384) -> Concat:  # noqa: E741 (k, l, m, n): the Inception-v4 paper's names
    """Reduction-A (35 -> 17 grid), filter sizes (k, l, m, n) = (192, 224, 256, 384): 384 -> 1024."""
    return Concat(nn.MaxPool2d(3, 2), ConvBN(cin, n, 3, 2, 0), nn.Sequential(_chain(cin, (k, 1), (l, 3))[0], ConvBN(l, m, 3, 2, 0)))


def _inception_b(cin: int = 1024) -> Concat:
    """Inception-B (17x17 grid) with factorised 1x7 / 7x1 convolutions: 1024 -> 1024."""
    return Concat(
        _avgpool_branch(cin, 128),
        ConvBN(cin, 384, 1),
        _chain(cin, (192, 1), (224, (1, 7)), (256, (7, 1)))[0],
        _chain(cin, (192, 1), (192, (7, 1)), (224, (1, 7)), (224, (7, 1)), (256, (1, 7)))[0],
    )


def _reduction_b(cin: int = 1024) -> Concat:
    """Reduction-B (17 -> 8 grid): 1024 -> 1536."""
    return Concat(
        nn.MaxPool2d(3, 2),
        nn.Sequential(ConvBN(cin, 192, 1), ConvBN(192, 192, 3, 2, 0)),
        nn.Sequential(_chain(cin, (256, 1), (256, (1, 7)), (320, (7, 1)))[0], ConvBN(320, 320, 3, 2, 0)),
    )


def _split_1x3_3x1(cin: int, cout: int = 256) -> Concat:
    """The Inception-C fork: parallel 1x3 and 3x1 convolutions of ``cout`` channels each."""
    return Concat(ConvBN(cin, cout, (1, 3)), ConvBN(cin, cout, (3, 1)))


def _inception_c(cin: int = 1536) -> Concat:
    """Inception-C (8x8 grid) with 1x3 / 3x1 forks: six outputs of 256 channels -> 1536."""
    return Concat(
        _avgpool_branch(cin, 256),
        ConvBN(cin, 256, 1),
        nn.Sequential(ConvBN(cin, 384, 1), _split_1x3_3x1(384)),
        nn.Sequential(_chain(cin, (384, 1), (448, (3, 1)), (512, (1, 3)))[0], _split_1x3_3x1(512)),
    )


class InceptionV4(nn.Sequential):
    """Inception-v4: stem, 4x Inception-A, Reduction-A, 7x Inception-B, Reduction-B, 3x Inception-C,
    average pooling, dropout (keep 0.8) and the classifier.

    Designed for 299x299; at 224x224 the final grid is 5x5. The smallest input is
    **75x75** (the valid stride-2 convolutions and pools then shrink it to 1x1 at
    the last reduction); anything smaller fails in the forward pass.
    """

    MIN_INPUT = 75

    def __init__(self, num_classes: int = 1000, dropout: float = 0.2) -> None:
        super().__init__(
            OrderedDict(
                [
                    ("stem", _stem()),
                    ("inception_a", nn.Sequential(*[_inception_a() for _ in range(4)])),
                    ("reduction_a", _reduction_a()),
                    ("inception_b", nn.Sequential(*[_inception_b() for _ in range(7)])),
                    ("reduction_b", _reduction_b()),
                    ("inception_c", nn.Sequential(*[_inception_c() for _ in range(3)])),
                    ("head", _head(1536, num_classes, dropout)),
                ]
            )
        )
        _init_weights(self)


def inception_v4(num_classes: int = 1000) -> nn.Module:
    """Inception-v4 (about 42.7M parameters for 1000 classes; minimum input 75x75)."""
    return InceptionV4(num_classes)
