"""What each factor is turned into before preconditioning: a damped inverse or an eigendecomposition.

``compute_method='inverse'`` (the paper's): ``(F + γI)^-1`` per factor, the
update ``(G+γI)^-1 grad (A+γI)^-1``; the inverse is symmetric, so it travels
as its upper triangle (``d(d+1)/2`` elements).

``compute_method='eigen'`` (Pauloski et al. 2020, KAISA): ``F = Q diag(d) Q^T``
from ``torch.linalg.eigh``, eigenvalues below :data:`EIGEN_CLAMP` set to 0,
and the update ``Q_G [(Q_G^T grad Q_A) / (d_G d_A^T + γ)] Q_A^T``, which is
``(A ⊗ G + γI)^-1 vec(grad)``: the damping is added to the eigenvalues of the
Kronecker product (not to each factor), and only when preconditioning, so a
new damping needs no new decomposition. ``Q`` is not symmetric: it travels
whole, with ``d``, as one flat buffer of ``d*d + d`` elements.

:func:`payload_size` is the one statement of what a factor's result costs to
broadcast; the placement costs (:func:`stage_costs`), the decomposition stage
and the simulator all use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from .linalg import triangle_size

if TYPE_CHECKING:  # pragma: no cover
    from .perfmodels import PerfModel

__all__ = [
    "COMPUTE_METHODS",
    "EIGEN_CLAMP",
    "Eigen",
    "eigen_payload",
    "eigen_precondition",
    "payload_size",
    "stage_costs",
    "unpack_eigen",
]

COMPUTE_METHODS = ("inverse", "eigen")
EIGEN_CLAMP = 1e-10  # eigenvalues below this are rounding noise of a PSD factor: set to exactly 0

CostFn = Callable[[int], float]


def check_method(method: object) -> str:
    """``method`` if it is one of :data:`COMPUTE_METHODS`, else a ValueError that lists them."""
    if method not in COMPUTE_METHODS:
        raise ValueError(f"compute_method must be one of {COMPUTE_METHODS}, got {method!r}")
    return str(method)


def payload_size(method: str, dim: int) -> int:
    """Elements broadcast for one ``dim x dim`` factor: an inverse's upper triangle, or ``Q`` and ``d``."""
    return triangle_size(dim) if check_method(method) == "inverse" else dim * dim + dim


@dataclass(frozen=True)
class Eigen:
    """One factor's eigendecomposition ``F = Q diag(d) Q^T``: ``Q`` row-major, ``d`` clamped to ``>= 0``.

    Both are views into one flat buffer (the one broadcast), so every rank,
    whether it computed or received them, holds the same values in the same
    memory layout and its matmuls round the same way.
    """

    Q: torch.Tensor
    d: torch.Tensor


def eigen_payload(matrix: torch.Tensor) -> torch.Tensor:
    """``[Q row by row, d]`` of a symmetric PSD matrix as one flat buffer (what an owner broadcasts and keeps)."""
    dim = matrix.shape[0]
    d, q = torch.linalg.eigh(matrix)
    buffer = matrix.new_empty(dim * dim + dim)
    buffer[: dim * dim].view(dim, dim).copy_(q)  # eigh's Q is column-major: this is the row-major copy
    buffer[dim * dim :].copy_(d.masked_fill_(d < EIGEN_CLAMP, 0.0))
    return buffer


def unpack_eigen(buffer: torch.Tensor, dim: int) -> Eigen:
    """Views of ``Q`` and ``d`` in a buffer made by :func:`eigen_payload` (no copy)."""
    if buffer.numel() != dim * dim + dim:
        raise ValueError(f"eigen buffer has {buffer.numel()} elements, expected {dim * dim + dim} for dim={dim}")
    return Eigen(buffer[: dim * dim].view(dim, dim), buffer[dim * dim :])


def eigen_precondition(grad: torch.Tensor, a: Eigen, g: Eigen, damping: float) -> torch.Tensor:
    """``Q_G [(Q_G^T grad Q_A) / (d_G d_A^T + γ)] Q_A^T`` for a ``g_dim x a_dim`` gradient."""
    v = g.Q.T @ grad.to(g.Q.dtype) @ a.Q
    v.div_(torch.outer(g.d, a.d).add_(damping))
    return g.Q @ v @ a.Q.T


def stage_costs(perf: PerfModel, method: str) -> tuple[CostFn, CostFn]:
    """Modelled seconds to decompose and to broadcast a ``d x d`` factor, as the placement solvers take them."""
    compute = perf.decomposition(method)
    return compute, lambda dim: perf.broadcast.payload(payload_size(method, dim))
