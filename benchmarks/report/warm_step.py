"""The warm eigenbasis steps per dimension against eigh, and QR against CholeskyQR2 (``warm_step.json``, benchmarks/warm_step.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table


@renders("warm_step.json", "Warm eigenbasis step per dimension: against eigh, and QR against CholeskyQR2", order=110, optional=True)
def warm_step(path: Path, d: dict[str, Any]) -> list[str]:
    """The warm eigenbasis step per dimension against eigh, and its Householder QR against CholeskyQR2."""
    need(d, path, "rows")
    lines = [
        "One warm refresh as shipped (`eigen_refresh='warm'`, the `'block'` step: the product `F Q`, the residual "
        "check, a subspace and a Rayleigh–Ritz step on the leading `dim/8` columns, the others made orthonormal to "
        "them) against a full `eigh`, per factor dimension of the model; the earlier default, one subspace step on "
        "every column (`'subspace'`: the product, the check, a `d x d` QR, the sign and order fix-up), and that step "
        "with the QR replaced by "
        "CholeskyQR2 (Gram matrix, Cholesky, triangular solve, twice: products instead of LAPACK's QR). One process, "
        "one thread, median thread CPU time, the variants timed in turn, on a well-conditioned float32 factor. Last "
        "columns: whether CholeskyQR2 survives `F Q` for the plain `X Xᵀ/d` (condition number ~d²) and for a "
        "rank-deficient factor (where the Gram matrix is singular in float32 its Cholesky fails, and it would need a "
        "fall-back).",
        "",
    ]
    rows = []
    for r in d["rows"]:
        need(r, path, "dim", "seconds", "warm_over_eigh", "subspace_over_eigh", "warm_cholqr2_over_subspace", "cholqr2_over_qr")
        s = r["seconds"]
        rows.append(
            [
                str(r["dim"]),
                f"{s['eigh'] * 1e3:.1f}",
                f"{s['warm'] * 1e3:.1f}",
                f"{r['warm_over_eigh']:.2f}x",
                f"{s['subspace'] * 1e3:.1f}",
                f"{r['subspace_over_eigh']:.2f}x",
                f"{s['warm_cholqr2'] * 1e3:.1f}",
                f"{r['warm_cholqr2_over_subspace']:.2f}x",
                f"{r['cholqr2_over_qr']:.2f}x",
                r.get("cholqr2_on_plain_factor", "-"),
                r.get("cholqr2_on_rank_deficient_factor", "-"),
            ]
        )
    lines += table(
        [
            "d",
            "eigh (ms)",
            "warm (ms)",
            "warm / eigh",
            "subspace (ms)",
            "subspace / eigh",
            "subspace, CholeskyQR2 (ms)",
            "CholeskyQR2 subspace / subspace",
            "CholeskyQR2 / QR",
            "CholeskyQR2 on X Xᵀ/d",
            "on a rank-deficient F",
        ],
        rows,
    )
    tot = d.get("model_totals")
    if tot:
        t = tot["seconds"]
        lines += [
            f"{tot['model']}, every dense factor once: `eigh` {t['eigh']:.2f} s, warm {t['warm']:.2f} s "
            f"({t['warm'] / t['eigh']:.2f}x), subspace {t['subspace']:.2f} s ({t['subspace'] / t['eigh']:.2f}x), subspace "
            f"with CholeskyQR2 {t['warm_cholqr2']:.2f} s ({t['warm_cholqr2'] / t['eigh']:.2f}x).",
            "",
        ]
    return lines + command_block(d, "benchmarks.warm_step", ".venv/bin/python -m benchmarks.warm_step")
