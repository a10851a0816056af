"""The layer types K-FAC preconditions, one helper each, registered here: module class -> helper.

Adding a layer type is one file (a :class:`LayerHelper` subclass) and one
line in :data:`HELPERS`. A module is matched by its class or the nearest
registered base class; the helper may still refuse it
(:meth:`LayerHelper.unsupported`, e.g. a sparse embedding), and it then gets
the plain momentum-SGD update. A module that computes with several blocks'
weights itself (``nn.MultiheadAttention``) is a :class:`SplitHelper` in
:data:`SPLITTERS`, which gives one helper per block.
"""

from __future__ import annotations

import torch.nn as nn

from .attention import AttentionSplit
from .base import LayerHelper, SplitHelper
from .conv import ConvHelper
from .embedding import EmbeddingHelper
from .linear import LinearHelper

__all__ = [
    "HELPERS",
    "SPLITTERS",
    "ConvHelper",
    "EmbeddingHelper",
    "LayerHelper",
    "LinearHelper",
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
    nn.Embedding: EmbeddingHelper,
}

SPLITTERS: dict[type[nn.Module], type[SplitHelper]] = {
    nn.MultiheadAttention: AttentionSplit,
}


def helper_class(module: nn.Module) -> type[LayerHelper] | None:
    """The helper registered for the module's class or its nearest registered base class."""
    for cls in type(module).__mro__:
        if cls in HELPERS:
            return HELPERS[cls]
    return None


def splitter_class(module: nn.Module) -> type[SplitHelper] | None:
    """The splitter registered for the module's class or its nearest registered base class."""
    for cls in type(module).__mro__:
        if cls in SPLITTERS:
            return SPLITTERS[cls]
    return None


def unsupported_reason(module: nn.Module) -> str | None:
    """Why a module of a registered type cannot be preconditioned; None when it can, or is of no registered type."""
    cls = helper_class(module) or splitter_class(module)
    return None if cls is None else cls.unsupported(module)


def split_helpers(module: nn.Module) -> list[tuple[str, LayerHelper]] | None:
    """``(name suffix, helper)`` per block of a supported split module (making them hookable); None for any other module."""
    cls = splitter_class(module)
    if cls is None or cls.unsupported(module) is not None:
        return None
    return cls.split(module)


def make_helper(module: nn.Module) -> LayerHelper | None:
    """The helper of a supported module, or None (the module then gets plain SGD)."""
    cls = helper_class(module)
    if cls is None or cls.unsupported(module) is not None:
        return None
    return cls(module)
