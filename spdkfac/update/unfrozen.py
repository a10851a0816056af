"""Parameters frozen when the optimizer was built that become trainable later (fine-tuning's unfreezing).

``torch.optim.SGD(model.parameters())`` holds the frozen parameters too and
updates them once they have gradients. The optimizer here plans its layers,
factors and gradient all-reduces from the parameters that are trainable when
it is built, so a parameter unfrozen later would never be updated. Instead it
takes them in, between steps, as construction would on the model as it is
then: the parameter groups are rebuilt in the model's order (so its
``state_dict()`` is the one an optimizer built now would save), and every
state it holds is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from .weight_decay import split_decayed

__all__ = ["outside_groups", "regroup"]


def outside_groups(model: nn.Module, param_groups: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """The model's parameters in no parameter group (frozen when the groups were made), each once."""
    held = {id(p) for group in param_groups for p in group["params"]}
    return [p for p in model.parameters() if id(p) not in held]


def regroup(model: nn.Module, param_groups: list[dict[str, Any]], own: int, no_weight_decay: Sequence[str]) -> None:
    """Make the first ``own`` groups (the decayed parameters, then those ``no_weight_decay`` excludes) hold the
    model's trainable parameters in model order, as the optimizer's construction makes them; the groups' other
    entries (a scheduled learning rate) and any group added since (``add_param_group``) are kept. (A second group
    exists whenever ``no_weight_decay`` has entries: each matched a parameter trainable at construction.)
    """
    added = {id(p) for group in param_groups[own:] for p in group["params"]}
    decayed, undecayed = split_decayed(model, no_weight_decay)
    param_groups[0]["params"] = [p for p in decayed if id(p) not in added]
    if own == 2:
        param_groups[1]["params"] = [p for p in undecayed if id(p) not in added]
