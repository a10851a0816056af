"""Measured points against fitted curves (the paper's Figs. 7, 8 and 11) as one PNG."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .models import InverseModel, PerfModel

__all__ = ["plot_perf_model"]


def plot_perf_model(model: PerfModel, out: str | Path) -> Path:
    """Draw all-reduce, broadcast and inversion measurements with their fits; return the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    meas = model.measurements
    title = f"{model.meta.get('engine', '?')} x{model.meta.get('world_size', '?')} on {model.meta.get('device', '?')}"

    ax = axes[0]
    ar = meas.get("allreduce") or {}
    if ar:
        m = np.array(ar["elements"], dtype=float)
        ax.loglog(m, np.array(ar["seconds"]) * 1e3, "o", label="measured")
        grid = np.logspace(np.log10(m.min()), np.log10(m.max()), 100)
        ax.loglog(
            grid, [model.allreduce(x) * 1e3 for x in grid], "-", label=f"α={model.allreduce.alpha:.2e}s, β={model.allreduce.beta:.2e}s/elem"
        )
    ax.set(title="all-reduce (Eq. 14)", xlabel="elements m", ylabel="time (ms)")
    ax.legend(fontsize=8)

    inv = meas.get("inverse") or {}
    dims = np.array(inv.get("dims", [64, 8192]), dtype=float)
    grid_d = np.linspace(dims.min(), dims.max(), 200)
    ax = axes[1]
    bc = meas.get("broadcast") or {}
    if bc:
        ax.plot(bc["dims"], np.array(bc["seconds"]) * 1e3, "o", label="measured")
        ax.plot(
            grid_d,
            [model.broadcast.fitted(d) * 1e3 for d in grid_d],
            "-",
            label=f"α={model.broadcast.alpha:.2e}s, β={model.broadcast.beta:.2e}s/elem",
        )
    ax.set(title="broadcast of d(d+1)/2 elements (Eq. 27)", xlabel="dimension d", ylabel="time (ms)")
    ax.legend(fontsize=8)

    ax = axes[2]
    if inv:
        ax.semilogy(inv["dims"], np.array(inv["seconds"]) * 1e3, "o", label="measured inversion")
        q = model.fit_quality.get("inverse", {})
        if "exp" in q:
            exp = InverseModel("exp", {"alpha": q["exp"]["alpha"], "beta": q["exp"]["beta"]})
            ax.semilogy(
                grid_d, [exp(d) * 1e3 for d in grid_d], "--", label=f"exp fit (Eq. 26), mean rel err {q['exp']['mean_rel_error']:.0%}"
            )
        if "cubic" in q:
            cub = InverseModel("cubic", {"coeffs": q["cubic"]["coeffs"], "floor": float(min(inv["seconds"]) * 0.5)})
            ax.semilogy(grid_d, [cub(d) * 1e3 for d in grid_d], ":", label=f"cubic fit, mean rel err {q['cubic']['mean_rel_error']:.0%}")
        eig = meas.get("eigen")
        if eig and model.eigen is not None:
            ax.semilogy(eig["dims"], np.array(eig["seconds"]) * 1e3, "s", label="measured eigendecomposition")
            ax.semilogy(grid_d, [model.eigen.fitted(d) * 1e3 for d in grid_d], "-.", label=f"eigen fit ({model.eigen.kind})")
        if bc:
            ax.semilogy(grid_d, [model.broadcast.fitted(d) * 1e3 for d in grid_d], "-", alpha=0.6, label="broadcast model (Fig. 11)")
        ax.set_title(f"inversion (chosen: {model.inverse.kind})")
    ax.set(xlabel="dimension d", ylabel="time (ms)")
    ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
