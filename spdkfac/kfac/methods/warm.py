"""``eigen_refresh='warm'``: an eigenbasis refreshed from the previous one instead of a full ``eigh``.

The running averages change little between decompositions (``F <- 0.95 F +
0.05 F_batch``), so the last basis ``Q`` nearly diagonalizes the new factor.
Every step starts with one product ``Y = F Q``: it gives the previous
basis's residual on the new factor, ``|F Q - Q diag(d)|_F / |d|`` with
``d = diag(Qᵀ F Q)`` (0 when ``Q`` still diagonalizes ``F``), reported as the
factor's drift (:class:`RefreshStatistics`), and every column's Rayleigh
quotient. Three steps follow from it (:class:`WarmStepKind`):

``'block'`` (the default) refines the leading ``k = max(64, dim/8)``
columns, where the largest eigenvalues sit and a drift matters most to the
preconditioner, by one subspace-iteration step and a Rayleigh–Ritz step:
``Q_k <- qr(Y_k)``, ``V, θ = eigh(Q_kᵀ F Q_k)``, ``Q_k <- Q_k V``, for one
``d x k`` product and a ``k``-wide ``eigh``. The other columns keep the
previous basis, made orthonormal to the new leading block exactly:
``P = (I - Q_k Q_kᵀ) Q_rest`` times ``(PᵀP)^(-1/2)``, whose ``d - k``-wide
inverse square root is ``I + Cᵀ U g(S²) Uᵀ C`` from the ``k``-wide
eigendecomposition ``C Cᵀ = U S² Uᵀ`` of the overlap ``C = Q_kᵀ Q_rest``,
with their eigenvalues the Rayleigh quotients. Beside the one ``d x d``
product everything is ``O(d² k)``: on one CPU thread the step takes
0.43–0.56 of an ``eigh`` from d = 512 to 4608 (more than an ``eigh`` below
256 wide, where the leading block is most of the factor), and on ResNet-20 at
a training learning rate its preconditioned gradient is 6–40x closer to
``eigh``'s (between full ones) than one subspace step's on every column (docs/experiments/eigenbasis.md,
which also shows where it is not: a broad spectrum whose small eigenvalues
all count against the damping). A full ``eigh`` is made instead when the
refreshed basis's own residual (the Ritz block's, and the kept columns'
computed from ``Y`` and ``F Q_k``) exceeds ``tolerance``, or when a kept
column lies in the new block's span (``S² > 0.99``).

``'subspace'`` is one subspace-iteration step on every column, ``Q <-
qr(F Q)`` (one ``d x d`` QR, 0.66–0.73 of an ``eigh``), the eigenvalues the
diagonal of ``Q_newᵀ F Q_old = R`` (equal to ``diag(Qᵀ F Q)`` to first order
in the basis change); it decides on the drift before its QR. Within the
leading eigenvalues, which are close to one another, subspace iteration
converges at the rate of their ratios, i.e. hardly (ResNet-50 at LR 0.1: a
second and third step took the residual from 0.14 to 0.13 and 0.12).
``'ritz'`` adds the Rayleigh–Ritz step on the leading columns after it, for
a second ``d x d`` product (measured slower than KAISA's full
decompositions at lr 0.1), and decides on the refreshed basis's residual.
Either way a full ``eigh`` is made before the first refresh, and every
``full_every`` refreshes.

The columns are kept in descending eigenvalue order: the leading block is
then the largest eigenvalues' (and for ``'subspace'``, orthogonalizing each
column against the larger ones first is what makes subspace iteration
converge). A column's sign follows the previous basis's, so the basis
moves continuously (EKFAC keeps its scaling across a refresh).

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

from ...options import Option
from ..linalg import symmetric_eigh

__all__ = [
    "REFRESH_KINDS",
    "WARM_TOLERANCE",
    "FactorRefreshes",
    "RefreshStatistics",
    "WarmRefresh",
    "WarmStep",
    "WarmStepKind",
    "descending_eigh",
    "drift",
]

#: Relative residual ``|F Q - Q diag(d)|_F / |d|`` above which a warm refresh is replaced by a full ``eigh``.
WARM_TOLERANCE = 0.15
#: The Rayleigh–Ritz block: the leading ``max(RITZ_MIN, ceil(dim * RITZ_FRACTION))`` columns (all, up to RITZ_MIN).
RITZ_FRACTION = 0.125
RITZ_MIN = 64
#: ``'block'``: the largest squared cosine between a kept column and the new leading block before a full ``eigh``.
OVERLAP_LIMIT = 0.99


class WarmStepKind(Option):
    """How a warm refresh refines the previous basis (the module docstring compares them)."""

    BLOCK = "block"  # a subspace and a Rayleigh–Ritz step on the leading columns, the rest kept orthonormal to them
    SUBSPACE = "subspace"  # one subspace-iteration step on every column (one d x d QR)
    RITZ = "ritz"  # the subspace step, then Rayleigh–Ritz on the leading columns (a second d x d product)


def descending_eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, Q)`` of a symmetric (stack of) matrix, eigenvalues in descending order."""
    d, q = symmetric_eigh(factor)
    return d.flip(-1), q.flip(-1)


@dataclass(frozen=True)
class WarmStep:
    """One warm refresh's outcome: the previous basis's residual on the new factor, and the refreshed ``(d, Q)``
    (None when the residual exceeded the tolerance: a full ``eigh`` is needed); ``'block'`` and ``'ritz'`` also
    give the refreshed basis's own residual, which they decide on (None where not measured)."""

    drift: float
    refreshed: tuple[torch.Tensor, torch.Tensor] | None
    refined: float | None = None


@dataclass(frozen=True)
class WarmRefresh:
    """When and how a warm-started refresh replaces ``eigh`` (see the module docstring)."""

    full_every: int = 10
    tolerance: float = WARM_TOLERANCE
    kind: WarmStepKind = WarmStepKind.BLOCK

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", WarmStepKind.parse("warm step kind", self.kind))
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
        if self.kind is WarmStepKind.SUBSPACE:
            return WarmStep(residual, None if residual > self.tolerance else _orthonormalise(y))
        if self.kind is WarmStepKind.BLOCK:
            block = block_refresh(factor, q, y, ritz_columns(q.shape[-1]))
            if block is None:
                return WarmStep(residual, None)
            d, q, refined = block
        else:
            d, q = _orthonormalise(y)
            del y
            d, q, refined = rayleigh_ritz(factor, d, q, ritz_columns(q.shape[-1]))
        return WarmStep(residual, None if refined > self.tolerance else (d, q), refined)


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
    d = rayleigh_quotients(q, y)  # the Ritz values on the block, diag(Qᵀ F Q) behind it
    d[..., :k] = theta
    scale = torch.linalg.vector_norm(d, dim=-1).clamp_min(torch.finfo(d.dtype).tiny)
    residual = float((torch.linalg.vector_norm(y.sub_(q * d.unsqueeze(-2)), dim=(-2, -1)) / scale).max())
    return (*_descending(d, q), residual)


def block_refresh(factor: torch.Tensor, q: torch.Tensor, y: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """``(d, Q, residual)`` of the ``'block'`` step (module docstring) from ``y = F Q``; None when a kept column lies
    in the new leading block's span (a full ``eigh`` is then needed).

    The kept columns' eigenvalues are their Rayleigh quotients, and ``residual = max |F Q - Q diag(d)|_F / |d|``
    over blocks is the refreshed basis's own: ``F`` times the new columns comes from ``y`` and ``F Q_k`` by the
    same ``d x k`` products that make them.
    """
    dim = q.shape[-1]
    # One subspace step on the leading columns, shifted: (F + μI) Q_k with μ = sqrt(eps) x the largest eigenvalue
    # (above the products' rounding), so that a column F annihilates (a rank-deficient factor) keeps its previous
    # direction: unshifted, the QR would fill it with a direction of its rounding noise, which lies in the span
    # of the kept columns (and the step would fall back to eigh).
    top = rayleigh_quotients(q[..., :1], y[..., :1]).abs().unsqueeze(-1)
    shift = math.sqrt(torch.finfo(y.dtype).eps)
    head, _ = torch.linalg.qr(torch.addcmul(y[..., :k], q[..., :k], top, value=shift))
    f_head = factor @ head
    theta, v = symmetric_eigh(head.mT @ f_head)  # Rayleigh–Ritz within their span (eigh reads one triangle)
    theta, v = theta.flip(-1), v.flip(-1)
    head, f_head = head @ v, f_head @ v
    sign = torch.where((q[..., :k] * head).sum(-2) < 0, -1.0, 1.0).to(head.dtype)  # the previous columns' signs
    head.mul_(sign.unsqueeze(-2))
    f_head.mul_(sign.unsqueeze(-2))
    d, basis, residual_sq = theta, head, _squared_residual(f_head, theta)
    if k < dim:
        kept = q[..., k:]
        overlap = head.mT @ kept  # C = Q_kᵀ Q_rest
        s2, u = symmetric_eigh(overlap @ overlap.mT)  # C Cᵀ = U S² Uᵀ
        if float(s2.max()) > OVERLAP_LIMIT:
            return None
        r = torch.sqrt(1.0 - s2.clamp_min(0.0))
        inv_sqrt = (u * (1.0 / (r * (1.0 + r))).unsqueeze(-2)) @ (u.mT @ overlap)  # g(S²) Uᵀ C, g = ((1-s²)^-½ - 1)/s²
        # P = (I - Q_k Q_kᵀ) Q_rest has PᵀP = I - CᵀC, so P (I - CᵀC)^-½ = P + P Cᵀ U g Uᵀ C; F P = F Q_rest - F Q_k C.
        projected = _add_product(kept, head, overlap, -1.0)
        rest = _add_product(projected, projected @ overlap.mT, inv_sqrt)
        del projected
        f_projected = _add_product(y[..., k:], f_head, overlap, -1.0)
        f_rest = _add_product(f_projected, f_projected @ overlap.mT, inv_sqrt)
        del f_projected
        quotients = rayleigh_quotients(rest, f_rest)
        residual_sq = residual_sq + _squared_residual(f_rest, quotients)
        del f_rest
        d, basis = torch.cat([theta, quotients], -1), torch.cat([head, rest], -1)
        del rest
    scale = torch.linalg.vector_norm(d, dim=-1).clamp_min(torch.finfo(d.dtype).tiny)
    residual = float((residual_sq.sqrt() / scale).max())
    return (*_descending(d, basis), residual)


def _add_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``x + alpha (a @ b)`` as one product call (a new tensor; a stack of blocks batched)."""
    if x.dim() == 3:
        return torch.baddbmm(x, a, b, alpha=alpha)
    return torch.addmm(x, a, b, alpha=alpha)


def _orthonormalise(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(diag(R), Q)`` of ``y = F Q_old``'s QR, columns signed like the previous basis's and in descending order."""
    q, r = torch.linalg.qr(y)
    # diag(R) = diag(Q_new^T F Q_old): the eigenvalues to first order in the basis change (no second product).
    # A column's sign is arbitrary: keep the previous one's (diag(R) > 0), so the basis moves continuously.
    r_diag = r.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(r_diag < 0, -1.0, 1.0).to(q.dtype)
    q.mul_(sign.unsqueeze(-2))  # q is the QR's own output: scaled in place, no second d x d buffer
    return _descending(r_diag * sign, q)


def _descending(d: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, Q)`` with the eigenvalues (and their columns) in descending order, per block."""
    if bool((d[..., :-1] >= d[..., 1:]).all()):
        return d, q  # already descending (the usual case): no d x d gather
    order = torch.argsort(d, dim=-1, descending=True, stable=True)
    return d.gather(-1, order), q.gather(-1, order.unsqueeze(-2).expand_as(q))


def rayleigh_quotients(q: torch.Tensor, fq: torch.Tensor) -> torch.Tensor:
    """``diag(Qᵀ F Q)`` from ``fq = F Q`` (per block)."""
    return (q * fq).sum(-2)


def drift(q: torch.Tensor, fq: torch.Tensor, quotients: torch.Tensor | None = None) -> float:
    """``max |F Q - Q diag(d)|_F / |d|`` over blocks, ``d = diag(Qᵀ F Q)``, from ``fq = F Q``: 0 for an exact basis.

    For an orthonormal ``Q``, two reductions (:func:`_squared_residual`).
    """
    d = rayleigh_quotients(q, fq) if quotients is None else quotients
    scale = (d * d).sum(-1).sqrt().clamp_min(torch.finfo(d.dtype).tiny)
    return float((_squared_residual(fq, d).sqrt() / scale).max())


def _squared_residual(fq: torch.Tensor, quotients: torch.Tensor) -> torch.Tensor:
    """``|F Q - Q diag(d)|_F²`` per block for orthonormal columns ``Q`` with their Rayleigh quotients ``d``:
    ``|F Q|² - |d|²`` (each column's residual is orthogonal to it), no ``d x d`` temporary."""
    norm: torch.Tensor = torch.linalg.vector_norm(fq, dim=(-2, -1))
    return (norm**2 - (quotients * quotients).sum(-1)).clamp_min(0.0)


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
