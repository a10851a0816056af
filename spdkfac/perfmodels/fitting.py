"""Least-squares fits of the measured times: the linear communication models and the inversion curve.

Weighted by relative error (small messages and small factors matter as much
as large ones: the fusion and placement decisions are made across the whole
range), with the fit quality reported alongside the coefficients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .models import InverseModel, PerfModelError

__all__ = ["fit_cubic", "fit_exponential", "fit_inverse_model", "fit_linear", "r_squared"]


def r_squared(y: npt.ArrayLike, y_hat: npt.ArrayLike) -> float:
    """Coefficient of determination of predictions ``y_hat`` for ``y``."""
    y_a = np.asarray(y, dtype=float)
    r = y_a - np.asarray(y_hat, dtype=float)
    ss_tot = float(((y_a - y_a.mean()) ** 2).sum())
    return 1.0 - float((r**2).sum()) / ss_tot if ss_tot > 0 else 1.0


def _relative_weights(y: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return 1.0 / np.maximum(y, 1e-12)


def fit_linear(x: npt.ArrayLike, y: npt.ArrayLike) -> tuple[float, float]:
    """Least-squares ``y = alpha + beta * x`` weighted by ``1/y`` (relative error).

    Relative weighting keeps the small messages (which decide alpha) from being
    swamped by the large ones. Non-positive coefficients are clamped to a tiny
    positive value, because a model must never predict free communication.
    """
    xa = np.asarray(x, dtype=float)
    ya = np.asarray(y, dtype=float)
    if xa.size < 2:
        raise PerfModelError("need at least two measurements to fit a line")
    w = _relative_weights(ya)
    design = np.stack([np.ones_like(xa), xa], axis=1) * w[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, ya * w, rcond=None)
    return max(float(alpha), 1e-9), max(float(beta), 1e-18)


def fit_exponential(d: npt.ArrayLike, t: npt.ArrayLike) -> tuple[float, float]:
    """Fit ``t = alpha * exp(beta * d)`` by least squares on ``log t``."""
    da = np.asarray(d, dtype=float)
    ta = np.asarray(t, dtype=float)
    if np.any(ta <= 0):
        raise PerfModelError("inversion times must be positive to fit an exponential")
    beta, log_alpha = np.polyfit(da, np.log(ta), 1)
    return float(np.exp(log_alpha)), max(float(beta), 1e-12)


def fit_cubic(d: npt.ArrayLike, t: npt.ArrayLike) -> list[float]:
    """Fit ``t = c0 + c1 d + c2 d^2 + c3 d^3`` weighted by ``1/t`` (relative error)."""
    da = np.asarray(d, dtype=float)
    ta = np.asarray(t, dtype=float)
    w = _relative_weights(ta)
    design = np.stack([da**k for k in range(4)], axis=1) * w[:, None]
    coeffs, *_ = np.linalg.lstsq(design, ta * w, rcond=None)
    return [float(c) for c in coeffs]


def _mean_relative_error(t: np.ndarray, pred: np.ndarray) -> float:
    return float(np.mean(np.abs(pred - t) / t))


def fit_inverse_model(d: npt.ArrayLike, t: npt.ArrayLike) -> tuple[InverseModel, dict[str, Any]]:
    """Fit both the exponential (Eq. 26) and a cubic; keep the one with lower mean relative error."""
    da = np.asarray(d, dtype=float)
    ta = np.asarray(t, dtype=float)
    a, b = fit_exponential(da, ta)
    exp_model = InverseModel("exp", {"alpha": a, "beta": b})
    quality: dict[str, Any] = {
        "exp": {
            "alpha": a,
            "beta": b,
            "mean_rel_error": _mean_relative_error(ta, np.array([exp_model(x) for x in da])),
            "r2": r_squared(ta, [exp_model(x) for x in da]),
        }
    }
    best = exp_model
    if da.size >= 4:
        coeffs = fit_cubic(da, ta)
        cubic = InverseModel("cubic", {"coeffs": coeffs, "floor": float(max(ta.min() * 0.5, 1e-9))})
        pred = np.array([cubic(x) for x in da])
        quality["cubic"] = {
            "coeffs": coeffs,
            "mean_rel_error": _mean_relative_error(ta, pred),
            "r2": r_squared(ta, pred),
        }
        if quality["cubic"]["mean_rel_error"] < quality["exp"]["mean_rel_error"]:
            best = cubic
    quality["chosen"] = best.kind
    return best, quality


def fit_batched(points: Sequence[tuple[int, int]], seconds: Sequence[float]) -> tuple[tuple[float, float, float, float, float], float]:
    """``((call, c0, c1, c2, c3), max relative error)`` of ``t(b, d) = call + b (c0 + c1 d + c2 d^2 + c3 d^3)``.

    Non-negative least squares on the relative errors (the points span orders
    of magnitude): every subset of the five terms is fitted and the best one
    with no negative coefficient kept. At depthwise sizes (``d`` = 9, 25) a
    block's time is far from cubic (LAPACK's per-matrix overhead and the
    O(d^2) copies dominate), so the lower powers are needed: with only
    ``c0 + c3 d^3`` the eigen fit was 90% off at ``d = 25``.
    """
    design = np.array([[1.0, b, b * float(d), b * float(d) ** 2, b * float(d) ** 3] for b, d in points], dtype=float)
    measured = np.asarray(seconds, dtype=float)
    weights = 1.0 / measured
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 32):
        columns = [i for i in range(5) if mask >> i & 1]
        if len(columns) > len(points):
            continue
        coeffs, *_ = np.linalg.lstsq(design[:, columns] * weights[:, None], np.ones_like(measured), rcond=None)
        if (coeffs < 0).any():
            continue
        full = np.zeros(5)
        full[columns] = coeffs
        residual = float(np.sum(((design @ full) * weights - 1.0) ** 2))
        if best is None or residual < best[0] * (1 - 1e-9):
            best = (residual, full)
    if best is None:  # pragma: no cover - the one-column fits are never negative for positive times
        raise PerfModelError("no non-negative fit of the batched decompositions")
    call, c0, c1, c2, c3 = (float(c) for c in best[1])
    worst = float(np.max(np.abs(design @ best[1] - measured) / measured))
    return (call, c0, c1, c2, c3), worst
