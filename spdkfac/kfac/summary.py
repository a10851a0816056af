"""What K-FAC covers in a model: the start-up summary of :meth:`SPDKFACOptimizer.kfac_summary`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch.nn as nn
from torch.nn.utils import parametrize

from .layer_types import NORM_HELPERS, NormHelper, helper_class, splitter_class, unsupported_reason
from .layers import LAYER_KINDS, KFACLayer, LayerFilter, skipped, split_layers, unhooked_submodules, untied_layers

__all__ = ["kfac_summary"]


def _class_name(module: nn.Module) -> str:
    """The module's class name; for a module FSDP2 shards, its own class's (``fully_shard`` derives ``FSDPLinear``
    from ``FSDPModule`` and ``Linear``)."""
    bases = type(module).__bases__
    if len(bases) == 2 and bases[0].__name__ == "FSDPModule":
        return bases[1].__name__
    return type(module).__name__


def _kind(layer: KFACLayer) -> str:
    """The layer's type, with how its factors are shaped where that is not plain."""
    name = layer.helper.kind or _class_name(layer.module)
    if isinstance(layer.helper, NormHelper):
        return f"{name} (scale and shift, 2x2 blocks)"
    if layer.tied_output is not None:
        return f"{name} (tied to an output layer: its factors join that layer's)"
    a = layer.shape("A")
    wide = " and ".join(sorted(layer.diagonal_by_width))
    if layer.tied_embedding is not None:
        diagonal = f"; diagonal {wide}: wider than max_factor_dim" if wide else ""
        return f"{name} (tied to an embedding: one weight, preconditioned with both uses' factors{diagonal})"
    if wide:
        own = "diagonal A, " if a.diagonal and "A" not in layer.diagonal_by_width else ""
        return f"{name} ({own}diagonal {wide}: wider than max_factor_dim)"
    if a.diagonal:
        return f"{name} (diagonal A)"
    if a.blocks > 1:
        return f"{name} ({'depthwise' if LAYER_KINDS['depthwise'](layer.module) else 'grouped'}, block-diagonal)"
    return name


def kfac_summary(
    model: nn.Module,
    layers: Sequence[KFACLayer],
    skip: Sequence[LayerFilter],
    precondition: bool,
    norm_layers: bool = False,
    left_to: str = "momentum SGD",
) -> str:
    """Lines saying which modules K-FAC preconditions, how many parameters that is, and which it leaves out and why.

    ``left_to`` names the update the others get (the base update, or the wrapped optimizer's).
    """
    covered = {id(p) for layer in layers for p in layer.params()}
    trainable = {id(p): p.numel() for p in model.parameters() if p.requires_grad}
    n_covered = sum(n for pid, n in trainable.items() if pid in covered)
    total = sum(trainable.values())
    share = 100.0 * n_covered / total if total else 0.0
    lines = [f"K-FAC preconditions {len(layers)} layers: {n_covered:,} of {total:,} trainable parameters ({share:.1f}%)"]
    for kind, count in sorted(Counter(_kind(layer) for layer in layers).items()):
        lines.append(f"  {count:>4} x {kind}")
    functional = unhooked_submodules(model, split_layers(model, skip))
    untied = untied_layers(model, skip, norm_layers)
    reasons: dict[str, Counter[str]] = {}
    params_by_reason: Counter[str] = Counter()
    counted: set[int] = set()  # a tied weight is one parameter of several modules: counted with the first
    for name, module in model.named_modules():
        own = [p for p in module.parameters(recurse=False) if p.requires_grad and id(p) not in covered]
        if not own:
            continue
        cls = _class_name(module)
        if not precondition:
            why = "precondition=False"
        elif name in functional:
            why = "weight used without the module's forward()"
        elif skipped(name, module, skip):
            why = "listed in skip_layers"
        elif name in untied:
            why = untied[name]
        elif isinstance(module, parametrize.ParametrizationList):
            why = "the parameters of a parametrized weight (weight_norm, spectral_norm, ...)"
        elif helper_class(module, norm_layers) is None and type(module) in NORM_HELPERS:
            why = "normalisation layer: norm_layers='plain' (norm_layers='kfac' gives it scale-and-shift curvature)"
        elif helper_class(module, norm_layers) is None and splitter_class(module) is None:
            why = "no K-FAC layer type for this class (custom norms, tokens, fused experts: a new type is a plug-in, docs/layers.md)"
        else:
            why = f"not supported: {unsupported_reason(module, norm_layers) or 'weight frozen'}"
        reasons.setdefault(why, Counter())[cls] += 1
        params_by_reason[why] += sum(p.numel() for p in own if id(p) not in counted)
        counted.update(id(p) for p in own)
    if reasons:
        lines.append(f"{left_to}, not preconditioned, for {total - n_covered:,} parameters:")
        for why, classes in reasons.items():
            listed = ", ".join(f"{count} x {cls}" for cls, count in sorted(classes.items()))
            lines.append(f"  {listed}: {why} ({params_by_reason[why]:,} parameters)")
    return "\n".join(lines)
