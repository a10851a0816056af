"""Model zoo (no torchvision needed): small CPU models, ImageNet-size CNNs, ConvNeXt-T, ViT-S/16 and four small language models.

``get_model(name, num_classes)`` builds any registered model; names prefixed
``torchvision:`` use torchvision's constructors when torchvision imports.
"""

from __future__ import annotations

from typing import Callable

import torch.nn as nn

from .imagenet import densenet201, inception_v4, resnet50, resnet152
from .llama import char_llama, char_moe_llama, tied_llama
from .mobile import efficientnet_b0, mobilenet_v2, resnext50_32x4d
from .modern import char_gpt, convnext_t, mnist_vit, vit_s16
from .small import DigitsCNN, MnistCNN, MnistMobileNet, cifar_resnet20

__all__ = ["MODELS", "DigitsCNN", "MnistCNN", "MnistMobileNet", "cifar_resnet20", "get_model"]

MODELS: dict[str, Callable[..., nn.Module]] = {
    "digits_cnn": DigitsCNN,
    "mnist_cnn": MnistCNN,
    "mnist_mobilenet": MnistMobileNet,
    "mnist_vit": mnist_vit,
    "char_gpt": char_gpt,
    "char_llama": char_llama,
    "char_moe_llama": char_moe_llama,
    "tied_llama": tied_llama,
    "cifar_resnet20": cifar_resnet20,
    "resnet50": resnet50,
    "resnet152": resnet152,
    "densenet201": densenet201,
    "inception_v4": inception_v4,
    "mobilenet_v2": mobilenet_v2,
    "resnext50_32x4d": resnext50_32x4d,
    "efficientnet_b0": efficientnet_b0,
    "convnext_t": convnext_t,
    "vit_s16": vit_s16,
    # The same networks for 32x32 images (stride-1 stem, 4x4 patches; see spdkfac.models.mobile and .modern).
    "mobilenet_v2_32": lambda num_classes=10: mobilenet_v2(num_classes, small_input=True),
    "resnext50_32x4d_32": lambda num_classes=10: resnext50_32x4d(num_classes, small_input=True),
    "efficientnet_b0_32": lambda num_classes=10: efficientnet_b0(num_classes, small_input=True),
    "convnext_t_32": lambda num_classes=10: convnext_t(num_classes, small_input=True),
    "vit_s16_32": lambda num_classes=10: vit_s16(num_classes, small_input=True),
}


def get_model(name: str, num_classes: int | None = None) -> nn.Module:
    """Instantiate a model by name (see :data:`MODELS`); ``num_classes`` None keeps the model's default."""
    kwargs = {} if num_classes is None else {"num_classes": num_classes}
    if name.startswith("torchvision:"):
        try:
            import torchvision.models as tvm
        except Exception as exc:  # pragma: no cover - torchvision is optional
            raise ValueError(f"{name}: torchvision is not importable here ({exc})") from None
        model: nn.Module = getattr(tvm, name.split(":", 1)[1])(**kwargs)
        return model
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)} or torchvision:<name>")
    return MODELS[name](**kwargs)
