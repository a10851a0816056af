"""Small CPU-friendly models: CNNs for 8x8 digits and 28x28 MNIST (one MobileNet-style), and a CIFAR-style ResNet-20."""

from __future__ import annotations

import torch
import torch.nn as nn

from .mobile import ConvNormAct, InvertedResidual

__all__ = ["DigitsCNN", "MnistCNN", "MnistMobileNet", "cifar_resnet20"]


class DigitsCNN(nn.Module):
    """Three convolutions and two linear layers for 1x8x8 inputs (scikit-learn digits)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(inplace=True),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


class MnistCNN(nn.Module):
    """Three convolutions with pooling and two linear layers for 1x28x28 inputs (MNIST); 42k parameters.

    Kept small for CPU runs: the largest Kronecker factor is 401x401 (the
    second convolution's input patches), so K-FAC inverts every step cheaply.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 14x14
            nn.Conv2d(16, 32, 5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 7x7
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),  # 3x3
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 3 * 3, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.classifier(self.features(x))
        return logits


class MnistMobileNet(nn.Sequential):
    """A MobileNetV2-style net for 1x28x28 inputs: a 3x3 stem, four inverted residuals, pooling, a classifier; 33k parameters.

    Each inverted residual is a 1x1 expansion (x4), a depthwise 3x3 and a
    linear 1x1 projection, with batch norms, as in MobileNetV2: four of its
    fourteen preconditioned layers are depthwise (``skip_layers=['kind:depthwise']``
    leaves them to SGD). Small enough for CPU runs at batch 256.
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__(
            ConvNormAct(1, 16, 3, 1),  # 28x28
            InvertedResidual(16, 24, 2, 4),  # 14x14
            InvertedResidual(24, 32, 2, 4),  # 7x7
            InvertedResidual(32, 32, 1, 4),
            InvertedResidual(32, 48, 2, 4),  # 4x4
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(48, num_classes),
        )


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: torch.Tensor = self.relu(out + (x if self.short is None else self.short(x)))
        return result


class _CifarResNet(nn.Module):
    def __init__(self, blocks: int, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True))
        layers = []
        cin = 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for b in range(blocks):
                layers.append(_BasicBlock(cin, cout, stride if b == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.layers(self.stem(x)))
        return logits


def cifar_resnet20(num_classes: int = 10) -> nn.Module:
    """ResNet-20 for 3x32x32 inputs (He et al. 2016, CIFAR variant)."""
    return _CifarResNet(3, num_classes)
