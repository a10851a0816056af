"""Distributed AdamW: the gradients averaged over the workers (as every optimizer here), then ``torch.optim.AdamW``'s rule.

The first-order baseline of DHO2 (whose base optimizer it is): same engines,
same hook-driven gradient all-reduce, the AdamW rule of :mod:`spdkfac.update.rules`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..comm import CommBackend, get_backend
from ..step.grad_sync import GradientSync, collective_names
from ..step.nonfinite import NonFiniteError, NonFiniteGuard, SkipStep, non_finite
from .rules import adamw_deltas

__all__ = ["DistributedAdamW"]


class DistributedAdamW(torch.optim.Optimizer):
    """AdamW on the gradients averaged over the workers (no DDP, no ``hvd.DistributedOptimizer``).

    Args:
        model: the model (every parameter: one frozen now is stepped once it is unfrozen and has a gradient).
        lr, betas, eps, weight_decay: AdamW's (decoupled weight decay; 0.05 and 1e-3 as DHO2's paper).
        backend: ``'auto'``, ``'horovod'``, ``'torch'``, ``'single'`` or a ``CommBackend``.
        accumulation_steps: backward passes per step.
        skip_nonfinite: consecutive steps with a non-finite averaged gradient skipped (every worker alike) before ``NonFiniteError``.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.05,
        backend: str | CommBackend = "auto",
        accumulation_steps: int = 1,
        skip_nonfinite: int = 0,
        grad_scaler: Any | None = None,
    ) -> None:
        if not (lr > 0 and eps > 0 and weight_decay >= 0 and all(0 <= b < 1 for b in betas)):
            raise ValueError(f"bad AdamW options: lr={lr!r}, betas={betas!r}, eps={eps!r}, weight_decay={weight_decay!r}")
        if isinstance(accumulation_steps, bool) or accumulation_steps < 1 or skip_nonfinite < 0:
            raise ValueError(f"accumulation_steps must be >= 1 and skip_nonfinite >= 0, got {accumulation_steps!r}, {skip_nonfinite!r}")
        if grad_scaler is not None:
            raise ValueError("DistributedAdamW does not support a GradScaler (float16 loss scaling)")
        # Every parameter, frozen ones too, as torch.optim.AdamW(model.parameters()): one unfrozen later is stepped
        # once it has a gradient (averaged at step(): no hook of its own), where a frozen one is skipped.
        params = list(model.parameters())
        if not any(p.requires_grad for p in params):
            raise ValueError("model has no trainable parameters")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.backend = get_backend(backend)
        self.model = model
        self.grads = GradientSync(self.backend, self.param_groups, collective_names(model, self.param_groups), accumulation_steps, None)
        self.nonfinite = NonFiniteGuard(skip_nonfinite)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """``torch.optim``'s, between steps: the group's gradients are averaged over the workers as the model's
        (parameters outside the model: a loss's own weights, a second head); RuntimeError in the middle of a step."""
        if "grads" not in self.__dict__:  # (torch.optim's construction adds the first group)
            super().add_param_group(param_group)
            return
        if self.grads.backward_seen:
            raise RuntimeError("add_param_group() after backward() and before step(): add the group between steps")
        super().add_param_group(param_group)
        self.grads.remove_hooks()
        names = collective_names(self.model, self.param_groups)
        self.grads = GradientSync(self.backend, self.param_groups, names, self.grads.accumulation_steps, None)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Average the gradients, then one AdamW step (skipped on every worker when they are not finite)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        try:
            self.grads.synchronize()
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            bad = non_finite((str(i), p.grad) for i, p in enumerate(params))
            if bad:
                self.nonfinite.bad_step(
                    NonFiniteError(f"non-finite averaged gradient in {len(bad)} parameter(s); no parameter was changed")
                )
            for group in self.param_groups:
                stepped = [p for p in group["params"] if p.grad is not None]
                if stepped:
                    grads = [p.grad for p in stepped if p.grad is not None]
                    deltas = adamw_deltas(
                        grads, stepped, [self.state[p] for p in stepped], group["lr"], group["betas"], group["eps"], group["weight_decay"]
                    )
                    torch._foreach_add_(stepped, deltas)
            self.nonfinite.good_step()
        except SkipStep:
            pass
        finally:
            self.grads.reset(None)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients; raises while gradient all-reduces are pending (no ``step()`` yet)."""
        if self.grads.pending and not self.grads.synchronized:
            raise RuntimeError("zero_grad() called while gradient all-reduces are pending; call step() first")
        self.grads.reset(None)
        super().zero_grad(set_to_none=set_to_none)

    def remove_hooks(self) -> None:
        """Detach the gradient hooks from the parameters."""
        self.grads.remove_hooks()
