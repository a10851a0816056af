"""Update fusion predicted by the kernel-level cost model: calibrated on this CPU, then for a V100-class GPU.

    python -m benchmarks.update_fusion_model          # ~1 min on the CPU; writes update_fusion_model.json

1. Measures this CPU's constants for :class:`spdkfac.simulate.update_fusion_cost.Device`:
   the bandwidth and per-kernel time of the momentum-SGD update (48 tensors
   of 2^18 elements, more than the caches hold; many one-element tensors), the arithmetic rate of a 3x3
   convolution, and the L2 cache size.
2. CPU check, per model at 32x32 and batch 32 (``--cpu-models``): forward +
   backward and the unfused update pass measured (``update_cost.measure_passes``)
   beside the model's prediction, and the model's fusion gains for the
   optimizer as built (recipe ``spdkfac``) beside the measured ones (the SGD
   rows of ``update_fusion_<model>_w1.json``, when present).
3. GPU prediction, per model at 224x224 and batch 32 (``--gpu-models``) on the
   V100-class device below, at two launch costs: the update alone (recipe
   ``seed``, the seed's setting) and as this project runs it (``spdkfac``);
   the loop syncs after backward (the seed's baseline), and, for the seed
   recipe, also after ``step()``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from spdkfac.models import get_model
from spdkfac.simulate.kernel_trace import trace_kernels, trace_training_step
from spdkfac.simulate.update_fusion_cost import RECIPES, Device, predicted_gains, stream_seconds
from spdkfac.update.base_update import sgd_param_update

from .common import RESULTS, log, machine, save_json
from .update_cost import measure_passes

#: A V100-class GPU (SXM2, fp32): 900 GB/s HBM2 at 80% achieved; 15.7 TFLOP/s peak at 50% achieved
#: by cuDNN's convolutions; 6 MiB L2; 5 or 10 us of eager PyTorch host time per kernel.
V100_BANDWIDTH, V100_FLOPS, V100_L2 = 0.8 * 900e9, 0.5 * 15.7e12, 6 * 2**20
V100_LAUNCH_S = (5e-6, 10e-6)


def _median_seconds(fn: Any, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _l2_bytes() -> float:
    try:
        size = Path("/sys/devices/system/cpu/cpu0/cache/index2/size").read_text().strip()
        return float(int(size.rstrip("K")) * 1024) if size.endswith("K") else float(size)
    except (OSError, ValueError):
        return float(2**20)


def measure_cpu() -> tuple[Device, dict[str, float]]:
    """This CPU as a :class:`Device`, from the update's own kernels and a 3x3 convolution."""
    n_big, count, n_small = 2**18, 48, 2000  # 48 tensors of 1 MiB (3 x 48 MiB in all, beyond the L3): cold, as in the pass
    big = [(torch.zeros(n_big), torch.zeros(n_big), {"momentum_buffer": torch.zeros(n_big)}) for _ in range(count)]
    small = [(torch.zeros(1), torch.zeros(1), {"momentum_buffer": torch.zeros(1)}) for _ in range(n_small)]
    update_bytes = count * sum(k.bytes for k in trace_kernels(lambda: sgd_param_update(*_meta_like(n_big), 0.1, 0.9, 5e-4)))
    kernels = len(trace_kernels(lambda: sgd_param_update(*_meta_like(1), 0.1, 0.9, 5e-4)))
    t_big = _median_seconds(lambda: [sgd_param_update(p, g, s, 0.1, 0.9, 5e-4) for p, g, s in big], 9)
    t_small = _median_seconds(lambda: [sgd_param_update(p, g, s, 0.1, 0.9, 5e-4) for p, g, s in small], 5)
    launch_s = t_small / (n_small * kernels)
    conv = nn.Conv2d(64, 64, 3, padding=1, bias=False)
    x = torch.randn(32, 64, 16, 16)
    meta_conv = nn.Conv2d(64, 64, 3, padding=1, bias=False, device="meta")
    conv_flops = sum(k.flops for k in trace_kernels(lambda: meta_conv(x.to("meta"))))
    with torch.no_grad():
        t_conv = _median_seconds(lambda: conv(x), 10)
    bandwidth = update_bytes / max(t_big - count * kernels * launch_s, 1e-9)
    device = Device("this CPU", bandwidth, conv_flops / t_conv, launch_s, asynchronous=False, cache_bytes=_l2_bytes())
    return device, {"update_big_s": t_big, "update_small_s": t_small, "conv_s": t_conv, "kernels_per_update": float(kernels)}


def _meta_like(n: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    return torch.empty(n, device="meta"), torch.empty(n, device="meta"), {"momentum_buffer": torch.empty(n, device="meta")}


def measured_gains(results: Path, model: str) -> dict[str, float] | None:
    """SGD's measured throughput gains (unfused mean time over fused) from ``update_fusion_<model>_w1.json``."""
    path = results / f"update_fusion_{model}_w1.json"
    if not path.is_file():
        return None
    rows = {r["variant"]: r for r in json.loads(path.read_text())["table"]}
    base = rows.get("sgd")
    if base is None:
        return None
    out = {"none_s": base["mean_s"], "update_s": base.get("Other")}
    for mode in ("forward", "backward"):
        row = rows.get(f"sgd:update_fusion={mode}")
        if row is not None:
            out[mode] = base["mean_s"] / row["mean_s"]
    return out


def cpu_check(device: Device, model_name: str, iters: int, results: Path) -> dict[str, Any]:
    """The model's CPU prediction beside what this CPU measures, for one model at 32x32, batch 32."""
    torch.manual_seed(0)
    model = get_model(model_name)
    trace = trace_training_step(get_model(model_name), (32, 3, 32, 32))
    fwd_bwd, update = measure_passes(model, 32, 32, iters)
    seed = RECIPES["seed"]
    update_kernels = [k for n in trace.params for k in seed.update(n)]
    return {
        "model": model_name,
        "tensors": len(trace.params),
        "parameters": sum(trace.params),
        "gflop": trace.flops / 1e9,
        "measured": {"fwd_bwd_s": statistics.median(fwd_bwd), "update_s": statistics.median(update)},
        "predicted": {
            "fwd_bwd_s": stream_seconds(trace.forward + trace.backward, device),
            "update_s": stream_seconds(update_kernels, device),
            **predicted_gains(trace, RECIPES["spdkfac"], device),
        },
        "measured_fusion": measured_gains(results, model_name),
    }


def gpu_prediction(model_name: str) -> dict[str, Any]:
    """Predicted gains on the V100-class device for one model at 224x224, batch 32."""
    trace = trace_training_step(get_model(model_name), (32, 3, 224, 224))
    rows = []
    for launch_s in V100_LAUNCH_S:
        gpu = Device(f"V100-class, {launch_s * 1e6:.0f} us/kernel", V100_BANDWIDTH, V100_FLOPS, launch_s, True, V100_L2)
        row: dict[str, Any] = {"launch_s": launch_s, "update_kernels": len(trace.params) * len(RECIPES["seed"].update(1))}
        row["seed"] = predicted_gains(trace, RECIPES["seed"], gpu)
        row["spdkfac"] = predicted_gains(trace, RECIPES["spdkfac"], gpu)
        row["seed_sync_after_step"] = predicted_gains(trace, RECIPES["seed"], gpu, sync_after="step")
        rows.append(row)
    return {"model": model_name, "tensors": len(trace.params), "parameters": sum(trace.params), "gflop": trace.flops / 1e9, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-models", nargs="*", default=["resnet50", "densenet201", "mobilenet_v2_32"])
    ap.add_argument("--gpu-models", nargs="*", default=["mobilenet_v2", "resnet50", "densenet201"])
    ap.add_argument("--iters", type=int, default=5, help="measured repetitions per model on the CPU")
    ap.add_argument("--results", default="benchmarks/results", help="where the measured update_fusion_<model>_w1.json are")
    ap.add_argument("--out", default=str(RESULTS / "update_fusion_model.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device, raw = measure_cpu()
    log(0, f"CPU: {device.bandwidth / 1e9:.1f} GB/s, {device.flop_rate / 1e9:.1f} GFLOP/s, {device.launch_s * 1e6:.1f} us/kernel")
    cpu = [cpu_check(device, m, args.iters, Path(args.results)) for m in args.cpu_models]
    gpu = [gpu_prediction(m) for m in args.gpu_models]
    result = {
        "args": vars(args),
        "machine": machine(),
        "cpu_device": asdict(device),
        "cpu_raw": raw,
        "cpu": cpu,
        "gpu_device": {"bandwidth": V100_BANDWIDTH, "flop_rate": V100_FLOPS, "cache_bytes": V100_L2, "launch_s": list(V100_LAUNCH_S)},
        "gpu": gpu,
        "seed_reported": {"model": "mobilenet_v2", "batch_size": 32, "forward": 1.12, "backward": 1.16},
    }
    path = save_json(result, Path(args.out).name, Path(args.out).parent)
    for g in gpu:
        r = g["rows"][0]
        log(0, f"{g['model']}: forward {r['seed']['forward']:.3f}x, backward {r['seed']['backward']:.3f}x (5 us/kernel)")
    log(0, f"wrote {path}")


if __name__ == "__main__":
    main()
