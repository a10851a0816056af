"""Which parameters the base update decays (``no_weight_decay``): the usual exclusions of biases and norms.

Transformer and ResNet recipes decay the weight matrices and kernels but not
biases, normalisation layers' scales and shifts, or other vectors (class
tokens, position embeddings); with ``torch.optim`` that is two parameter
groups. ``no_weight_decay`` names the excluded parameters, and the optimizer
puts them in a second group with ``weight_decay=0`` (everything else about
the two groups is the same; the first holds the hyperparameters the K-FAC
step reads).

An entry is a shell-style pattern on the parameter names of the (bare)
model (``'*.bias'``, ``'encoder.*.norm*'``) or a kind:

* ``'kind:bias'``: parameters named ``bias`` or ``*_bias`` (``in_proj_bias``);
* ``'kind:norm'``: the parameters of normalisation modules (BatchNorm,
  InstanceNorm, LayerNorm, GroupNorm, RMSNorm);
* ``'kind:vector'``: parameters of fewer than two dimensions (biases, norm
  scales and shifts, and any other vector or scalar: nanoGPT's and timm's rule).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

import torch
import torch.nn as nn

from ..kfac.layers import unwrapped_name

__all__ = ["NO_DECAY_KINDS", "check_no_weight_decay", "split_decayed"]

#: The normalisation modules whose parameters ``'kind:norm'`` names.
NORM_MODULES: tuple[type[nn.Module], ...] = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
)


def _is_bias(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    leaf = name.rpartition(".")[2]
    return leaf == "bias" or leaf.endswith("_bias")


def _in_norm(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    return isinstance(module, NORM_MODULES)


def _is_vector(name: str, param: torch.Tensor, module: nn.Module) -> bool:
    return param.dim() < 2


#: ``'kind:NAME'`` -> whether a parameter (its name, itself, the module that holds it) is of that kind.
NO_DECAY_KINDS: dict[str, Callable[[str, torch.Tensor, nn.Module], bool]] = {
    "bias": _is_bias,
    "norm": _in_norm,
    "vector": _is_vector,
}


def check_no_weight_decay(entries: Sequence[str] | str) -> tuple[str, ...]:
    """The entries as a tuple of strings; TypeError or ValueError (naming the entry) for a bad one."""
    if isinstance(entries, str):
        entries = (entries,)
    out = []
    for entry in entries:
        if not isinstance(entry, str):
            raise TypeError(f"no_weight_decay entries are parameter-name patterns or 'kind:...' strings, got {entry!r}")
        if entry.startswith("kind:") and entry.removeprefix("kind:") not in NO_DECAY_KINDS:
            raise ValueError(f"no_weight_decay entry {entry!r}: unknown kind; known: {['kind:' + k for k in NO_DECAY_KINDS]}")
        out.append(entry)
    return tuple(out)


def _matches(entry: str, name: str, param: torch.Tensor, module: nn.Module) -> bool:
    if entry.startswith("kind:"):
        return NO_DECAY_KINDS[entry.removeprefix("kind:")](name, param, module)
    # (with or without activation checkpointing's wrapper in the names, as skip_layers)
    return fnmatch.fnmatchcase(name, entry) or fnmatch.fnmatchcase(unwrapped_name(name), unwrapped_name(entry))


def split_decayed(model: nn.Module, entries: Sequence[str]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The trainable parameters (model order, each once) the base update decays, and those ``entries`` exclude.

    Raises:
        ValueError: an entry that names no trainable parameter (a typo would silently decay what it meant to
            exclude), or entries that exclude every parameter (pass ``weight_decay=0`` instead).
    """
    holder = {id(p): module for module in model.modules() for p in module.parameters(recurse=False)}
    decayed: list[torch.Tensor] = []
    excluded: list[torch.Tensor] = []
    used: set[str] = set()
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        hits = [e for e in entries if _matches(e, name, param, holder[id(param)])]
        used.update(hits)
        (excluded if hits else decayed).append(param)
    unused = [e for e in entries if e not in used]
    if unused:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        raise ValueError(f"no_weight_decay entries {unused} match no trainable parameter (names: {names[:12]} ...)")
    if entries and not decayed:
        raise ValueError(f"no_weight_decay={list(entries)} excludes every parameter: pass weight_decay=0 instead")
    return decayed, excluded
