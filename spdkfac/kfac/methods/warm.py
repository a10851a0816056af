"""``eigen_refresh='warm'``: an eigenbasis refreshed from the previous one instead of a full ``eigh``.

The running averages change little between decompositions (``F <- 0.95 F +
0.05 F_batch``), so the last basis ``Q`` nearly diagonalizes the new factor.
One step of subspace iteration, ``Q <- qr(F Q)``, refines it with one matrix
product and one QR decomposition; the eigenvalues are the diagonal of
``Q_new^T F Q_old = R`` (equal to ``diag(Q^T F Q)`` to first order in the
basis change, without a second product).

With ``ritz=True`` (off by default: its second product made the refresh
slower than KAISA's full decompositions at lr 0.1, docs/experiments/eigenbasis.md)
a Rayleigh–Ritz step follows. At a training learning rate the factors move more than one step can follow:
within the leading eigenvalues, which are close to one another, subspace
iteration converges at the rate of their ratios, i.e. hardly
(ResNet-50 at LR 0.1: a second and third step took the residual from 0.14
to 0.13 and 0.12). A Rayleigh–Ritz step on the leading ``k`` columns
(``k = max(64, dim/8)``; every column up to dimension 64) rotates them
within their span exactly: ``V, θ = eigh(Q_kᵀ F Q_k)``, ``Q_k <- Q_k V``,
for a second ``d x d`` product ``F Q`` and a ``k``-wide ``eigh`` (1/512 of a
full one at ``k = dim/8``). The product also gives the other columns'
Rayleigh quotients and the refreshed basis's own residual,
``|F Q - Q diag(d)|_F / |d|``; a full ``eigh`` is made instead when it
exceeds ``tolerance``. Either way a full ``eigh`` is made before the
first refresh, and every ``full_every`` refreshes. The previous basis's
residual on the new factor, ``|F Q - Q diag(Q^T F Q)|_F / |diag(Q^T F Q)|``
(0 when it still diagonalizes ``F``), is reported as the factor's drift
(:class:`RefreshStatistics`). ``ritz=False`` (the default) is the step
without Rayleigh–Ritz, deciding on that drift before its QR.

The columns are kept in descending eigenvalue order: orthogonalizing each
column against the larger ones first is what makes subspace iteration
converge (an error towards a larger eigenvector is removed by the QR, one
towards a smaller one shrinks by the eigenvalue ratio).

The decision uses only the factor and the previous basis, which every rank
holds bitwise alike (every decomposition is broadcast to all), and the
count of refreshes since the last ``eigh`` (``age``) travels in the payload,
so whichever rank owns a factor decides the same as any other would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ..linalg import symmetric_eigh

__all__ = ["REFRESH_KINDS", "WARM_TOLERANCE", "FactorRefreshes", "RefreshStatistics", "WarmRefresh", "WarmStep", "descending_eigh", "drift"]

#: Relative residual ``|F Q - Q diag(d)|_F / |d|`` above which a warm refresh is replaced by a full ``eigh``.
WARM_TOLERANCE = 0.15
#: The Rayleigh–Ritz block: the leading ``max(RITZ_MIN, ceil(dim * RITZ_FRACTION))`` columns (all, up to RITZ_MIN).
RITZ_FRACTION = 0.125
RITZ_MIN = 64


def descending_eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, Q)`` of a symmetric (stack of) matrix, eigenvalues in descending order."""
    d, q = symmetric_eigh(factor)
    return d.flip(-1), q.flip(-1)


@dataclass(frozen=True)
class WarmStep:
    """One warm refresh's outcome: the previous basis's residual on the new factor, and the refreshed ``(d, Q)``
    (None when the residual exceeded the tolerance: a full ``eigh`` is needed)."""

    drift: float
    refreshed: tuple[torch.Tensor, torch.Tensor] | None


@dataclass(frozen=True)
class WarmRefresh:
    """When and how a warm-started refresh replaces ``eigh`` (see the module docstring)."""

    full_every: int = 10
    tolerance: float = WARM_TOLERANCE
    ritz: bool = False  # measured slower than KAISA at lr 0.1 with it on (docs/experiments/eigenbasis.md): opt-in

    def __post_init__(self) -> None:
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"eigen_full_every must be a positive integer, got {self.full_every!r}")
        if not (isinstance(self.tolerance, (int, float)) and self.tolerance > 0):
            raise ValueError(f"warm refresh tolerance must be a positive number, got {self.tolerance!r}")

    def due_full(self, age: int | None) -> bool:
        """Whether this refresh must be a full ``eigh`` (no previous basis, or ``full_every`` reached)."""
        return age is None or age + 1 >= self.full_every

    def refine(self, factor: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(d, Q)`` refreshed from the previous basis ``q`` (per block for a stack), eigenvalues descending;
        None when the previous basis drifted beyond :attr:`tolerance` (a full ``eigh`` is then needed)."""
        return self.step(factor, q).refreshed

    def step(self, factor: torch.Tensor, q: torch.Tensor) -> WarmStep:
        """:meth:`refine`, with the previous basis's residual on ``factor`` (reported by :class:`RefreshStatistics`)."""
        y = factor @ q
        residual = drift(q, y)
        if not self.ritz:
            return WarmStep(residual, None if residual > self.tolerance else _orthonormalise(y))
        d, q = _orthonormalise(y)
        del y
        d, q, refined = rayleigh_ritz(factor, d, q, ritz_columns(q.shape[-1]))
        return WarmStep(residual, None if refined > self.tolerance else (d, q))


def ritz_columns(dim: int) -> int:
    """How many leading columns the Rayleigh–Ritz step rotates (all of a small factor's)."""
    return min(dim, max(RITZ_MIN, math.ceil(dim * RITZ_FRACTION)))


def rayleigh_ritz(factor: torch.Tensor, d: torch.Tensor, q: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(d, Q, residual)``: ``Q``'s leading ``k`` columns rotated to the Ritz vectors of ``factor`` in their span, the
    other columns' eigenvalues their Rayleigh quotients, and the new basis's residual on ``factor``.

    One product ``Y = F Q`` serves all three: the block's projection ``Q_kᵀ Y_k`` (a ``k``-wide ``eigh``),
    ``diag(Qᵀ Y)`` behind it, and ``residual = max |F Q - Q diag(d)|_F / |d|`` over blocks (``F Q_k V = Y_k V``):
    0 for an exact eigenbasis. ``d`` (the QR's estimate) is replaced. Eigenvalues stay descending (re-sorted where
    a Ritz value falls below a later column's).
    """
    del d
    y = factor @ q
    qk, yk = q[..., :k], y[..., :k]
    theta, v = symmetric_eigh(qk.mT @ yk)  # symmetric in exact arithmetic; eigh reads one triangle
    theta, v = theta.flip(-1), v.flip(-1)
    y[..., :k] = yk @ v  # F (Q_k V), from the product already made (each right side is made before the copy)
    q[..., :k] = qk @ v  # q is the QR's own output, rotated in place
    d = (q * y).sum(-2)  # Rayleigh quotients: the Ritz values on the block, diag(Qᵀ F Q) behind it
    d[..., :k] = theta
    scale = torch.linalg.vector_norm(d, dim=-1).clamp_min(torch.finfo(d.dtype).tiny)
    residual = float((torch.linalg.vector_norm(y.sub_(q * d.unsqueeze(-2)), dim=(-2, -1)) / scale).max())
    if not bool((d[..., :-1] >= d[..., 1:]).all()):
        order = torch.argsort(d, dim=-1, descending=True, stable=True)
        d, q = d.gather(-1, order), q.gather(-1, order.unsqueeze(-2).expand_as(q))
    return d, q, residual


def _orthonormalise(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(diag(R), Q)`` of ``y = F Q_old``'s QR, columns signed like the previous basis's and in descending order."""
    q, r = torch.linalg.qr(y)
    # diag(R) = diag(Q_new^T F Q_old): the eigenvalues to first order in the basis change (no second product).
    # A column's sign is arbitrary: keep the previous one's (diag(R) > 0), so the basis moves continuously.
    r_diag = r.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(r_diag < 0, -1.0, 1.0).to(q.dtype)
    q.mul_(sign.unsqueeze(-2))  # q is the QR's own output: scaled in place, no second d x d buffer
    d = r_diag * sign
    if bool((d[..., :-1] >= d[..., 1:]).all()):
        return d, q  # already descending (the usual case): no d x d gather
    order = torch.argsort(d, dim=-1, descending=True, stable=True)
    return d.gather(-1, order), q.gather(-1, order.unsqueeze(-2).expand_as(q))


def drift(q: torch.Tensor, fq: torch.Tensor) -> float:
    """``max |F Q - Q diag(Q^T F Q)|_F / |diag(Q^T F Q)|`` over blocks, from ``fq = F Q``: 0 for an exact basis."""
    d = (q * fq).sum(-2)
    scale = torch.linalg.vector_norm(d, dim=-1).clamp_min(torch.finfo(d.dtype).tiny)
    return float((torch.linalg.vector_norm(fq - q * d.unsqueeze(-2), dim=(-2, -1)) / scale).max())


#: The kinds of refresh :class:`RefreshStatistics` counts.
REFRESH_KINDS = ("warm", "full_scheduled", "full_drift")


@dataclass
class FactorRefreshes:
    """One factor's refreshes: how many were warm, full by schedule (the first and every ``full_every``-th), full
    because the residual exceeded the tolerance; the last and the largest residual measured."""

    dim: int
    warm: int = 0
    full_scheduled: int = 0
    full_drift: int = 0
    drift: float | None = None
    max_drift: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"dim": self.dim, **{kind: getattr(self, kind) for kind in REFRESH_KINDS}, "drift": self.drift, "max_drift": self.max_drift}


class RefreshStatistics:
    """Per factor, how its eigenbasis was refreshed (``eigen_refresh='warm'``), read from the kept decompositions.

    Every rank holds every factor's age and residual (they travel in the
    payload), so every rank counts the same. Read it with
    :meth:`SPDKFACOptimizer.refresh_statistics() <spdkfac.SPDKFACOptimizer.refresh_statistics>`.
    """

    def __init__(self) -> None:
        self.factors: dict[str, FactorRefreshes] = {}

    def record(self, name: str, dim: int, age: int, residual: float) -> None:
        """One refresh of factor ``name``: ``age`` 0 is a full ``eigh``; ``residual`` < 0: not measured (scheduled)."""
        entry = self.factors.setdefault(name, FactorRefreshes(dim))
        if residual >= 0:
            entry.drift = residual
            entry.max_drift = max(entry.max_drift, residual)
        if age > 0:
            entry.warm += 1
        elif residual < 0:
            entry.full_scheduled += 1
        else:
            entry.full_drift += 1

    def totals(self) -> dict[str, Any]:
        """Refreshes of every kind over all factors, the warm share, and the factors that fell back on drift."""
        out: dict[str, Any] = {kind: sum(getattr(f, kind) for f in self.factors.values()) for kind in REFRESH_KINDS}
        total = sum(out.values())
        out["refreshes"] = total
        out["warm_share"] = out["warm"] / total if total else None
        out["fell_back"] = sorted(name for name, f in self.factors.items() if f.full_drift)
        return out

    def as_dict(self) -> dict[str, Any]:
        """``{'totals': ..., 'factors': {name: counts}}`` (JSON-ready)."""
        return {"totals": self.totals(), "factors": {name: f.as_dict() for name, f in self.factors.items()}}
