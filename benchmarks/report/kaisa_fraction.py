"""KAISA's grad_worker_fraction (benchmarks/kaisa_fraction.py): measured (``kaisa_fraction*.json``, one section per
worker count and method) and at scale by the simulator (``kaisa_fraction_simulated.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


def title(rel: Path) -> str:
    """``kaisa_fraction_<suffix>.json``'s title (one per worker count and method)."""
    suffix = rel.stem.removeprefix("kaisa_fraction").strip("_")
    return "KAISA's grad_worker_fraction: step time and K-FAC memory per worker" + (f" ({suffix})" if suffix else "")


@renders("kaisa_fraction*.json", title, order=150)
def kaisa_fraction(path: Path, d: dict[str, Any]) -> list[str]:
    """KAISA's grad_worker_fraction, measured: step time, decomposition stage and K-FAC memory per worker."""
    need(d, path, "measured", "modelled", "workers", "inv_update_freq")
    modelled = {r["fraction"]: r for r in d["modelled"]}
    freq = d["inv_update_freq"]
    timing = (
        "*Step*: a whole iteration, factors and decompositions updated every step (there is no separate stage)."
        if freq == 1
        else "*Step*: a step that keeps the decompositions (preconditioning and the broadcasts of its results); *stage*: one "
        "decomposition stage (decompositions and their broadcasts to each layer's gradient workers); *amortised*: step + "
        f"stage / {freq}."
    )
    rounds = len(d["measured"][0].get("rounds_amortised_s", [None])) if d["measured"] else 1
    order = (
        "one run, one fraction after another" if rounds == 1 else f"{rounds} rounds alternating the fractions, each row the median round"
    )
    lines = [
        f"{d.get('model', '?')} at {d.get('resolution', '?')}×{d.get('resolution', '?')}, batch {d.get('batch_size', '?')} per worker, "
        f"{d['workers']} workers ({d.get('engine', '?')}), `compute_method='{d.get('compute_method', '?')}'`, {order}. {timing} Memory: running factors and decompositions, fullest and emptiest worker. "
        f"*Modelled*: what the `'auto'` decision charged ({'sub-group broadcasts' if d.get('native_subgroups') else 'broadcasts to all'}).",
        "",
    ]
    rows = []
    for r in d["measured"]:
        m = modelled.get(r["fraction"])
        rows.append(
            [
                f"{r['fraction']} ({r['grad_workers']} per layer)" if r["fraction"] == "auto" else r["fraction"],
                ms(r["step_s"]),
                ms(r["decomposition_stage_s"]),
                ms(r["amortised_s"]),
                f"{r['kfac_mib_max']:.0f}",
                f"{r['kfac_mib_min']:.0f}",
                ms(m["seconds"]) if m else ms(r.get("auto_predicted_s")),
            ]
        )
    lines += table(["fraction", "step (ms)", "stage (ms)", "amortised (ms)", "MiB max", "MiB min", "modelled (ms)"], rows)
    return lines + command_block(d, "benchmarks.kaisa_fraction", "torchrun --nproc_per_node 4 -m benchmarks.kaisa_fraction measure")


@renders(
    "kaisa_fraction_simulated.json",
    "KAISA's grad_worker_fraction at scale (simulator)",
    order=151,
    plot="kaisa_fraction_simulated.png",
    optional=True,
)
def kaisa_fraction_simulated(path: Path, d: dict[str, Any]) -> list[str]:
    """KAISA's grad_worker_fraction at scale, predicted by the simulator."""
    need(d, path, "predicted", "update_freq")
    f, i = d["update_freq"]
    lines = [
        f"Predicted from `{d.get('profile', '?')}` (`compute_method='{d.get('compute_method', '?')}'`, factors every {f}, "
        f"decompositions every {i} iterations): iteration time and K-FAC memory per worker. `gpu-cluster` is an "
        "assumed 100 Gb/s InfiniBand cluster for communication and decompositions (constants in the JSON), the step's "
        "linear algebra (preconditioning, packing, the update) scaled to the same arithmetic rate, and the passes (forward, "
        "backward, the factors) to "
        + (
            f"{d['gpu_sgd_passes_s'] * 1e3:.0f} ms of plain-SGD passes per worker (ResNet-50 at 224×224, batch 32, on a V100). "
            if "gpu_sgd_passes_s" in d
            else "the reference machine's. "
        )
        + f"Memory is the fullest worker's and the mean. KAISA reports: {d.get('kaisa_reported', '')}.",
        "",
    ]
    for key, rows in d["predicted"].items():
        chose = next((r.get("chose") for r in rows if r["fraction"] == "auto"), None)
        fractions = [r for r in rows if r["fraction"] != "auto"]
        fewest, most = fractions[0]["iteration_s"], fractions[-1]["iteration_s"]
        change = (most / fewest - 1) * 100 if fewest else 0.0
        trend = f"; from 1 to {len(fractions) and fractions[-1]['fraction'].split('/')[0]} gradient workers the iteration is {abs(change):.1f}% {'shorter' if change < 0 else 'longer'}"
        lines += [f"**{key.replace('/', ', ')} workers** ('auto' chose {chose}{trend})", ""]
        lines += table(
            ["fraction", "iteration (ms)", "MiB max", "MiB mean"],
            [
                [r["fraction"], ms(r["iteration_s"]), f"{r['kfac_mib_max']:.0f}", f"{r.get('kfac_mib_mean', float('nan')):.0f}"]
                for r in rows
            ],
        )
    return lines + command_block(d, "benchmarks.kaisa_fraction", ".venv/bin/python -m benchmarks.kaisa_fraction simulate")
