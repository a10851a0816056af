"""The optimizer swapped into a user's DDP script (``drop_in_<model>.json``, benchmarks/drop_in.py): per step kind,
every step and amortised, against SGD on the DDP model, and K-FAC's memory per worker."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, need, renders, table

KINDS = ("decomposition", "factor", "plain")


def spread(r: dict[str, Any], key: str) -> str:
    """``1.23x (cycles 1.20–1.31)``: the pooled ratio to SGD and the min–max of the per-cycle ratios."""
    value = r.get(f"vs_sgd_{key}")
    if value is None:
        return ""
    cycles = r.get(f"vs_sgd_{key}_cycles")
    return f"{value:.2f}x" + (f" ({cycles['min']:.2f}–{cycles['max']:.2f})" if cycles else "")


def megabytes(r: dict[str, Any], key: str) -> str:
    """``812`` or ``590–612`` (emptiest–fullest worker), MiB."""
    m = r.get("memory", {}).get(key)
    if not m:
        return ""
    return f"{m['max']:.0f}" if round(m["min"]) == round(m["max"]) else f"{m['min']:.0f}–{m['max']:.0f}"


def title(rel: Path) -> str:
    """``drop_in_<model>.json``'s title."""
    model = rel.stem.removeprefix("drop_in").strip("_")
    script = "an FSDP" if model.endswith("fsdp") else "a DDP"
    return f"The optimizer in {script} script: step kinds, every step and amortised, against SGD" + (f": {model}" if model else "")


@renders("drop_in*.json", title, order=61, optional=True)
def drop_in(path: Path, d: dict[str, Any]) -> list[str]:
    """Per system: seconds per step kind, the every-step and amortised ratios to SGD on the DDP model, K-FAC memory."""
    need(d, path, "table", "args", "specs")
    a = d["args"]
    f_s, i_s = a.get("schedule", ["?", "?"])
    f_t, i_t = a.get("target", ["?", "?"])
    kaisa = d.get("kaisa") or {}
    lines = [
        f"{a.get('model', '?')} at {a.get('resolution', '?')}×{a.get('resolution', '?')}, batch {a.get('batch_size', '?')} per worker, {d.get('world_size', '?')} workers ({d.get('engine', '?')}), "
        f"SGD learning rate {a.get('lr')} (momentum 0.9); K-FAC: `compute_method='{a.get('compute_method')}'`, damping "
        f"{a.get('damping')}, factor decay {a.get('factor_decay')}, KL-clip {a.get('kl_clip')} for every system"
        + (f", KAISA `kfac` {kaisa.get('version')}" if kaisa else "")
        + f". One run: every system held at once, step by step interleaved (the order rotating every step), each step "
        f"behind an untimed barrier and timed on its slowest rank; factors every {f_s} and decompositions every {i_s} "
        f"steps, {a.get('warmup', '?')} warm-up cycle(s) of {i_s} steps left out, {a.get('iters', '?')} measured. "
        "Seconds per step kind (mean): *decomposition* (factors and decompositions updated), *factor* (factors only), "
        "*plain*. **Every step** = the decomposition step (what every step of that setting does); **amortised** = "
        f"D/{i_t} + F·(1/{f_t} − 1/{i_t}) + P·(1 − 1/{f_t}), the mean step with factors every {f_t} and decompositions "
        f"every {i_t} steps, computed from the per-kind means (not timed over a {i_t}-step window). Ratios: the row's "
        "time over its script's SGD mean in the same run (`sgd-ddp`'s; `sgd-fsdp`'s for `spdkfac-fsdp`); in brackets "
        "the min–max of the ratio computed per measured cycle (the spread over repeats on a machine shared with other "
        "jobs). Memory per worker (emptiest–fullest worker), MiB: the parameters it holds (its rows of them under "
        "FSDP), and K-FAC's running factors and decompositions (`memory_usage()`).",
        "",
    ]
    rows = []
    for r in d["table"]:
        need(r, path, "system", "mean")
        kinds = r.get("kinds", {})
        cells = [f"{kinds[k]['mean']:.2f} ± {kinds[k]['stdev']:.2f}" if k in kinds else "" for k in KINDS]
        if not kinds:  # SGD: one kind of step
            cells = ["", "", f"{r['mean']:.2f} ± {r['stdev']:.2f}"]
        rows.append(
            [
                f"`{r['system']}`",
                *cells,
                spread(r, "every_step"),
                spread(r, "amortised"),
                megabytes(r, "parameters_mb"),
                megabytes(r, "factors_mb"),
                megabytes(r, "decompositions_mb"),
            ]
        )
    lines += table(
        [
            "system",
            "decomposition step (s)",
            "factor step (s)",
            "plain step (s)",
            "every step / SGD",
            "amortised / SGD",
            "parameters (MiB)",
            "factors (MiB)",
            "decompositions (MiB)",
        ],
        rows,
    )
    for r in d["table"]:
        if "vs_sgd_ddp" in r:
            lines += [f"`{r['system']}` / `sgd-ddp`: {r['vs_sgd_ddp']:.2f}x (mean step).", ""]
    lines += ["Systems: " + "; ".join(f"`{k}` = {v}" for k, v in d["specs"].items()) + ".", ""]
    out = None if path.name == "drop_in.json" else f"benchmarks/results/{path.name}"
    return lines + command_block(d, "benchmarks.drop_in", "torchrun --nproc_per_node 2 -m benchmarks.drop_in", out)
