"""The update every parameter gets after preconditioning: momentum SGD, AdamW or LAMB (the ``base`` option).

K-FAC replaces each preconditioned layer's averaged gradient by its KL-clipped
preconditioned gradient; the base optimizer then treats that as the gradient,
and every other parameter's averaged gradient as it is. The rules themselves
are :mod:`spdkfac.update.rules`' (shared with AdamW and DHO2), so a K-FAC step with
preconditioning off is exactly the base optimizer's step.

Weight decay per base: ``'sgd'`` adds ``wd * param`` to the (preconditioned)
gradient before the momentum, as ``torch.optim.SGD`` (coupled, not
preconditioned); ``'adamw'`` decays the parameter by ``lr * wd`` beside the
Adam step (decoupled); ``'lamb'`` adds ``wd * param`` to Adam's ratio before
the layer-wise trust ratio, as LAMB's paper.
"""

from __future__ import annotations

from typing import Any

import torch

from ..options import Option
from .rules import adamw_deltas, lamb_delta, momentum_direction, momentum_directions

__all__ = ["BaseOptimizer", "apply_base_update", "base_defaults", "sgd_param_update", "zero_base_state"]


class BaseOptimizer(Option):
    """The update after preconditioning (``base``)."""

    SGD = "sgd"  # momentum SGD
    ADAMW = "adamw"
    LAMB = "lamb"

    @property
    def display_name(self) -> str:
        """The update's name in messages."""
        return {"sgd": "momentum SGD", "adamw": "AdamW", "lamb": "LAMB"}[self.value]


def base_defaults(base: BaseOptimizer | str, momentum: float | None, betas: Any, eps: Any) -> dict[str, Any]:
    """The ``param_groups`` entries of ``base`` beside ``lr`` and ``weight_decay`` (ValueError for a bad or foreign one).

    ``'sgd'`` keeps ``momentum`` (default 0.9); ``'adamw'`` and ``'lamb'`` keep
    ``betas`` (default (0.9, 0.999)) and ``eps`` (default 1e-8, 1e-6 for LAMB
    as its paper) and refuse a momentum (they have ``betas[0]``).
    """
    base = BaseOptimizer.parse("base", base)
    if base is BaseOptimizer.SGD:
        if betas is not None or eps is not None:
            raise ValueError("betas and eps apply to base='adamw' or 'lamb'; momentum SGD (base='sgd') takes momentum")
        return {"momentum": 0.9 if momentum is None else momentum}
    if momentum is not None:
        raise ValueError(f"momentum applies to base='sgd' only; the {base!r} base uses betas")
    betas = (0.9, 0.999) if betas is None else tuple(betas)
    eps = (1e-6 if base is BaseOptimizer.LAMB else 1e-8) if eps is None else eps
    if len(betas) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps > 0:
        raise ValueError(f"eps must be a positive number, got {eps!r}")
    return {"betas": (float(betas[0]), float(betas[1])), "eps": float(eps)}


def sgd_param_update(p: torch.Tensor, grad: torch.Tensor, state: dict[str, Any], lr: float, momentum: float, weight_decay: float) -> None:
    """One parameter's momentum-SGD step, in place: the same operations wherever and whenever it runs (update fusion relies on it)."""
    p.add_(momentum_direction(grad, p, state, momentum, weight_decay), alpha=-lr)


def zero_base_state(
    base: BaseOptimizer,
    param_groups: list[dict[str, Any]],
    state: dict[torch.Tensor, dict[str, Any]],
    direct: frozenset[torch.Tensor] = frozenset(),
) -> None:
    """The base optimizer's state of every trainable parameter, as zeros: what no state means.

    Momentum SGD's first buffer is its first direction, and ``0·momentum + d``
    is ``d`` exactly; Adam's moments start at zero, at step 0. A checkpoint
    loader that fills the state a new optimizer has (``torch.distributed.checkpoint``)
    needs it there to load into.
    """
    for group in param_groups:
        for p in group["params"]:
            if not p.requires_grad or p in direct:
                continue
            st = state[p]
            if base == BaseOptimizer.SGD:
                if group["momentum"] != 0 and "momentum_buffer" not in st:
                    st["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format).detach()
            elif "exp_avg" not in st:
                st.update(step=0, exp_avg=torch.zeros_like(p).detach(), exp_avg_sq=torch.zeros_like(p).detach())


def apply_base_update(
    base: BaseOptimizer,
    param_groups: list[dict[str, Any]],
    state: dict[torch.Tensor, dict[str, Any]],
    direct: frozenset[torch.Tensor] = frozenset(),
) -> None:
    """One step of the base optimizer on every parameter with a gradient, in place (state kept per parameter).

    ``direct``: parameters whose ``grad`` is already the step's direction
    (EKFAC's ``ekfac_update='adam'``): with the AdamW base they move by
    ``-lr * grad - lr * wd * param`` (AdamW's decoupled decay, no second
    normalisation) and keep no base state.
    """
    for group in param_groups:
        lr, wd = group["lr"], group["weight_decay"]
        batched: list[torch.Tensor] = []  # momentum SGD's or AdamW's parameters, stepped together (multi-tensor kernels)
        for p in group["params"]:
            if p.grad is None:
                continue
            if p in direct:
                if base != BaseOptimizer.ADAMW:
                    raise ValueError(f"a preconditioned direction steps with base='adamw' only, not {base!r}")
                delta = p.grad.mul(-lr)
                if wd != 0:
                    delta.add_(p.detach(), alpha=-lr * wd)
                p.add_(delta)
            elif base == BaseOptimizer.SGD and p.grad.is_sparse:  # (no multi-tensor kernels for sparse gradients)
                sgd_param_update(p, p.grad, state[p], lr, group["momentum"], wd)
            elif base == BaseOptimizer.LAMB:  # (its trust ratio reads each parameter's norms: one at a time)
                p.add_(lamb_delta(p.grad, p, state[p], lr, group["betas"], group["eps"], wd))
            else:
                batched.append(p)
        if batched:
            grads = [p.grad for p in batched if p.grad is not None]  # (all of them: checked above)
            states = [state[p] for p in batched]
            if base == BaseOptimizer.SGD:
                directions = momentum_directions(grads, batched, states, group["momentum"], wd)
                torch._foreach_add_(batched, directions, alpha=-lr)
            else:
                torch._foreach_add_(batched, adamw_deltas(grads, batched, states, lr, group["betas"], group["eps"], wd))
