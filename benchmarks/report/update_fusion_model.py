"""The update-fusion cost model on this CPU and on a V100-class GPU (``update_fusion_model.json``, benchmarks/update_fusion_model.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report.common import command_block, ms, need, renders, table


@renders("update_fusion_model.json", "Update fusion: the cost model on this CPU and on a V100-class GPU", order=42, optional=True)
def update_fusion_model(path: Path, d: dict[str, Any]) -> list[str]:
    """The update-fusion cost model: its CPU prediction beside the measurements, then its V100-class GPU prediction."""
    need(d, path, "cpu_device", "cpu", "gpu_device", "gpu")
    c, g = d["cpu_device"], d["gpu_device"]

    def gain(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}x"

    lines = [
        "`spdkfac/simulate/update_fusion_cost.py`: each kernel of a step (counted on meta tensors) takes "
        "max(FLOPs / rate, bytes / bandwidth) on the device; one host thread spends a launch time per kernel; the "
        "update's kernels move into the next forward pass or into backward; the one read that follows a write of a "
        "tensor that fits in the cache is saved.",
        "",
        f"**CPU check** (this machine, synchronous: the host runs each kernel): {c['bandwidth'] / 1e9:.1f} GB/s and "
        f"{c['launch_s'] * 1e6:.1f} µs per kernel (the update's own kernels), {c['flop_rate'] / 1e9:.0f} GFLOP/s (a 3×3 "
        f"convolution), {c['cache_bytes'] / 2**20:.0f} MiB cache. 32×32, batch 32, one thread; recipe `spdkfac` (this "
        "optimizer's non-finite checks and, in backward fusion, its rollback copies). Measured speed-ups: SGD rows of "
        "`update_fusion_<model>_w1.json`.",
        "",
    ]
    rows = []
    for r in d["cpu"]:
        m, p, mf = r["measured"], r["predicted"], r.get("measured_fusion") or {}
        rows.append(
            [
                r["model"],
                f"{r['tensors']} / {r['parameters'] / 1e6:.1f} M",
                f"{ms(m['fwd_bwd_s'])} / {ms(p['fwd_bwd_s'])}",
                f"{m['update_s'] * 1e3:.1f} / {p['update_s'] * 1e3:.1f}",
                f"{gain(mf.get('forward'))} / {gain(p['forward'])}",
                f"{gain(mf.get('backward'))} / {gain(p['backward'])}",
            ]
        )
    lines += table(
        ["model", "tensors / parameters", "fwd+bwd ms (measured / model)", "update pass ms", "forward fusion", "backward fusion"],
        rows,
    )
    seed = d.get("seed_reported", {})
    lines += [
        f"**GPU prediction** (V100-class, asynchronous: {g['bandwidth'] / 1e9:.0f} GB/s, {g['flop_rate'] / 1e12:.2f} "
        f"TFLOP/s achieved, {g['cache_bytes'] / 2**20:.0f} MiB L2), 224×224, batch 32, one GPU. Speed-up = unfused "
        "time over fused. `seed`: the update alone, the loop waiting for the device after backward (the seed's "
        "baseline, whose step overlaps nothing); `spdkfac`: this optimizer's checks and copies too; last column: "
        "`seed` with the loop waiting after `step()` instead. The seed reports "
        f"{gain(seed.get('forward'))} (forward) and {gain(seed.get('backward'))} (backward) on MobileNetV2, batch 32.",
        "",
    ]
    rows = []
    for model in d["gpu"]:
        for r in model["rows"]:
            sd, ours, late = r["seed"], r["spdkfac"], r["seed_sync_after_step"]
            rows.append(
                [
                    model["model"],
                    f"{model['tensors']} / {model['parameters'] / 1e6:.1f} M",
                    f"{r['launch_s'] * 1e6:.0f}",
                    f"{sd['none_s'] * 1e3:.1f}",
                    f"{gain(sd['forward'])} / {gain(sd['backward'])}",
                    f"{gain(ours['forward'])} / {gain(ours['backward'])}",
                    f"{gain(late['forward'])} / {gain(late['backward'])}",
                ]
            )
    lines += table(
        ["model", "tensors / parameters", "µs per kernel", "unfused ms", "seed: forward / backward", "spdkfac", "seed, sync after step()"],
        rows,
    )
    return lines + command_block(d, "benchmarks.update_fusion_model", ".venv/bin/python -m benchmarks.update_fusion_model")
