"""Where a K-FAC step's time goes on a GPU: per-layer factor cost by formulation, host syncs, the profiler's top ops.

    PYTHONPATH=. python -m benchmarks.gpu_profile --out-dir $OUT          # one GPU, about a minute
    PYTHONPATH=. python -m benchmarks.gpu_profile --device cpu --quick    # the script itself
    PYTHONPATH=. python -m benchmarks.gpu_profile --compile --out-dir $OUT  # the compiled step against compiled SGD's

The factors of a convolution are Gram matrices of very tall, narrow row
blocks (ResNet-50 at 224x224, batch 64: 200,704 rows of 64 to 4,608
columns). The formulations that are fastest on a CPU (shared shifts,
per-strip products) issue many small products; this measures, per layer,
the library's formulation against one product of the rows and against a
split reduction (the rows in chunks, one batched product, summed), so the
GPU path can follow the measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from spdkfac import make_optimizer
from spdkfac.kfac.layers import kfac_layers
from spdkfac.models import get_model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median(fn: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _split_gram(rows: torch.Tensor, chunks: int) -> torch.Tensor:
    """``rows.T @ rows`` as ``chunks`` partial products in one batched product, then summed."""
    k, d = rows.shape
    per = k // chunks
    head = rows[: per * chunks].reshape(chunks, per, d)
    out = torch.bmm(head.transpose(1, 2), head).sum(0)
    if per * chunks < k:
        tail = rows[per * chunks :]
        out += tail.T @ tail
    return out


def _rows(layer: Any, x: torch.Tensor, kind: str) -> torch.Tensor:
    """The factor's rows, built once (float32): im2col patches (+ ones) for A, channel vectors for G."""
    helper = layer.helper
    if kind == "G":
        if isinstance(layer.module, nn.Linear):  # (..., features), any leading dimensions
            return x.float().reshape(-1, x.shape[-1])
        return x.float().movedim(1, -1).reshape(-1, x.shape[1]) if x.dim() > 2 else x.float()
    rows = x.float().reshape(-1, x.shape[-1]) if isinstance(layer.module, nn.Linear) else helper.input_rows(helper._padded(x.float()))
    if helper.has_bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return rows


def factor_costs(model_name: str, batch: int, resolution: int, device: torch.device) -> dict[str, Any]:
    """Per layer and factor: seconds of the library's formulation, one product, and split products."""
    torch.manual_seed(0)
    model = get_model(model_name).to(device).to(memory_format=torch.channels_last)
    layers = kfac_layers(model)
    inputs: dict[str, torch.Tensor] = {}
    grads: dict[str, torch.Tensor] = {}
    handles = []
    for layer in layers:

        def fwd(module: nn.Module, args: tuple[Any, ...], out: torch.Tensor, name: str = layer.name) -> None:
            inputs[name] = args[0].detach()
            out.register_hook(lambda g, name=name: grads.__setitem__(name, g.detach()))

        handles.append(layer.module.register_forward_hook(fwd))
    x = torch.randn(batch, 3, resolution, resolution, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for h in handles:
        h.remove()
    rows_out = []
    for layer in layers:
        groups = getattr(layer.helper, "groups", 1)
        for kind, data in (("A", inputs[layer.name]), ("G", grads[layer.name])):
            library = (
                (lambda layer=layer, data=data: layer.compute_a(data))
                if kind == "A"
                else (lambda layer=layer, data=data: layer.compute_g(data))
            )
            row = {
                "layer": layer.name,
                "kind": kind,
                "dim": layer.dim(kind),
                "input": list(data.shape),
                "library": _median(library, device),
            }
            if groups == 1 and (isinstance(layer.module, nn.Linear) or hasattr(layer.helper, "input_rows")):
                rows = _rows(layer, data, kind)
                row["rows"] = list(rows.shape)
                row["one_product"] = _median(lambda r=rows: r.T @ r, device)
                row["build_rows"] = _median(lambda layer=layer, data=data, kind=kind: _rows(layer, data, kind), device)
                for chunks in (8, 32, 128):
                    if rows.shape[0] >= 64 * chunks:
                        row[f"split{chunks}"] = _median(lambda r=rows, c=chunks: _split_gram(r, c), device)
                ref = (rows.double().T @ rows.double()).float()
                row["split32_relerr"] = float((_split_gram(rows, 32) - ref).norm() / ref.norm()) if rows.shape[0] >= 64 * 32 else None
                row["one_product_relerr"] = float((rows.T @ rows - ref).norm() / ref.norm())
            rows_out.append(row)
    keys = ["library", "one_product", "build_rows", "split8", "split32", "split128"]
    totals = {k: sum(r.get(k, r["library"] if k != "build_rows" else 0.0) for r in rows_out) for k in keys}
    best = sum(
        min([r["library"]] + [r[k] + (r["build_rows"] if k != "library" else 0) for k in keys[1:] if k in r and k != "build_rows"])
        for r in rows_out
    )
    totals["best_per_factor_incl_rows"] = best
    return {"factors": rows_out, "totals_s": totals}


def sync_sources(model_name: str, batch: int, resolution: int, device: torch.device, options: dict[str, Any]) -> dict[str, Any]:
    """Host-device synchronisations in one K-FAC step, by the library line that caused them (CUDA only)."""
    if device.type != "cuda":
        return {}
    torch.manual_seed(0)
    model = get_model(model_name).to(device).to(memory_format=torch.channels_last)
    opt = make_optimizer("spdkfac", model, lr=0.1, momentum=0.9, backend="single", **options)
    x = torch.randn(batch, 3, resolution, resolution, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)
    counts: dict[int, Counter[str]] = {}
    for step in range(3):
        torch.cuda.set_sync_debug_mode(1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt.zero_grad()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
        torch.cuda.set_sync_debug_mode(0)
        counts[step] = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    return {str(s): dict(c.most_common(25)) for s, c in counts.items()}


def profile_steps(
    model_name: str, batch: int, resolution: int, device: torch.device, out_dir: Path, compiled: bool = False, sgd: bool = False
) -> dict[str, Any]:
    """torch.profiler's top operations (self device time, host time) of one factor step and one plain step; of the
    model under torch.compile if ``compiled``, and with torch's SGD (a plain step only) if ``sgd``."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    bare = get_model(model_name).to(device).to(memory_format=torch.channels_last)
    model = torch.compile(bare) if compiled else bare
    opt: Any
    if sgd:
        opt = torch.optim.SGD(bare.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = make_optimizer("spdkfac", model, lr=0.1, momentum=0.9, backend="single", factor_update_freq=2, inv_update_freq=4)
    x = torch.randn(batch, 3, resolution, resolution, device=device).contiguous(memory_format=torch.channels_last)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        opt.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    for _ in range(5):  # steps 0-4: past the profiling steps and the first decompositions
        step()
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    tables = {}
    suffix = ("_sgd" if sgd else "") + ("_compiled" if compiled else "")
    for label in ("plain_step", "factor_step")[: 1 if sgd else 2]:  # steps 5 (no factors) and 6 (factors)
        label += suffix
        with profile(activities=activities) as prof:
            step()
            _sync(device)
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        text = prof.key_averages().table(sort_by=sort, row_limit=30)
        text += "\n\nby host time\n" + prof.key_averages().table(sort_by="cpu_time_total", row_limit=30)
        (out_dir / f"profile_{label}.txt").write_text(text)
        tables[label] = f"profile_{label}.txt"
    return tables


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out-dir", default="/tmp/gpu_profile")
    ap.add_argument("--model", default=None, help="a zoo model (default resnet50; cifar_resnet20 with --quick)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--resolution", type=int, default=None)
    ap.add_argument("--compile", action="store_true", help="only the step profiles, of the model under torch.compile (and compiled SGD's)")
    args = ap.parse_args(argv)
    warnings.filterwarnings("ignore", message="no perf_model given")
    device = torch.device(args.device)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model, batch, res = ("cifar_resnet20", 8, 32) if args.quick else ("resnet50", 64, 224)
    model, batch, res = args.model or model, args.batch or batch, args.resolution or res
    torch.backends.cudnn.benchmark = True
    report: dict[str, Any] = {"model": model, "batch": batch, "resolution": res}
    t0 = time.perf_counter()
    if args.compile:  # the compiled step against compiled SGD's, one plain step each (a separate Dynamo cache each)
        torch._dynamo.config.skip_nnmodule_hook_guards = False  # two instances of one class: told apart by hooks
        report["profiles"] = profile_steps(model, batch, res, device, out_dir, compiled=True)
        report["profiles"].update(profile_steps(model, batch, res, device, out_dir, compiled=True, sgd=True))
        report["seconds"] = time.perf_counter() - t0
        (out_dir / "gpu_profile_compiled.json").write_text(json.dumps(report, indent=1))
        print(f"done in {report['seconds']:.0f} s", flush=True)
        return 0
    report["factor_costs"] = factor_costs(model, batch, res, device)
    print("factor totals (ms):", {k: round(v * 1e3, 1) for k, v in report["factor_costs"]["totals_s"].items()}, flush=True)
    slow = sorted(report["factor_costs"]["factors"], key=lambda r: -r["library"])[:12]
    for r in slow:
        alts = {k: round(r[k] * 1e3, 2) for k in ("one_product", "build_rows", "split8", "split32", "split128") if k in r}
        print(
            f"  {r['kind']} {r['layer']:<28} dim {r['dim']:5d} rows {r.get('rows')} library {r['library'] * 1e3:.2f} ms {alts}", flush=True
        )
    report["sync_sources"] = sync_sources(model, batch, res, device, {})
    print("host syncs per step:", {s: sum(c.values()) for s, c in report["sync_sources"].items()}, flush=True)
    for s, c in report["sync_sources"].items():
        print(f"  step {s}:", list(c.items())[:10], flush=True)
    report["profiles"] = profile_steps(model, batch, res, device, out_dir)
    report["seconds"] = time.perf_counter() - t0
    (out_dir / "gpu_profile.json").write_text(json.dumps(report, indent=1))
    print(f"done in {report['seconds']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
