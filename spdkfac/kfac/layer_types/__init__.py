"""The layer types K-FAC preconditions, one helper each, registered here: module class -> helper.

Adding a layer type is one file (a :class:`LayerHelper` subclass) and one
line in :data:`HELPERS` (for a class of another library, one line in
:data:`TYPES_ELSEWHERE`, by its import path: registered once that library is
loaded, never imported here). A module is matched by its class or the nearest
registered base class. A subclass gets that class's helper when it computes
what that class does (it overrides none of
:attr:`LayerHelper.computes_with`, e.g. a subclass that only changes the
initialisation); one with its own ``forward()`` may compute something else
from the input the hooks see, and is left out unless the user registers it
(:func:`register_layer_type`). The helper may still refuse a module
(:meth:`LayerHelper.unsupported`, e.g. a sparse embedding), and it then gets
the base update alone. :data:`NORM_HELPERS` holds the types that are
preconditioned only on request (``norm_layers='kfac'``): normalisation
layers' scale and shift. A module that computes with several blocks' weights
itself (``nn.MultiheadAttention``) is a :class:`SplitHelper` in
:data:`SPLITTERS`, which gives one helper per block.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import TypeVar

import torch
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
from .transposed_linear import TransposedLinearHelper

__all__ = [
    "HELPERS",
    "NORM_HELPERS",
    "SPLITTERS",
    "TYPES_ELSEWHERE",
    "Conv3dHelper",
    "ConvHelper",
    "ConvTransposeHelper",
    "EmbeddingHelper",
    "LayerHelper",
    "LinearHelper",
    "NormHelper",
    "NormLayers",
    "SplitHelper",
    "TransposedLinearHelper",
    "helper_class",
    "make_helper",
    "register_layer_type",
    "split_helpers",
    "splitter_class",
    "unsupported_reason",
]

_Helper = TypeVar("_Helper", type[LayerHelper], type[SplitHelper])

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

#: Layer types of other libraries: ``(module, class name) -> helper``, put into :data:`HELPERS` once that module is
#: loaded (a model can only hold such a layer then), so spdkfac never imports the library.
TYPES_ELSEWHERE: dict[tuple[str, str], type[LayerHelper]] = {
    ("transformers.pytorch_utils", "Conv1D"): TransposedLinearHelper,  # GPT-2's and GPT's layers
}


def _register_types_elsewhere() -> None:
    """Add to :data:`HELPERS` the classes of :data:`TYPES_ELSEWHERE` whose library is loaded (once each)."""
    for (module_name, class_name), helper in TYPES_ELSEWHERE.items():
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if isinstance(cls, type) and issubclass(cls, nn.Module) and cls not in HELPERS:
            HELPERS[cls] = helper


class NormLayers(Option):
    """What normalisation layers' affine parameters get: the plain base update, or their scale-and-shift curvature."""

    PLAIN = "plain"
    KFAC = "kfac"


#: Preconditioned only with ``norm_layers='kfac'`` (off by default: they get the plain update).
NORM_HELPERS: dict[type[nn.Module], type[LayerHelper]] = dict.fromkeys(NORM_TYPES, NormHelper)

SPLITTERS: dict[type[nn.Module], type[SplitHelper]] = {
    nn.MultiheadAttention: AttentionSplit,
}


def _nearest(module: nn.Module, registry: Mapping[type[nn.Module], _Helper]) -> tuple[type[nn.Module], _Helper] | None:
    """The module's class or its nearest base class in ``registry``, and what it is registered with."""
    for cls in type(module).__mro__:
        if cls in registry:
            return cls, registry[cls]
    return None


def _layer_helpers(norm_layers: bool) -> Mapping[type[nn.Module], type[LayerHelper]]:
    _register_types_elsewhere()
    return {**NORM_HELPERS, **HELPERS} if norm_layers else HELPERS


def helper_class(module: nn.Module, norm_layers: bool = False) -> type[LayerHelper] | None:
    """The helper registered for the module's class or its nearest registered base class (with ``norm_layers``,
    :data:`NORM_HELPERS` too)."""
    found = _nearest(module, _layer_helpers(norm_layers))
    return None if found is None else found[1]


def splitter_class(module: nn.Module) -> type[SplitHelper] | None:
    """The splitter registered for the module's class or its nearest registered base class."""
    found = _nearest(module, SPLITTERS)
    return None if found is None else found[1]


def register_layer_type(cls: type[nn.Module], like: type[nn.Module]) -> None:
    """Precondition ``cls``, a subclass of ``like`` with a ``forward()`` of its own, as ``like``.

    For a subclass whose own ``forward()`` computes what ``like``'s does from
    the same input (a dtype cast, a logging call): K-FAC's factors come from
    the module's input and output gradient, so a forward that computes
    something else (scales its input, pads it itself, standardises the
    weight) would get a wrong step. A subclass that does not override
    ``like``'s computation needs no registration. Holds for the process.

    Raises:
        TypeError: ``cls`` is not a subclass of ``like``.
        ValueError: ``like`` is not a layer type K-FAC preconditions.
    """
    if not (isinstance(cls, type) and issubclass(cls, like)):
        raise TypeError(f"register_layer_type: {getattr(cls, '__name__', cls)!r} is not a subclass of {like.__name__}")
    _register_types_elsewhere()
    if like in HELPERS:
        HELPERS[cls] = HELPERS[like]
    elif like in NORM_HELPERS:
        NORM_HELPERS[cls] = NORM_HELPERS[like]
    elif like in SPLITTERS:
        SPLITTERS[cls] = SPLITTERS[like]
    else:
        known = sorted(c.__name__ for c in (*HELPERS, *NORM_HELPERS, *SPLITTERS))
        raise ValueError(f"register_layer_type: {like.__name__} is not a layer type K-FAC preconditions (those are: {', '.join(known)})")


def _own_computation(module: nn.Module, base: type[nn.Module], helper: type[LayerHelper] | type[SplitHelper]) -> str | None:
    """Why a subclass that overrides its registered class ``base``'s computation (:attr:`LayerHelper.computes_with`)
    is left out."""
    own = [m for m in helper.computes_with if getattr(type(module), m, None) is not getattr(base, m, None)]
    if not own:
        return None
    name, methods = type(module).__name__, " and ".join(f"{m}()" for m in own)
    return (
        f"a subclass of {base.__name__} with its own {methods}, which may compute something else from the input K-FAC sees "
        f"(if it computes what {base.__name__} does: spdkfac.register_layer_type({name}, nn.{base.__name__}))"
    )


def _parametrized(module: nn.Module) -> str | None:
    """Why a module whose weight is computed from other parameters (``weight_norm``, ``spectral_norm``: a
    parametrization, or the older hook that writes a plain tensor over ``weight``) is left out."""
    if parametrize.is_parametrized(module, "weight"):
        lists = module.parametrizations
        assert isinstance(lists, nn.ModuleDict)
        kinds = ", ".join(type(p).__name__ for p in lists["weight"].children())
        return f"its weight is parametrized ({kinds}): the trained parameters are not the weight the factors describe"
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and not isinstance(weight, nn.Parameter):  # the older hook-based API, or pruning
        hooks = [type(h).__name__ for h in module._forward_pre_hooks.values() if _hook_tensor_name(h) == "weight"]
        source = ", ".join(n for n, _ in module.named_parameters(recurse=False) if n.startswith("weight_")) or "none"
        return (
            f"its weight is recomputed by a forward pre-hook ({', '.join(hooks) or 'unnamed'}) from other parameters "
            f"({source}; nn.utils.weight_norm, spectral_norm and nn.utils.prune do this): the trained parameters are "
            "not the weight the factors describe"
        )
    return None


def _hook_tensor_name(hook: object) -> str | None:
    """The tensor a hook object of torch's older weight-recomputing APIs writes (``WeightNorm``/``SpectralNorm``:
    ``name``; pruning methods: ``_tensor_name``); None for a plain function."""
    name = getattr(hook, "name", getattr(hook, "_tensor_name", None))
    return name if isinstance(name, str) else None


def unsupported_reason(module: nn.Module, norm_layers: bool = False) -> str | None:
    """Why a module of a registered type cannot be preconditioned; None when it can, or is of no registered type."""
    found: tuple[type[nn.Module], type[LayerHelper] | type[SplitHelper]] | None = _nearest(module, _layer_helpers(norm_layers))
    if found is None:
        found = _nearest(module, SPLITTERS)
    if found is None:
        return None
    base, cls = found
    return _own_computation(module, base, cls) or _parametrized(module) or cls.unsupported(module)


def split_helpers(module: nn.Module) -> list[tuple[str, LayerHelper]] | None:
    """``(name suffix, helper)`` per block of a supported split module (making them hookable); None for any other module."""
    cls = splitter_class(module)
    if cls is None or unsupported_reason(module) is not None:
        return None
    return cls.split(module)


def make_helper(module: nn.Module, norm_layers: bool = False) -> LayerHelper | None:
    """The helper of a supported module, or None (the module then gets the base update alone)."""
    cls = helper_class(module, norm_layers)
    if cls is None or unsupported_reason(module, norm_layers) is not None:
        return None
    return cls(module)
