"""The Lanczos iteration of FOSI (Algorithm 1) with its basis split by rows across workers (DHO2's Algorithm 2).

The basis ``D`` (n × m) is the memory problem of FOSI: DHO2 gives worker
``c`` only its rows ``D[s_c:e_c, :]`` (:class:`RowSplit`, about n·m/P
values). Per Lanczos step ``i`` every worker

1. all-gathers column ``i`` into the full vector ``v_i`` (line 5);
2. takes the Hessian-vector product ``h = H v_i`` (averaged over the
   workers' batches) and ``B[i,i] = h·v_i`` (lines 6-7);
3. orthogonalises its rows of ``h`` against every column of ``D`` so far
   (full re-orthogonalisation): the projections ``D^T h`` are summed over
   the row blocks with one all-reduce (lines 9-10);
4. gets ``β = ‖h‖`` from a second all-reduce of the blocks' squared norms,
   sets ``B[i+1,i] = B[i,i+1] = β`` and stores ``h/β`` as its rows of column
   ``i+1`` (lines 12-14).

Then :func:`extreme_eigenpairs` decomposes the small tridiagonal ``B`` on
rank 0 and broadcasts the result (so every worker holds bitwise the same
eigenpairs whatever its LAPACK does), keeps the ``k`` largest and ``l``
smallest Ritz values, forms each worker's rows of the Ritz vectors ``D U``,
and all-gathers them. Every value that decides control flow (β, the Ritz
values) is identical on every worker, so they all take the same branches.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..comm import CommBackend

__all__ = ["LanczosResult", "RowSplit", "distributed_lanczos", "extreme_eigenpairs", "lanczos_memory", "start_vector"]


@dataclass(frozen=True)
class RowSplit:
    """Contiguous row blocks of an n-row matrix over ``size`` workers, as even as possible (the first ``n % size`` get one more)."""

    n: int
    size: int

    @property
    def counts(self) -> list[int]:
        base, extra = divmod(self.n, self.size)
        return [base + (1 if r < extra else 0) for r in range(self.size)]

    @property
    def offsets(self) -> list[int]:
        counts = self.counts
        return [sum(counts[:r]) for r in range(self.size)]

    def rows(self, rank: int) -> slice:
        """The rows ``[s_c, e_c)`` worker ``rank`` holds."""
        start = self.offsets[rank]
        return slice(start, start + self.counts[rank])


@dataclass
class LanczosResult:
    """What the iteration leaves on one worker: the tridiagonal ``B`` (m' × m') and this worker's rows of ``D`` (rows × m')."""

    tridiagonal: torch.Tensor
    rows: torch.Tensor
    basis_bytes: int  # bytes of this worker's block of D, as allocated (n·m/P values)

    @property
    def steps(self) -> int:
        """m': the Lanczos steps taken (fewer than asked when an invariant subspace was found)."""
        return int(self.tridiagonal.shape[0])


def start_vector(n: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The unit start vector ``v_1``: standard normal from ``seed`` (drawn in float64 on the CPU, so the same on every worker and device)."""
    gen = torch.Generator().manual_seed(seed)
    v = torch.randn(n, generator=gen, dtype=torch.float64)
    unit: torch.Tensor = v / v.norm()
    return unit.to(dtype=dtype, device=device)


def distributed_lanczos(
    hvp: Callable[[torch.Tensor], torch.Tensor],
    split: RowSplit,
    backend: CommBackend,
    steps: int,
    v1: torch.Tensor,
    name: str = "spdkfac.dho2.lanczos",
) -> LanczosResult:
    """Run ``steps`` Lanczos steps (Algorithm 2) on ``hvp``, this worker holding ``split.rows(backend.rank)`` of ``D``.

    ``hvp`` maps a full vector to its full product with the Hessian (already
    averaged over the workers: the same on every worker). ``v1`` is the full
    unit start vector, the same on every worker. Stops early, with fewer
    steps, when ``β < √eps·‖H v_i‖`` (the Krylov space is invariant to that
    accuracy: its Ritz pairs are then eigenpairs, e.g. after as many steps as
    the Hessian has distinct eigenvalues).
    """
    rank, size = backend.rank, backend.size
    if split.size != size:
        raise ValueError(f"row split for {split.size} workers used with {size}")
    rows = split.rows(rank)
    dtype, device = v1.dtype, v1.device
    D = torch.zeros(rows.stop - rows.start, steps, dtype=dtype, device=device)  # this worker's rows of the basis
    B = torch.zeros(steps, steps, dtype=dtype, device=device)
    D[:, 0] = v1[rows]
    v = torch.empty(split.n, dtype=dtype, device=device)
    # Stop once β < √eps·‖h‖: the Krylov space is invariant to that accuracy (its Ritz pairs are eigenpairs), and a
    # smaller β would divide the one re-orthogonalisation pass's rounding into the next column (loss of orthogonality).
    tol = torch.finfo(dtype).eps ** 0.5
    taken = steps
    for i in range(steps):
        v[rows] = D[:, i]
        backend.allgather_async(v, split.counts, f"{name}.v").wait()
        h = hvp(v)
        B[i, i] = h @ v
        if i == steps - 1:
            break
        h_rows = h[rows].clone()
        coeffs = D.T @ h_rows  # columns beyond i are zero: the full D as in the paper, one fixed-size all-reduce
        _sum_over_workers(coeffs, backend, f"{name}.proj")
        h_rows -= D @ coeffs
        norm_sq = (h_rows @ h_rows).reshape(1)
        _sum_over_workers(norm_sq, backend, f"{name}.norm")
        beta = norm_sq.sqrt()[0]
        if float(beta) <= tol * max(float(h.norm()), torch.finfo(dtype).tiny):
            taken = i + 1  # invariant subspace: every later column would be noise
            break
        B[i + 1, i] = B[i, i + 1] = beta
        D[:, i + 1] = h_rows / beta
    basis_bytes = D.numel() * D.element_size()
    return LanczosResult(B[:taken, :taken].clone(), D[:, :taken], basis_bytes)


def _sum_over_workers(t: torch.Tensor, backend: CommBackend, name: str) -> None:
    """``t`` ← its sum over the workers (the engines average: scale back by P; identical on every worker)."""
    if backend.size > 1:
        backend.allreduce_async(t, name).wait()
        t.mul_(backend.size)


def extreme_eigenpairs(
    result: LanczosResult,
    split: RowSplit,
    backend: CommBackend,
    k: int,
    l: int,  # noqa: E741 the paper's name
    name: str = "spdkfac.dho2.eigen",
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest and ``l`` smallest Ritz pairs of ``B`` (Eq. 8): ``(values (r,), vectors (n, r))``, ascending.

    ``B`` is decomposed on rank 0 in float64 and the result broadcast (one
    collective), so every worker selects the same pairs from the same bits;
    each worker then forms its rows of ``Z = D U`` and the rows are
    all-gathered, leaving the full ``n × r`` vectors on every worker. When
    fewer than ``k + l`` steps were taken, every Ritz pair is returned.
    """
    B, D = result.tridiagonal, result.rows
    m = result.steps
    packed = torch.zeros(m + m * m, dtype=torch.float64, device=B.device)
    if backend.rank == 0:
        values, vectors = torch.linalg.eigh(B.to(torch.float64))
        packed[:m] = values
        packed[m:] = vectors.reshape(-1)
    if backend.size > 1:
        backend.broadcast_async(packed, 0, f"{name}.decomposition").wait()
    values, vectors = packed[:m], packed[m:].reshape(m, m)
    chosen = sorted(set(range(min(l, m))) | set(range(max(m - k, 0), m)))
    index = torch.tensor(chosen, dtype=torch.long, device=B.device)
    U = vectors.index_select(1, index).to(D.dtype)
    r = len(chosen)
    Z = torch.empty(split.n * r, dtype=D.dtype, device=D.device)
    rows = split.rows(backend.rank)
    Z[rows.start * r : rows.stop * r] = (D @ U).reshape(-1)
    backend.allgather_async(Z, [c * r for c in split.counts], f"{name}.vectors").wait()
    return values.index_select(0, index).to(D.dtype), Z.reshape(split.n, r)


def lanczos_memory(n: int, steps: int, size: int, element_size: int) -> int:
    """Bytes of the largest worker's block of ``D``: ``ceil(n/P)·m`` values."""
    return math.ceil(n / size) * steps * element_size
