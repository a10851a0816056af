"""``damping='adaptive'``: the Levenberg-Marquardt rule of Martens & Grosse (2015, Section 6.5).

Every ``interval`` steps the step's reduction ratio is measured on its own
batch::

    ρ = (h(θ+δ) - h(θ)) / M(δ),   M(δ) = ∇hᵀδ + ½ δᵀ(F̂ + γI)δ

with ``h`` the training loss (averaged over the workers), ``δ`` the change
the step made to the parameters (after momentum, KL clip and the base
update: what was taken), ``∇h`` the averaged gradient, and ``F̂`` K-FAC's
block-diagonal curvature ``A ⊗ G`` of each preconditioned layer (the running
factors, undamped); the other parameters count with ``γI`` alone. Then
``γ ← ωγ`` when ``ρ > 3/4`` (the model predicted the loss well: trust it
more), ``γ ← γ/ω`` when ``ρ < 1/4`` (or when the model predicted no decrease),
within ``[low, high]``; ``ω = (19/20)^interval`` as in the paper. The paper
uses the exact Fisher in ``M`` (Fisher-vector products, a backward pass);
K-FAC's own curvature costs no pass and is the model the step was taken
with.

Every rank computes ``ρ`` from the averaged losses and from values that are
bitwise equal on every rank (averaged gradients, averaged factors, the
parameters), so every rank takes the same damping. :class:`DampingStep` is
what ``SPDKFACOptimizer.step(closure)`` does under this rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from ..comm import CommBackend
from ..kfac.layers import KFACLayer

__all__ = [
    "ADAPTIVE",
    "CLOSURE_WITH_BACKWARD",
    "NEEDS_CLOSURE",
    "AdaptiveDamping",
    "DampingStep",
    "damping_rule",
    "kronecker_quadratic",
    "levenberg_marquardt",
    "quadratic_model",
    "reduction_ratio",
]


@dataclass(frozen=True)
class AdaptiveDamping:
    """The Levenberg-Marquardt damping rule's settings (``damping='adaptive'`` is ``AdaptiveDamping()``).

    Attributes:
        initial: the damping of the first steps.
        interval: steps between two adjustments (``T₁`` of the paper); each
            adjustment evaluates the loss twice (before and after the step).
        omega: the factor of one adjustment (None: ``(19/20)^interval``).
        low, high: the damping stays within these.
    """

    initial: float = 0.003
    interval: int = 5
    omega: float | None = None
    low: float = 1e-6
    high: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.interval, bool) or not isinstance(self.interval, int) or self.interval < 1:
            raise ValueError(f"AdaptiveDamping.interval must be a positive integer, got {self.interval!r}")
        for name in ("initial", "low", "high"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise ValueError(f"AdaptiveDamping.{name} must be a positive number, got {value!r}")
        if not self.low <= self.initial <= self.high:
            raise ValueError(f"AdaptiveDamping needs low <= initial <= high, got {self.low}, {self.initial}, {self.high}")
        if self.omega is not None and not (0.0 < self.omega < 1.0):
            raise ValueError(f"AdaptiveDamping.omega must be in (0, 1), got {self.omega!r}")

    @property
    def factor(self) -> float:
        """``ω``: the given one, or the paper's ``(19/20)^interval``."""
        return (19.0 / 20.0) ** self.interval if self.omega is None else self.omega

    def due(self, step: int) -> bool:
        """Whether step ``step`` (0-based) ends an interval and adjusts the damping."""
        return (step + 1) % self.interval == 0


def levenberg_marquardt(damping: float, rho: float, omega: float, low: float, high: float) -> float:
    """The damping after a step of reduction ratio ``rho``: ``×ω`` above 3/4, ``÷ω`` below 1/4, kept in ``[low, high]``."""
    if rho > 0.75:
        damping = damping * omega
    elif rho < 0.25:
        damping = damping / omega
    return min(max(damping, low), high)


def reduction_ratio(loss_before: float, loss_after: float, predicted: float) -> float:
    """``ρ = (h(θ+δ) - h(θ)) / M(δ)``; ``-inf`` when the model predicted no decrease (``M(δ) >= 0``) or a loss is not finite."""
    if not (predicted < 0.0 and math.isfinite(loss_before) and math.isfinite(loss_after)):
        return -math.inf
    return (loss_after - loss_before) / predicted


def kronecker_quadratic(v: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> float:
    """``vec(V)ᵀ (A ⊗ G) vec(V) = Σ (G V) ∘ (V A)`` for a ``g x a`` (or ``blocks x g x a``) ``V``; a 1-D ``A`` is a diagonal."""
    va = v * a if a.dim() == 1 else v @ a
    return float(((g @ v) * va).sum())


def quadratic_model(
    layers: Sequence[KFACLayer],
    layer_deltas: Mapping[str, torch.Tensor],
    grads: Sequence[torch.Tensor],
    deltas: Sequence[torch.Tensor],
    damping: float,
) -> float:
    """``M(δ) = ∇hᵀδ + ½ (Σ_layers δᵀ(A ⊗ G)δ + γ‖δ‖²)``, in float64.

    ``grads`` and ``deltas`` pair every parameter's averaged gradient with its
    change; ``layer_deltas`` holds each preconditioned layer's change in its
    gradient layout (bias as the last column).
    """
    linear = sum(float((g.double() * d.double()).sum()) for g, d in zip(grads, deltas))
    square = sum(float(d.double().pow(2).sum()) for d in deltas)
    curvature = 0.0
    for layer in layers:
        a, g = layer.A, layer.G
        if a is None or g is None:  # no factor yet: the layer counts with the damping alone
            continue
        curvature += kronecker_quadratic(layer_deltas[layer.name].double(), a.double(), g.double())
    return linear + 0.5 * (curvature + damping * square)


#: The ``damping`` value that asks for :class:`AdaptiveDamping` with its defaults.
ADAPTIVE = "adaptive"


def damping_rule(damping: object, update_fusion: str = "none", grad_scaler: Any | None = None) -> AdaptiveDamping | None:
    """The rule a ``damping`` option asks for (None: a number or a schedule, checked elsewhere).

    The rule evaluates the loss after the update inside ``step()``, so it refuses ``update_fusion`` and a
    ``grad_scaler`` (ValueError naming the way out).
    """
    if isinstance(damping, AdaptiveDamping):
        rule = damping
    elif isinstance(damping, str):
        if damping != ADAPTIVE:
            raise ValueError(f"damping must be a number, a function of the step, 'adaptive' or an AdaptiveDamping, got {damping!r}")
        rule = AdaptiveDamping()
    else:
        return None
    if update_fusion != "none" or grad_scaler is not None:
        raise ValueError(
            "damping='adaptive' evaluates the loss after the update inside step(): it needs update_fusion='none' "
            "and no grad_scaler (GradScaler.step does not pass a closure); use a fixed or scheduled damping"
        )
    return rule


NEEDS_CLOSURE = (
    "damping='adaptive' measures each step against the loss it predicted, so it needs the loss at the new "
    "parameters: call optimizer.step(closure) with a closure that returns the loss of this step's batch "
    "(e.g. lambda: loss_fn(model(x), y); forward only, no backward: the optimizer calls it under torch.no_grad(), "
    "before and after the update, every `interval` steps)"
)

CLOSURE_WITH_BACKWARD = (
    "the closure given to step() under damping='adaptive' must only compute the loss (no zero_grad(), no "
    "backward()): the optimizer evaluates it under torch.no_grad() before and after the update; run the "
    "backward pass before step() as usual"
)


class DampingStep:
    """``step(closure)`` under ``damping='adaptive'``: on the steps that end an interval, the loss before and after
    the update, the quadratic model's prediction, ``ρ`` and the new damping of every parameter group.

    Args:
        rule: the rule's settings.
        model: the preconditioned (bare) model, whose buffers the closure's passes leave as they were.
        layers: the preconditioned layers (their running factors are the model's curvature).
        backend: the engine that averages the two losses over the workers.
    """

    def __init__(self, rule: AdaptiveDamping, model: nn.Module, layers: Sequence[KFACLayer], backend: CommBackend) -> None:
        self.rule, self.model, self.layers, self.backend = rule, model, layers, backend
        #: ρ of the last damping adjustment, for the record.
        self.last_reduction_ratio: float | None = None

    def step(
        self,
        closure: Callable[[], Any] | None,
        param_groups: list[dict[str, Any]],
        due: bool,
        synchronize: Callable[[], None],
        run_step: Callable[[], bool],
    ) -> Any:
        """``run_step()`` (the K-FAC step and the base update; False when skipped over NaN/Inf); when ``due``, measured
        around it and the damping adjusted. Returns the loss before the update on the steps that measure, else None.

        ``synchronize`` waits for the averaged gradients ``∇h`` (the plain order then preconditions: same result).
        """
        if closure is None:
            raise ValueError(NEEDS_CLOSURE)
        if not due:
            run_step()
            return None
        synchronize()
        params = [p for group in param_groups for p in group["params"] if p.grad is not None]
        grads = [p.grad.detach().clone() for p in params if p.grad is not None]
        before = [p.detach().clone() for p in params]
        damping = float(param_groups[0]["damping"])  # in force for this step (a number: not scheduled)
        loss_before = self._loss_only(closure)
        if not run_step():  # skipped over NaN/Inf: nothing moved, nothing to measure
            return loss_before
        losses = torch.tensor([float(loss_before), float(self._loss_only(closure))], dtype=torch.float64)
        if self.backend.size > 1:
            self.backend.allreduce_async(losses, "spdkfac.adaptive_damping").wait()
        deltas = [p.detach() - b for p, b in zip(params, before)]
        predicted = quadratic_model(self.layers, self._layer_deltas(params, deltas), grads, deltas, damping)
        rho = reduction_ratio(float(losses[0]), float(losses[1]), predicted)
        new = levenberg_marquardt(damping, rho, self.rule.factor, self.rule.low, self.rule.high)
        for group in param_groups:
            group["damping"] = new
        self.last_reduction_ratio = rho
        return loss_before

    def _loss_only(self, closure: Callable[[], Any]) -> Any:
        """The closure's loss under ``torch.no_grad()``, the model's buffers (BatchNorm's statistics) left as they were."""
        buffers = [b.detach().clone() for b in self.model.buffers()]
        try:
            with torch.no_grad():
                return closure()
        except RuntimeError as exc:
            if "does not require grad" in str(exc):
                raise RuntimeError(CLOSURE_WITH_BACKWARD) from exc
            raise
        finally:
            for b, saved in zip(self.model.buffers(), buffers):
                b.copy_(saved)

    def _layer_deltas(self, params: list[torch.Tensor], deltas: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each preconditioned layer's parameter change in its gradient layout (read through its helper)."""
        held = [p.grad for p in params]
        try:
            for p, d in zip(params, deltas):
                p.grad = d
            return {layer.name: m.clone() for layer in self.layers if (m := layer.grad_matrix()) is not None}
        finally:
            for p, g in zip(params, held):
                p.grad = g
