"""The warm eigenbasis step per dimension: against ``eigh``, and its QR against an orthonormalisation from products.

    python -m benchmarks.warm_step --model resnet50

``eigen_refresh='warm'`` refreshes a basis from the previous one
(:meth:`spdkfac.kfac.methods.warm.WarmRefresh.refine`). For every
distinct factor dimension of ``--model`` this times, alternately in one
process on one thread (median *thread CPU time*, so other jobs on the cores
inflate it less):

* ``eigh``: the full refresh (``torch.linalg.eigh``, descending);
* ``warm``: the warm step as shipped (``'block'``: the product, the residual
  check, a subspace and a Rayleigh–Ritz step on the leading ``dim/8``
  columns, the others made orthonormal to them);
* ``subspace``: the earlier default, one subspace step on every column (the
  product, the residual check, Householder QR, the sign and order fix-up);
* ``warm_cholqr2``: the subspace step with the QR replaced by CholeskyQR2 (Gram
  matrix ``YᵀY``, Cholesky, triangular solve, twice; in exact arithmetic the
  same ``Q`` and ``diag(R)`` as Householder QR with a positive ``diag(R)``),
  the candidate that trades LAPACK's QR for matrix products;
* ``qr`` and ``cholqr2``: the two orthonormalisations alone.

The timed factor is ``X Xᵀ/d + mean eigenvalue · I`` (float32, well
conditioned, so that CholeskyQR2 runs to its end: a failing Cholesky stops
early), the previous basis that of ``0.95 F + 0.05 diag(F)`` (a nearby
factor). It also records, per dimension, how far CholeskyQR2's ``Q`` and
``diag(R)`` are from Householder's there, and whether CholeskyQR2 survives
``F Q`` for the plain ``X Xᵀ/d`` (condition number ~d²) and for a
rank-deficient factor (a running average of ``d/8``-row batches from zero, as
a wide convolution's ``A`` at a small resolution is): where the Gram matrix
``(F Q)ᵀ F Q`` is singular in float32 the Cholesky fails, and the candidate
would need a fall-back (Householder QR or a full ``eigh``).

Totals over the model weigh each dimension by how many factors have it.
Writes ``warm_step.json`` to ``--out``; RESULTS.md renders it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from spdkfac.kfac.layers import kfac_layers
from spdkfac.kfac.methods.warm import WarmRefresh, descending_eigh, drift
from spdkfac.models import get_model

from .common import RESULTS, machine, save_json

VARIANTS = ("eigh", "warm", "subspace", "warm_cholqr2", "qr", "cholqr2")


def cholqr2(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(Q, diag(R))`` of ``y`` by CholeskyQR2; None when a Cholesky fails (a numerically singular Gram matrix)."""
    q, diag = y, None
    for _ in range(2):
        lower, info = torch.linalg.cholesky_ex(q.mT @ q)
        if bool((info != 0).any()):
            return None
        q = torch.linalg.solve_triangular(lower.mT, q, upper=True, left=False)
        ld = lower.diagonal(dim1=-2, dim2=-1)
        diag = ld if diag is None else diag * ld
    assert diag is not None
    return q, diag


def warm_cholqr2(factor: torch.Tensor, q: torch.Tensor, tolerance: float = float("inf")) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The ``'subspace'`` step with CholeskyQR2 in place of Householder QR (``diag(R) > 0``: no sign fix-up)."""
    y = factor @ q
    if drift(q, y) > tolerance:
        return None
    out = cholqr2(y)
    if out is None:
        return None
    q, d = out
    order = torch.argsort(d, dim=-1, descending=True, stable=True)
    return d.gather(-1, order), q.gather(-1, order.unsqueeze(-2).expand_as(q))


def dims_of(model_name: str) -> Counter[int]:
    """How many dense factors of each dimension the model has (A and G of every layer; block-diagonal ones left out)."""
    counts: Counter[int] = Counter()
    for layer in kfac_layers(get_model(model_name)):
        for shape in (layer.helper.a_shape, layer.helper.g_shape):
            if shape.blocks == 1 and not shape.diagonal:
                counts[shape.dim] += 1
    return counts


def _cpu_medians(calls: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, float]:
    """Median thread CPU seconds of each call, the calls timed in turn within every repetition."""
    for _ in range(warmup):
        for fn in calls.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            t0 = time.thread_time()
            fn()
            times[name].append(time.thread_time() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _rank_deficient(dim: int, gen: torch.Generator, steps: int = 20) -> torch.Tensor:
    """A running average ``F <- 0.95 F + 0.05 XᵀX/r`` from zero of ``r = dim/8``-row batches: rank ``< dim`` for a while."""
    rows = max(1, dim // 8)
    factor = torch.zeros(dim, dim, dtype=torch.float64)
    for _ in range(min(steps, 7)):
        x = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
        factor = 0.95 * factor + 0.05 * x.T @ x / rows
    return factor.float()


def measure(dim: int, repeats: int, warmup: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(dim, dim, generator=gen, dtype=torch.float64)
    plain = x @ x.T / dim  # condition number ~dim^2: float32 CholeskyQR2 fails on it from d ~ 1000
    # Timed on a well-conditioned factor (the plain one shifted by its mean eigenvalue): the costs do not depend on
    # the values, except that a failing Cholesky stops early, which would flatter the candidate.
    factor = (plain + plain.diagonal().mean() * torch.eye(dim, dtype=torch.float64)).float()
    basis = descending_eigh(0.95 * factor + 0.05 * torch.diag(factor.diagonal()))[1]
    warm = WarmRefresh(tolerance=float("inf"))  # always the warm step, never the fall-back eigh
    subspace = WarmRefresh(tolerance=float("inf"), kind="subspace")
    y = factor @ basis
    calls: dict[str, Callable[[], object]] = {
        "eigh": lambda: descending_eigh(factor),
        "warm": lambda: warm.refine(factor, basis),
        "subspace": lambda: subspace.refine(factor, basis),
        "warm_cholqr2": lambda: warm_cholqr2(factor, basis),
        "qr": lambda: torch.linalg.qr(y),
        "cholqr2": lambda: cholqr2(y),
    }
    seconds = _cpu_medians(calls, repeats, warmup)
    q_h, r_h = torch.linalg.qr(y)
    sign = torch.where(r_h.diagonal() < 0, -1.0, 1.0)
    out = cholqr2(y)
    assert out is not None  # a well-conditioned product
    q_c, d_c = out
    plain32 = plain.float()
    plain_basis = descending_eigh(0.95 * plain32 + 0.05 * torch.diag(plain32.diagonal()))[1]
    return {
        "dim": dim,
        "seconds": seconds,
        "warm_over_eigh": seconds["warm"] / seconds["eigh"],
        "subspace_over_eigh": seconds["subspace"] / seconds["eigh"],
        "warm_cholqr2_over_subspace": seconds["warm_cholqr2"] / seconds["subspace"],
        "cholqr2_over_qr": seconds["cholqr2"] / seconds["qr"],
        "cholqr2_vs_householder": {
            "max_abs_q_difference": float((q_c - q_h * sign).abs().max()),
            "max_rel_diag_r_difference": float(((d_c - r_h.diagonal().abs()) / r_h.diagonal().abs()).abs().max()),
            "orthogonality_error": float((q_c.mT @ q_c - torch.eye(dim)).abs().max()),
        },
        "cholqr2_on_plain_factor": "ok" if cholqr2(plain32 @ plain_basis) is not None else "cholesky failed",
        "cholqr2_on_rank_deficient_factor": "ok" if cholqr2(_rank_deficient(dim, gen) @ basis) is not None else "cholesky failed",
    }


def totals(rows: list[dict[str, Any]], counts: Counter[int]) -> dict[str, float]:
    """Seconds of every dense factor once, per variant (as a step that refreshes all)."""
    by_dim = {row["dim"]: row["seconds"] for row in rows}
    return {v: sum(n * by_dim[d][v] for d, n in counts.items()) for v in VARIANTS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet50")
    ap.add_argument("--dims", type=int, nargs="*", help="only these dimensions (default: every dense factor's of --model)")
    ap.add_argument("--repeats", type=int, default=3, help="per dimension (1 above 4096: those take seconds each)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "warm_step.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = dims_of(args.model)
    dims = sorted(set(args.dims) if args.dims else counts)
    rows = []
    for dim in dims:
        big = dim > 4096
        row = measure(dim, repeats=1 if big else args.repeats, warmup=0 if big else 1)
        rows.append(row)
        s = row["seconds"]
        print(
            f"d={dim:5d}  eigh {s['eigh']:.4f}s  warm {s['warm']:.4f}s ({row['warm_over_eigh']:.2f}x eigh)  "
            f"subspace {s['subspace']:.4f}s ({row['subspace_over_eigh']:.2f}x eigh)  "
            f"subspace with CholeskyQR2 {s['warm_cholqr2']:.4f}s ({row['warm_cholqr2_over_subspace']:.2f}x subspace)  "
            f"QR {s['qr']:.4f}s  CholeskyQR2 {s['cholqr2']:.4f}s ({row['cholqr2_over_qr']:.2f}x QR)  "
            f"CholeskyQR2 on X Xᵀ/d: {row['cholqr2_on_plain_factor']}, rank-deficient: {row['cholqr2_on_rank_deficient_factor']}",
            flush=True,
        )
    data: dict[str, Any] = {"args": vars(args), "machine": machine(), "rows": rows}
    if not args.dims:
        total = totals(rows, counts)
        data["model_totals"] = {"model": args.model, "factors": dict(sorted(counts.items())), "seconds": total}
        print(f"{args.model}, every dense factor once: " + ", ".join(f"{v} {t:.2f}s" for v, t in total.items()))
    path = save_json(data, Path(args.out).name, Path(args.out).parent)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
