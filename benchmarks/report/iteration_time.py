"""Iteration time per variant (benchmarks/iteration_time.py): Table III (``iteration_time.json``), other models
(``iteration_time_<model>.json``) and the eigen method beside the inverse method (``iteration_time_eigenbasis.json``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.report.common import LABELS, command_block, ms, need, ratio, renders, table

#: The parts of the breakdown, as iteration_time records them.
PARTS = ("FF&BP", "GradComm", "FactorComp", "FactorComm", "InverseComp", "InverseComm", "Other")


@renders("iteration_time.json", "Iteration time and breakdown per variant (Table III)", order=30, plot="iteration_time.png")
@renders(  # other models (e.g. grouped/depthwise networks)
    "iteration_time_*.json",
    lambda rel: f"Iteration time and memory per variant: {rel.stem.removeprefix('iteration_time_')}",
    order=31,
    plot=lambda rel: rel.with_suffix(".png").as_posix(),
)
def iteration_time(path: Path, d: dict[str, Any]) -> list[str]:
    """Table III: iteration time, its breakdown, speed-ups and memory per variant."""
    need(d, path, "table")
    a = d.get("args", {})
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch "
        f"{a.get('batch_size', '?')} per worker, factors/inverses every {'/'.join(map(str, a.get('update_freq', ['?'])))} "
        f"iteration(s); {a.get('warmup', '?')} warm-up and {a.get('iters', '?')} measured iterations per variant"
        f"{', interleaved' if a.get('interleave') else ''}. Milliseconds per iteration; SP1 = D-KFAC's time over "
        "the row's, SP2 = MPD-KFAC's (95% bootstrap interval when recorded).",
        "",
    ]
    rows = []
    for r in d["table"]:
        need(r, path, "variant", "mean_s")
        rows.append(
            [
                LABELS.get(r["variant"], r["variant"]),
                f"{ms(r['mean_s'])} ± {ms(r.get('stdev_s'))}",
                *[ms(r.get(p)) for p in PARTS],
                *(
                    ("", "")
                    if r["variant"] == "sgd"
                    # SGD's speed-up over K-FAC says nothing
                    else (ratio(r.get("SP1"), r.get("SP1_lo"), r.get("SP1_hi")), ratio(r.get("SP2"), r.get("SP2_lo"), r.get("SP2_hi")))
                ),
                ratio(r.get("vs_sgd"), r.get("vs_sgd_lo"), r.get("vs_sgd_hi")),
                f"{r['rss_mb']:.0f} MB" if r.get("rss_mb") and math.isfinite(r["rss_mb"]) else "",  # NaN: interleaved
                f"{r['kfac_state_mb']:.1f} MB" if r.get("kfac_state_mb") is not None else "",
            ]
        )
    lines += table(["variant", "iteration", *PARTS, "SP1", "SP2", "vs SGD", "RSS", "K-FAC state"], rows)
    split = [r for r in d["table"] if "factor_steps_s" in r or "other_steps_s" in r]
    if split:
        lines += table(
            ["variant", "factor-update iterations", "other iterations"],
            [
                [
                    LABELS.get(r["variant"], r["variant"]),
                    f"{r['factor_steps_s']:.2f} s (n={r.get('factor_steps_n', '?')})" if "factor_steps_s" in r else "",
                    f"{r['other_steps_s']:.2f} s (n={r.get('other_steps_n', '?')})" if "other_steps_s" in r else "",
                ]
                for r in split
            ],
        )
    lines += command_block(
        d, "benchmarks.iteration_time", "horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python -m benchmarks.iteration_time"
    )
    return lines


@renders(
    "iteration_time_eigenbasis.json",
    "Eigen method: exact and warm-started eigenbasis refresh beside the inverse method",
    order=50,
    optional=True,
)
def eigenbasis_iteration(path: Path, d: dict[str, Any]) -> list[str]:
    """The eigen method, exact and warm-started, beside the inverse method: time per iteration and its ratios."""
    need(d, path, "table")
    a = d.get("args", {})
    by_variant = {r["variant"]: r for r in d["table"] if "variant" in r and "mean_s" in r}
    exact = next((r for v, r in by_variant.items() if "compute_method=eigen" in v and "eigen_refresh=warm" not in v), None)
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')} per "
        f"worker, SGD learning rate {a.get('lr', 1e-4):g}, factors and decompositions every iteration; {a.get('warmup', '?')} warm-up and {a.get('iters', '?')} measured "
        f"iterations per variant{', interleaved' if a.get('interleave') else ''}. `eigen_refresh='warm'` makes a full `eigh` "
        "every `eigen_full_every` refreshes (10 unless the variant says), so a measured window that long holds one. "
        "Exact eigen / row: the speed-up over the exact "
        "eigen method measured in the same run.",
        "",
    ]
    rows = []
    for variant, r in by_variant.items():
        rows.append(
            [
                f"`{variant}`",
                f"{ms(r['mean_s'])} ± {ms(r.get('stdev_s'))}",
                ms(r.get("InverseComp")),
                ms(r.get("InverseComm")),
                ratio(exact["mean_s"] / r["mean_s"]) if exact is not None else "",
            ]
        )
    lines += table(["variant", "iteration", "InverseComp", "InverseComm", "exact eigen / row"], rows)
    lines += command_block(
        d,
        "benchmarks.iteration_time",
        "torchrun --nproc_per_node 2 -m benchmarks.iteration_time --variants spdkfac spdkfac:compute_method=eigen ...",
    )
    return lines
