"""torch.compile with K-FAC: step times compiled vs eager, graph breaks, graphs (``compile_cost.json``, benchmarks/compile_cost.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, labelled_rows, machine_line, ms, recorded_args, renders, table

ARMS = {
    "sgd-eager": "SGD, eager",
    "sgd-compiled": "SGD, compiled",
    "kfac-eager": "K-FAC, eager",
    "kfac-compiled": "K-FAC, compiled",
    "kfac-compiled-plain-hooks": "K-FAC, compiled, hooks as before (alone)",
}


@renders("compile_cost.json", "torch.compile: step time compiled vs eager, graph breaks and recompilations", order=95, optional=True)
def compile_cost(path: Path, d: dict[str, Any]) -> list[str]:
    """Per model: each arm's step (median: no factor update; mean: amortised), first steps, graph breaks, graphs."""
    a = recorded_args(d, path, "models")
    lines = [
        f"One process, batch {a['batch_size']}, K-FAC factors and inverses every {a['freq']} steps, "
        f"{a['iters']} interleaved rounds after {3} compiling steps; a step is zero_grad, forward, backward "
        "and the optimizer's step. Median: a step without a factor update; mean: the amortised step. "
        f"{machine_line(d)}",
        "",
    ]
    for name, m in d["models"].items():
        lines += [
            f"**{name}** (compiled/eager: SGD {m['sgd_compiled_over_eager_median']:.2f}x median, "
            f"{m['sgd_compiled_over_eager_mean']:.2f}x mean; K-FAC {m['kfac_compiled_over_eager_median']:.2f}x median, "
            f"{m['kfac_compiled_over_eager_mean']:.2f}x mean; graphs compiled during the interleaved rounds: "
            f"{m['graphs_compiled_while_measuring']})",
            "",
        ]
        lines += table(["arm", "median step", "mean step", "first 3 steps", "graph breaks", "graphs"], labelled_rows(ARMS, m, _arm_cells))
        lines.append("")
    return lines + command_block(
        d, "benchmarks.compile_cost", ".venv/bin/python -m benchmarks.compile_cost --models mnist_cnn cifar_resnet20"
    )


def _arm_cells(arm: str, r: dict[str, Any]) -> list[str]:
    """One arm's step times, first steps, graph breaks and graphs."""
    during = r.get("graphs_compiled_while_measuring", "")
    return [
        f"{ms(r['stats']['median'])} ms", f"{ms(r['stats']['mean'])} ms", f"{sum(r['warmup_seconds']):.1f} s",
        str(r["graph_breaks"]), str(r["graphs"]) + (f" (+{during} while timed)" if during != "" else ""),
    ]  # fmt: skip
