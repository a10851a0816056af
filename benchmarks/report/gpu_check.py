"""One GPU check per card (``gpu_check*.json``, benchmarks/gpu_check.py): the gpu tests, iteration times, decompositions, predictions."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import ms, need, ratio, renders, table


def title(rel: Path) -> str:
    """``gpu_check_<card>.json``'s title."""
    card = rel.stem.removeprefix("gpu_check_")
    if card.endswith("_vit"):  # --stages timing --other-models-only
        return f"On a GPU: ViT-S/16's iteration time against SGD and AdamW ({card.removesuffix('_vit')})"
    if card.endswith("_vit_compiled"):  # --stages compiled --model vit_s16
        return f"On a GPU: ViT-S/16 under torch.compile against SGD ({card.removesuffix('_vit_compiled')})"
    return "On a GPU: the gpu tests, iteration time against SGD and AdamW, decompositions" + (
        f" ({card})" if rel.stem != "gpu_check" else ""
    )


@renders("gpu_check*.json", title, order=20)
def gpu_check(path: Path, d: dict[str, Any]) -> list[str]:
    """One GPU check (benchmarks/gpu_check.py): the card, the gpu tests, iteration times against SGD, phases, decompositions."""
    need(d, path, "environment", "stages")
    env, stages = d["environment"], d["stages"]
    lines = [
        f"{env.get('card', '?')} ({env.get('memory_gib', '?')} GiB), torch {env.get('torch')}, CUDA {env.get('cuda')}, "
        f"cupy {env.get('cupy') or 'absent'}, Python {env.get('python')}; {env.get('date')}"
        + (" — `--quick`: proves the script, measures nothing" if d.get("quick") else "")
        + f". Command: `bash scripts/gpu_check.sh{''.join(' ' + a for a in d.get('argv', []) if not a.startswith('$'))}` (benchmarks/gpu_check.py).",
        "",
    ]
    if d.get("note"):
        lines += [str(d["note"]), ""]
    for stage, value in stages.items():
        if "error" in value:
            lines += [f"- stage `{stage}` stopped: `{str(value['error']).splitlines()[0][:300]}`", ""]
    tests = stages.get("tests")
    if tests and "counts" in tests:
        c = tests["counts"]
        lines += [f"**gpu tests** (tests/test_gpu.py on the card): {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped.", ""]
        bad = [t for t in tests["tests"] if t["outcome"] != "passed"]
        if bad:
            lines += table(["test", "outcome", "message"], [[t["name"], t["outcome"], t["message"].replace("|", "/")[:160]] for t in bad])
    timing = stages.get("timing") or {}
    st = timing.get("setting", {})
    for batch, rows in timing.get("batches", {}).items():
        lines += _iteration_times(st["model"], st["resolution"], batch, rows)
    for model, entry in timing.get("models", {}).items():
        for batch, rows in entry["batches"].items():
            lines += _iteration_times(model, entry["resolution"], batch, rows)
    comp = stages.get("compiled")
    if comp and "rows" in comp:
        breaks = ", ".join(f"{k}: {v}" for k, v in comp["graph_breaks"].items()) or "none"
        lines += [
            f"**Under torch.compile** ({comp['backend']}): {comp['unique_graphs']} graphs compiled, graph breaks: {breaks}.",
            "",
        ]
        lines += _iteration_times(comp["model"], comp["resolution"], str(comp["batch"]), comp["rows"])
    dec = stages.get("decompositions")
    if dec and "stage_s" in dec:
        names = sorted(dec["stage_s"])
        lines += [
            f"**One decomposition stage** of the model ({dec['factors']} factors, {dec['dims_measured']} of {dec['dims']} distinct "
            "dimensions measured, median of repeats), by backend:",
            "",
        ]
        lines += table(["backend", "ms per stage"], [[n, ms(dec["stage_s"][n])] for n in names])
        largest = sorted(dec["per_dim_s"], key=int, reverse=True)[:4]
        lines += table(["dimension", *names], [[dim, *(f"{dec['per_dim_s'][dim][n] * 1e3:.1f}" for n in names)] for dim in largest])
    pm = stages.get("perfmodel")
    if pm and "file" in pm:
        lines += [f"Decomposition curves for planning, measured in this run: `{pm['file']}` (`perfmodels/` holds one per card).", ""]
    sim = stages.get("simulate")
    if sim and "predictions" in sim:
        preds = sim["predictions"]
        workers = sorted({int(k.split(":")[0]) for k in preds})
        variants = list(dict.fromkeys(k.split(":", 1)[1] for k in preds))
        lines += [
            f"**Predicted** by the simulator from a profile taken on the card (batch {sim['batch']} per GPU, fp32), its "
            "decomposition curves and an assumed 100 Gb/s InfiniBand network; factors every 10, decompositions every "
            "100; ms per iteration (x SGD's):",
            "",
        ]
        body = []
        for v in variants:
            row = [v]
            for w in workers:
                it, sgd = preds[f"{w}:{v}"]["iteration"], preds.get(f"{w}:sgd", {}).get("iteration")
                row.append(f"{it * 1e3:.0f}" + (f" ({it / sgd:.2f}x)" if sgd and v != "sgd" else ""))
            body.append(row)
        lines += table(["variant", *(f"{w} GPUs" for w in workers)], body)
        if sim.get("note"):
            lines += [f"({sim['note']}.)", ""]
    return lines


def _iteration_times(model: str, resolution: int, batch: str, rows: dict[str, Any]) -> list[str]:
    """One model and batch size's interleaved iteration times against SGD's, and every-step K-FAC's phases if measured."""
    lines = [
        f"**Iteration time**, {model} {resolution}x{resolution}, batch {batch}, bf16 autocast, channels-last, "
        f"one process; interleaved; ratio to SGD's median with its 95% interval"
        + (", a `-tf32` row's to `sgd-tf32`'s (float32 products in TF32, as timm's training script sets)" if "sgd-tf32" in rows else "")
        + (", a `-compiled` row's to `sgd-compiled`'s, and that one's to eager `sgd`'s" if "sgd-compiled" in rows else "")
        + f" (peak memory {rows.get('cuda_peak_gib', 0):.1f} GiB):",
        "",
    ]
    body = []
    for name, row in rows.items():
        if not isinstance(row, dict) or "median" not in row:
            continue
        body.append(
            [
                name,
                str(row["n"]),
                ms(row["median"]),
                ms(row["mean"]),
                ratio(row.get("vs_sgd_median"), *(row.get("vs_sgd_median_95") or (None, None))),
                ratio(row.get("vs_sgd_mean")),
            ]
        )
    lines += table(["configuration", "iterations", "median ms", "mean ms", "x SGD (median)", "x SGD (mean)"], body)
    phased = {n: r["phases_s"] for n, r in rows.items() if isinstance(r, dict) and r.get("phases_s")}
    if phased:
        phases = ["forward+backward", "factors", "decompositions", "preconditioning", "update", "other"]
        lines += ["Every-step K-FAC per phase (ms; a separate run with the timeline, which waits for the GPU at each phase):", ""]
        lines += table(
            ["configuration", *phases, "iteration"],
            [[n, *(ms(p.get(k)) for k in phases), ms(p.get("iteration"))] for n, p in phased.items()],
        )
    if "error" in rows:
        lines += [f"Batch {batch}: {rows['error']}", ""]
    return lines
