"""DHO2's time per iteration and curvature memory per worker: one section, a row per worker count
(``dho2_cost/w<P>.json``, benchmarks/dho2_cost.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from benchmarks.report.common import Section, Writer, command_block, load, ms, need, register, table


@dataclass(frozen=True)
class Dho2Cost(Section):
    """One section for all the files the pattern matches, one row each; nothing when there is none (optional)."""

    title: str

    def write(self, w: Writer) -> None:
        costs = sorted(w.results.glob(self.pattern))
        if costs:
            w.lines += [f"## {self.title}", "", *dho2_cost(w, costs)]


register(Dho2Cost(order=170, pattern="dho2_cost/w*.json", title="DHO2: time per iteration and curvature memory per worker"))


def dho2_cost(w: Writer, paths: Sequence[Path]) -> list[str]:
    """DHO2's iteration time split and curvature memory per worker, one row per worker count (``dho2_cost/w<P>.json``)."""
    rows, commands = [], []
    for path in paths:
        d = load(path)
        need(d, path, "world_size", "grad_s", "refresh_s", "update_s", "per_iteration_s", "memory", "params", "lanczos_steps")
        every = (d.get("args") or {}).get("refresh_every", "?")
        mem = d["memory"]
        rows.append(
            [
                f"{d['world_size']} ({d.get('engine', '?')})",
                f"{d.get('model', '?')} (n={d['params']}, m={d['lanczos_steps']})",
                ms(d["grad_s"]),
                f"{ms(d['refresh_s'])} (every {every})",
                f"{d['update_s'] * 1e3:.1f}",
                ms(d["per_iteration_s"]),
                f"{mem.get('lanczos_basis', 0) / 2**20:.2f}",
                f"{mem.get('eigenvectors', 0) / 2**20:.2f}",
            ]
        )
        commands += command_block(d, "benchmarks.dho2_cost", "python -m benchmarks.dho2_cost", out=w.shown("dho2_cost"))
    head = [
        "workers",
        "model",
        "gradient (ms)",
        "refresh: HVPs + Lanczos (ms)",
        "update (ms)",
        "per iteration, amortised (ms)",
        "Lanczos basis per worker (MiB)",
        "eigenvectors (MiB)",
    ]
    lines = table(head, rows)
    predicted = [load(p) for p in paths]
    predicted = [d for d in predicted if d.get("predicted_memory")]
    if predicted:
        d = max(predicted, key=lambda d: d["world_size"])
        lines += [
            f"Curvature memory per worker at more workers, analytic ({d.get('model', '?')}, n={d['params']}, "
            f"m={d['lanczos_steps']}): only the Lanczos basis is split, ceil(n/P)·m float32 values per worker; "
            "the eigenvectors, ADMM variables and base-optimizer state are replicated (as measured). At the "
            "measured worker counts the formula equals the allocation.",
            "",
        ]
        lines += table(
            ["workers", "Lanczos basis (MiB)", "replicated (MiB)", "total per worker (MiB)"],
            [
                [str(r["workers"]), f"{r['lanczos_basis'] / 2**20:.3f}", f"{r['replicated'] / 2**20:.2f}", f"{r['total'] / 2**20:.2f}"]
                for r in d["predicted_memory"]
            ],
        )
    return lines + commands
