"""torch's transformer layers: where their feed-forward and norm layers have their samples.

``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` run their
``linear1``, ``linear2`` and norms on ``(L, N, E)`` tensors when
``batch_first=False`` (torch's default), and so do an ``nn.TransformerEncoder``
or ``nn.TransformerDecoder``'s final ``norm``. A Linear layer counts the
first dimension as its samples, so there ``G = n gᵀg`` took ``n = L``, and the
same model written batch-first (and its attention, whose projections count
the batch) took ``n = N``: the feed-forward layers' factors were scaled by
``L/N`` against the others'. Marking those layers with their layout makes
every layer count the batch, and a 2-D input one sequence (one sample), as
the attention does; a sequence-first model then trains as its batch-first
twin. Only torch's own forward is known: a subclass with its own forward
(``forward``, ``_sa_block``, ``_mha_block``, ``_ff_block``) keeps the layers'
own convention.
"""

from __future__ import annotations

import torch.nn as nn

from .base import SequenceLayout

__all__ = ["sequence_layouts"]

#: The methods of torch's transformer layers that decide the layout their layers see.
_FORWARD = ("forward", "_sa_block", "_mha_block", "_ff_block")
#: Per layer class, the submodules that run on its ``(L, N, E)`` or ``(N, L, E)`` tensors.
_PARTS: dict[type[nn.Module], tuple[str, ...]] = {
    nn.TransformerEncoderLayer: ("linear1", "linear2", "norm1", "norm2"),
    nn.TransformerDecoderLayer: ("linear1", "linear2", "norm1", "norm2", "norm3"),
}


def _layout(layer: nn.Module) -> tuple[SequenceLayout, tuple[str, ...]] | None:
    """The layout a torch transformer layer running torch's own forward gives its parts, and those parts' names
    (None for any other module)."""
    base = next((cls for cls in _PARTS if isinstance(layer, cls)), None)
    if base is None or any(getattr(type(layer), m, None) is not getattr(base, m, None) for m in _FORWARD):
        return None
    attention = getattr(layer, "self_attn", None)
    if not isinstance(attention, nn.MultiheadAttention):
        return None
    return ("batch_first" if attention.batch_first else "sequence_first"), _PARTS[base]


def sequence_layouts(model: nn.Module) -> dict[nn.Module, SequenceLayout]:
    """The modules of ``model`` that run inside torch's transformer layers, and the layout they see."""
    out: dict[nn.Module, SequenceLayout] = {}
    for module in model.modules():
        found = _layout(module)
        if found is not None:
            layout, parts = found
            for name in parts:
                part = getattr(module, name, None)
                if isinstance(part, nn.Module):
                    out[part] = layout
        if isinstance(module, (nn.TransformerEncoder, nn.TransformerDecoder)) and isinstance(module.norm, nn.Module):
            layouts = {found[0] if found is not None else None for found in map(_layout, module.layers)}
            (only,) = layouts if len(layouts) == 1 else (None,)
            if only is not None:  # (the final norm sees what its layers' last one returns)
                out[module.norm] = only
    return out
