"""The model's parameters must stay the tensors the optimizer was built with: a replaced one is refused by name.

Some calls make new ``Parameter`` objects instead of writing into the old
ones: ``model.to_empty(device=...)`` after building on the meta device,
``load_state_dict(..., assign=True)``, and conversions under
``torch.__future__.set_overwrite_module_params_on_conversion(True)``. An
optimizer built before them holds the old tensors. ``torch.optim`` then
trains nothing, silently; here K-FAC's hooks still saw the new weights but
their gradient checks the old ones, and ``step()`` failed with "no Kronecker
factor was computed". Each step now checks, slot by slot, that every
parameter is still the one it holds (a dictionary lookup per parameter), and
a meta-device model is refused when the optimizer is built.

A submodule added or replaced after the optimizer was built (a new head,
``model.fc = nn.Linear(...)``) has parameters the optimizer does not hold:
``torch.optim`` leaves them untrained, silently. The first step looks for
them once (a walk over the model) and warns with their names.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch
import torch.nn as nn

from ..kfac.sharded_grads import is_sharded

__all__ = ["ParameterSlots", "check_materialised"]


def check_materialised(model: nn.Module) -> None:
    """Raise ValueError for a model with parameters on the meta device (not allocated yet)."""
    meta = [name for name, p in model.named_parameters() if p.is_meta]
    if meta:
        shown = ", ".join(meta[:4]) + (", ..." if len(meta) > 4 else "")
        raise ValueError(
            f"the model's parameters are on the meta device ({shown}): K-FAC sizes its factors from them when the "
            "optimizer is built, and model.to_empty() makes new parameters the optimizer would not hold. Build the "
            "optimizer after model.to_empty(device=...) and the weights' initialisation (or loading)"
        )


class ParameterSlots:
    """Where each of the model's parameters lives (module, attribute) and the tensor it held when recorded."""

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        self._known = {id(p) for p in model.parameters()}
        self._walked = False  # whether the model was searched for parameters added since (once, at the first step)
        self._slots = [
            (f"{prefix}.{name}" if prefix else name, module._parameters, name, p)
            for prefix, module in model.named_modules(remove_duplicate=False)
            for name, p in module._parameters.items()
            if p is not None
        ]

    def check(self, held: Iterable[torch.Tensor]) -> None:
        """Raise RuntimeError when a parameter was replaced by another tensor since it was recorded; the first time,
        warn about trainable parameters added to the model since that are not ``held`` (the optimizer's)."""
        for qualified, parameters, name, p in self._slots:
            if parameters.get(name) is not p:
                if is_sharded(parameters.get(name)):  # FSDP2's shard
                    raise RuntimeError(
                        f"the model's parameter {qualified!r} was sharded by fully_shard() after this optimizer took "
                        "its first step, and its state belongs to the tensors FSDP replaced: build the optimizer on "
                        "the sharded model (after fully_shard(), or after accelerator.prepare(model)), or shard before "
                        "the first step (the optimizer then takes the sharding in at the next forward pass)"
                    )
                raise RuntimeError(
                    f"the model's parameter {qualified!r} is not the tensor this optimizer was built with: it was "
                    "replaced (model.to_empty(), load_state_dict(..., assign=True), a conversion under "
                    "torch.__future__.set_overwrite_module_params_on_conversion(True)), tied to another (tie_weights()) or "
                    "reparametrized (weight_norm, parametrize), so the optimizer would update the old tensors and plan its "
                    "layers for the old structure. Build the optimizer after those calls; "
                    "to load weights into a built model, load_state_dict() without assign=True writes into its parameters"
                )
        if not self._walked:  # (after the replaced ones, which are refused)
            self._walked = True
            self._warn_unheld({id(p) for p in held})

    def _warn_unheld(self, held: set[int]) -> None:
        new = [n for n, p in self._model.named_parameters() if p.requires_grad and id(p) not in self._known and id(p) not in held]
        if new:
            shown = ", ".join(new[:4]) + (", ..." if len(new) > 4 else "")
            warnings.warn(
                f"the model has trainable parameters this optimizer was not built with ({shown}): a submodule was added "
                "or replaced after it was built (model.fc = nn.Linear(...)), and it does not hold them (it neither "
                "trains, preconditions nor averages them over the workers). Build the optimizer (or preconditioner) "
                "after changing the model, or give them to SPDKFACOptimizer with add_param_group()",
                stacklevel=4,
            )
