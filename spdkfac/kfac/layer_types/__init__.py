"""The layer types K-FAC preconditions, one helper each, registered here: module class -> helper.

Adding a layer type is one file (a :class:`LayerHelper` subclass) and one
line in :data:`HELPERS`. A module is matched by its class or the nearest
registered base class; the helper may still refuse it
(:meth:`LayerHelper.unsupported`, e.g. a sparse embedding), and it then gets
the plain momentum-SGD update. :data:`NORM_HELPERS` holds the types that are
preconditioned only on request (``norm_layers='kfac'``): normalisation
layers' scale and shift. A module that computes with several blocks' weights
itself (``nn.MultiheadAttention``) is a :class:`SplitHelper` in
:data:`SPLITTERS`, which gives one helper per block.
"""

from __future__ import annotations

import torch.nn as nn
from torch.nn.utils import parametrize

from ...options import Option
from .attention import AttentionSplit
from .base import LayerHelper, SplitHelper
from .conv import ConvHelper
from .conv3d import Conv3dHelper
from .conv_transpose import ConvTransposeHelper
from .embedding import EmbeddingHelper
from .linear import LinearHelper
from .norm import NORM_TYPES, NormHelper

__all__ = [
    "HELPERS",
    "NORM_HELPERS",
    "SPLITTERS",
    "Conv3dHelper",
    "ConvHelper",
    "ConvTransposeHelper",
    "EmbeddingHelper",
    "LayerHelper",
    "LinearHelper",
    "NormHelper",
    "NormLayers",
    "SplitHelper",
    "helper_class",
    "make_helper",
    "split_helpers",
    "splitter_class",
    "unsupported_reason",
]

HELPERS: dict[type[nn.Module], type[LayerHelper]] = {
    nn.Linear: LinearHelper,
    nn.Conv1d: ConvHelper,
    nn.Conv2d: ConvHelper,
    nn.Conv3d: Conv3dHelper,
    nn.ConvTranspose1d: ConvTransposeHelper,
    nn.ConvTranspose2d: ConvTransposeHelper,
    nn.ConvTranspose3d: ConvTransposeHelper,
    nn.Embedding: EmbeddingHelper,
}


class NormLayers(Option):
    """What normalisation layers' affine parameters get: the plain base update, or their scale-and-shift curvature."""

    PLAIN = "plain"
    KFAC = "kfac"


#: Preconditioned only with ``norm_layers='kfac'`` (off by default: they get the plain update).
NORM_HELPERS: dict[type[nn.Module], type[LayerHelper]] = dict.fromkeys(NORM_TYPES, NormHelper)

SPLITTERS: dict[type[nn.Module], type[SplitHelper]] = {
    nn.MultiheadAttention: AttentionSplit,
}


def helper_class(module: nn.Module, norm_layers: bool = False) -> type[LayerHelper] | None:
    """The helper registered for the module's class or its nearest registered base class (with ``norm_layers``,
    :data:`NORM_HELPERS` too)."""
    for cls in type(module).__mro__:
        if cls in HELPERS:
            return HELPERS[cls]
        if norm_layers and cls in NORM_HELPERS:
            return NORM_HELPERS[cls]
    return None


def splitter_class(module: nn.Module) -> type[SplitHelper] | None:
    """The splitter registered for the module's class or its nearest registered base class."""
    for cls in type(module).__mro__:
        if cls in SPLITTERS:
            return SPLITTERS[cls]
    return None


def _parametrized(module: nn.Module) -> str | None:
    """Why a module whose weight is computed by a parametrization (``weight_norm``, ``spectral_norm``) is left out."""
    if parametrize.is_parametrized(module, "weight"):
        lists = module.parametrizations
        assert isinstance(lists, nn.ModuleDict)
        kinds = ", ".join(type(p).__name__ for p in lists["weight"].children())
        return f"its weight is parametrized ({kinds}): the trained parameters are not the weight the factors describe"
    return None


def unsupported_reason(module: nn.Module, norm_layers: bool = False) -> str | None:
    """Why a module of a registered type cannot be preconditioned; None when it can, or is of no registered type."""
    cls = helper_class(module, norm_layers) or splitter_class(module)
    return None if cls is None else (_parametrized(module) or cls.unsupported(module))


def split_helpers(module: nn.Module) -> list[tuple[str, LayerHelper]] | None:
    """``(name suffix, helper)`` per block of a supported split module (making them hookable); None for any other module."""
    cls = splitter_class(module)
    if cls is None or cls.unsupported(module) is not None:
        return None
    return cls.split(module)


def make_helper(module: nn.Module, norm_layers: bool = False) -> LayerHelper | None:
    """The helper of a supported module, or None (the module then gets plain SGD)."""
    cls = helper_class(module, norm_layers)
    if cls is None or _parametrized(module) is not None or cls.unsupported(module) is not None:
        return None
    return cls(module)
