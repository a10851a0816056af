"""Parameter groups added after construction (``add_param_group``) with parameters outside the model.

A metric-learning loss's own weights (ArcFace's class centres), a learned
temperature or a second head kept beside the model are given to the
optimizer with ``add_param_group``, as to ``torch.optim.SGD``. The model's
hooks never see them, so K-FAC leaves them to the base update; what matters
on several workers is that their gradients are averaged as the model's are,
or each worker's copy drifts apart. The optimizer averages them from the
backward pass with the model's; where DDP averages the model's gradients
(DDP averages the module it wraps only), at ``step()``, in one blocking
all-reduce. Where update fusion applies the updates from the model's hooks,
such a parameter would be missed: refused instead, by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..comm import CommBackend

__all__ = ["average_gradients_now", "check_outside_model", "not_in_model"]


def not_in_model(model: nn.Module, param_groups: Sequence[dict[str, Any]]) -> list[torch.Tensor]:
    """The groups' parameters that are not the model's, each once, in group order."""
    own = {id(p) for p in model.parameters()}
    seen: set[int] = set()
    found = []
    for p in (p for group in param_groups for p in group["params"]):
        if id(p) not in own and id(p) not in seen:
            seen.add(id(p))
            found.append(p)
    return found


def check_outside_model(params: Sequence[torch.Tensor], update_fusion: str) -> None:
    """Raise ValueError when parameters outside the model would not be updated in step with the others (update
    fusion applies updates from the model's hooks)."""
    if not params:
        return
    shapes = ", ".join(str(tuple(p.shape)) for p in params[:4]) + (", ..." if len(params) > 4 else "")
    if update_fusion != "none":
        raise ValueError(
            f"parameter group with {len(params)} parameter(s) outside the model (shapes {shapes}) under "
            f"update_fusion={update_fusion!r}, which applies each update from the model's hooks; make their module "
            "part of the model, or use update_fusion='none'"
        )


def average_gradients_now(backend: CommBackend, params: Sequence[torch.Tensor], name: str) -> None:
    """Average these parameters' gradients over the workers, blocking (a worker without one adds zeros, and one no
    worker has stays None, as the step's own averaging does): for parameters found after their backward pass."""
    if backend.size == 1:
        return
    buffers = []
    for p in params:
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        present = torch.full((1,), float(p.grad is not None), dtype=grad.dtype, device=grad.device)
        buffers.append(torch.cat([grad.detach().reshape(-1), present]))
    handles = [backend.allreduce_async(buffer, f"{name}.{i}") for i, buffer in enumerate(buffers)]
    for p, buffer, handle in zip(params, buffers, handles):
        handle.wait()
        p.grad = buffer[:-1].reshape(p.shape).clone() if buffer[-1].item() > 0 else None
