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
parameters), so every rank takes the same damping.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..kfac.layers import KFACLayer

__all__ = [
    "ADAPTIVE",
    "CLOSURE_WITH_BACKWARD",
    "NEEDS_CLOSURE",
    "AdaptiveDamping",
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


def damping_rule(damping: object) -> AdaptiveDamping | None:
    """The rule a ``damping`` option asks for (None: a number or a schedule, checked elsewhere)."""
    if isinstance(damping, AdaptiveDamping):
        return damping
    if isinstance(damping, str):
        if damping != ADAPTIVE:
            raise ValueError(f"damping must be a number, a function of the step, 'adaptive' or an AdaptiveDamping, got {damping!r}")
        return AdaptiveDamping()
    return None


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
