"""``eigen_refresh='warm'``: an eigenbasis refreshed from the previous one instead of a full ``eigh``.

The running averages change little between decompositions (``F <- 0.95 F +
0.05 F_batch``), so the last basis ``Q`` nearly diagonalizes the new factor.
One step of subspace iteration, ``Q <- qr(F Q)``, refines it with one matrix
product and one QR decomposition; the eigenvalues are the diagonal of
``Q_new^T F Q_old = R`` (equal to ``diag(Q^T F Q)`` to first order in the
basis change, without a second product). Before the QR, the same product
gives the previous basis's residual on the new factor,
``|F Q - Q diag(Q^T F Q)|_F / |diag(Q^T F Q)|`` (0 when it still
diagonalizes ``F``): a full ``eigh`` is made instead when it exceeds
``tolerance`` (the factor moved too far for one step to follow), before the
first refresh, and every ``full_every`` refreshes.

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

from dataclasses import dataclass

import torch

from ..linalg import symmetric_eigh

__all__ = ["WARM_TOLERANCE", "WarmRefresh", "descending_eigh", "drift"]

#: Relative residual ``|F Q - Q diag(d)|_F / |d|`` above which a warm refresh is replaced by a full ``eigh``.
WARM_TOLERANCE = 0.15


def descending_eigh(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d, Q)`` of a symmetric (stack of) matrix, eigenvalues in descending order."""
    d, q = symmetric_eigh(factor)
    return d.flip(-1), q.flip(-1)


@dataclass(frozen=True)
class WarmRefresh:
    """When and how a warm-started refresh replaces ``eigh`` (see the module docstring)."""

    full_every: int = 10
    tolerance: float = WARM_TOLERANCE

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
        y = factor @ q
        if drift(q, y) > self.tolerance:
            return None
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
