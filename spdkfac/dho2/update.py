"""DHO2's update rule: a Newton step in the extreme-eigenvector subspace, the base optimizer on its complement (Eqs. 3, 4, 13),
and the ADMM-like outer iteration (Algorithm 3).

Everything here is pure tensor maths on flat vectors of the n parameters,
identical on every worker (its inputs are the averaged gradient and the
eigenpairs every worker holds bitwise); no communication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .config import ADMMRule

__all__ = ["ADMMState", "EigenBasis", "hybrid_delta"]


@dataclass
class EigenBasis:
    """The Newton subspace: eigenvalues ``a`` (r,) and orthonormal eigenvectors ``V`` (n, r) of the Hessian.

    :meth:`keep_curvature` applies the rule for non-positive and tiny
    eigenvalues, once per refresh.
    """

    values: torch.Tensor
    vectors: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.values.numel())

    def keep_curvature(self, floor: float) -> EigenBasis:
        """Drop the pairs with ``|a| <= floor``: the Newton subspace keeps only directions with reliable curvature.

        A dropped direction is not lost: it belongs to the complement, where
        the base optimizer handles it like any other. The kept pairs may be
        negative (the ``l`` smallest usually are): :func:`hybrid_delta`
        divides by ``|a|``, so the step never climbs along negative
        curvature (a saddle-free Newton step, as FOSI's).
        """
        keep = self.values.abs() > floor
        return EigenBasis(self.values[keep], self.vectors[:, keep])

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``V (Vᵀ x)``: the component of ``x`` in the subspace."""
        return self.vectors @ (self.vectors.T @ x)


def hybrid_delta(
    grad: torch.Tensor,
    basis: EigenBasis,
    alpha: float,
    shift: float,
    base: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The change of the parameters for one step: ``Δ₁ + Δ₂``.

    - ``Δ₁ = -α V diag(1/(|a| + shift)) Vᵀ grad``: the α-scaled Newton step in
      the subspace (Eq. 3 with ``shift = 0``; Eq. 13's ``(A₁ + σI)⁻¹`` with
      ``shift = σ``, ``grad = g + π``);
    - ``Δ₂ = (I - V Vᵀ) O(grad - g₁)`` with ``g₁ = V Vᵀ grad``: the base
      optimizer's change for the rest of the gradient, projected back onto
      the complement because Adam-like rules change directions (Eq. 4).

    ``base`` maps a flat gradient to the base optimizer's change (it updates
    the base optimizer's state).
    """
    V = basis.vectors
    coords = V.T @ grad
    newton = V @ (coords / (basis.values.abs() + shift)) * -alpha
    rest = base(grad - V @ coords)
    return newton + (rest - V @ (V.T @ rest))


class ADMMState:
    """The ADMM-like outer iteration (Eq. 11, Algorithm 3) over the model's parameters ``w_a``, in one of three forms.

    It keeps the multiplier ``π`` and ``w`` (``anchor``: where the current
    outer iteration started). Each outer iteration runs ``period`` ordinary
    steps on a gradient :meth:`gradient` shifts; :meth:`end_period` closes it
    (line 16: ``π ← π + σ(w_a - w)``), computes the next ``w`` (line 5:
    ``w ← w_a + π/σ``) and returns where the parameters continue from.
    ``π⁰ = 0`` and ``w¹ = w_a⁰``: the first outer iteration starts where
    training does. The forms (``rule``):

    - ``'code'``: the authors' code (and Algorithm 3 as printed): gradient
      ``g + π``; the parameters move to ``w`` (line 6).
    - ``'lagrangian'``: gradient ``g + π + σ(w_a - w)``, the gradient of
      Eq. 10 in ``w_a`` (the inner loop descends Eq. 11's subproblem); the
      parameters move to ``w``.
    - ``'proximal'``: the same gradient; the parameters stay at ``w_a``.

    Whatever the form, ``π/σ`` after line 16 equals ``w_a^{k+1} - w_a^k``
    (the displacement between the ends of the last two outer iterations), so
    moving to ``w`` extrapolates by it; and ``w - π/σ = w_a^k``, so the
    ``'lagrangian'`` gradient is ``g + σ(w_a - w_a^k)``: a proximal pull
    towards the previous outer iteration's end (docs/dho2.md).
    """

    def __init__(self, params: torch.Tensor, sigma: float, rule: str = "code") -> None:
        self.sigma = sigma
        self.rule = rule
        self.multiplier = torch.zeros_like(params)  # π
        self.anchor = params.clone()  # w^{k+1}: where the current outer iteration started

    def gradient(self, grad: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """The inner loop's gradient at ``params`` (= w_a): ``g + π``, or ``g + π + σ(w_a - w)`` (``'lagrangian'``, ``'proximal'``)."""
        shifted = grad + self.multiplier
        if self.rule == ADMMRule.CODE:
            return shifted
        return shifted.add_(params - self.anchor, alpha=self.sigma)

    def centre(self) -> torch.Tensor:
        """``w - π/σ``: the end of the last closed outer iteration, ``w_a^k`` (the proximal centre; the start before any)."""
        return self.anchor - self.multiplier / self.sigma

    def end_period(self, params: torch.Tensor) -> torch.Tensor:
        """Close the outer iteration ending at ``params`` (= w_a^{k+1}); return where the parameters continue from
        (``w^{k+2}``, or ``params`` itself with ``'proximal'``)."""
        self.multiplier.add_(params - self.anchor, alpha=self.sigma)
        self.anchor = params + self.multiplier / self.sigma
        return params if self.rule == ADMMRule.PROXIMAL else self.anchor.clone()
