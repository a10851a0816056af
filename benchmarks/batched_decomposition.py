"""Grouped and depthwise factors: one batched decomposition against one call per block.

    python -m benchmarks.batched_decomposition --models mobilenet_v2 resnext50_32x4d efficientnet_b0

A grouped convolution's factors are block-diagonal (one ``d x d`` block per
group); the compute methods decompose all blocks of a factor in one batched
call. For every distinct ``(blocks, d)`` of the models' block-diagonal
factors, this times that batched call (``method.owned`` on the stack, as the
decomposition stage runs it) and a loop of one call per block, side by side
(alternating, median of ``--repeats``), for the inverse and the eigen method,
and totals both over each model (every factor once, as in a step that
decomposes all). It also prints what the fitted performance model
(``--perf-model``) predicts for the batched call, so its error is visible.

Writes ``batched_decomposition.json`` to ``--out``; RESULTS.md renders it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from spdkfac.kfac.factor_shape import FactorShape
from spdkfac.kfac.layers import kfac_layers
from spdkfac.kfac.methods import get_method
from spdkfac.models import get_model
from spdkfac.perfmodels import PerfModel, load_perf_model

from .common import RESULTS, machine, save_json

METHODS = ("inverse", "eigen")
DAMPING = 1e-3


def block_shapes(model_name: str) -> Counter[tuple[int, int]]:
    """How many factors of each ``(blocks, d)`` with ``blocks > 1`` the model has (A and G of every grouped layer)."""
    counts: Counter[tuple[int, int]] = Counter()
    for layer in kfac_layers(get_model(model_name)):
        for shape in (layer.helper.a_shape, layer.helper.g_shape):
            if shape.blocks > 1 and not shape.diagonal:
                counts[shape.blocks, shape.dim] += 1
    return counts


def _spd_stack(blocks: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(blocks, dim, dim + 3, generator=gen, dtype=torch.float64)
    return (x @ x.transpose(1, 2) / (dim + 3)).float()


def _median_pair(first: Callable[[], object], second: Callable[[], object], repeats: int) -> tuple[float, float]:
    """Median seconds of two calls timed alternately (so load on the machine hits both alike)."""
    a: list[float] = []
    b: list[float] = []
    for _ in range(2):  # warm-up
        first()
        second()
    for _ in range(repeats):
        t0 = time.perf_counter()
        first()
        t1 = time.perf_counter()
        second()
        t2 = time.perf_counter()
        a.append(t1 - t0)
        b.append(t2 - t1)
    return statistics.median(a), statistics.median(b)


def measure(shape: tuple[int, int], method_name: str, repeats: int, perf: PerfModel | None) -> dict[str, Any]:
    """Batched vs per-block seconds for one ``(blocks, d)``, and the model's prediction of the batched call."""
    blocks, dim = shape
    method = get_method(method_name)
    stack = _spd_stack(blocks, dim, torch.Generator().manual_seed(blocks * 1000 + dim))
    whole = FactorShape(dim, blocks)
    one = FactorShape(dim)
    per_block = [stack[b] for b in range(blocks)]

    def batched() -> object:
        return method.owned(whole, stack, DAMPING)

    def looped() -> object:
        return [method.owned(one, m, DAMPING) for m in per_block]

    batched_s, looped_s = _median_pair(batched, looped, repeats)
    row: dict[str, Any] = {"blocks": blocks, "dim": dim, "method": method_name, "batched_s": batched_s, "per_block_s": looped_s}
    row["speedup"] = looped_s / batched_s
    if perf is not None:
        row["predicted_s"] = method.cost(perf, whole)
        row["prediction_error"] = row["predicted_s"] / batched_s - 1.0
    return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["mobilenet_v2", "resnext50_32x4d", "efficientnet_b0"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument(
        "--perf-model", default="perfmodels/reference-cpu-gloo-2.json", help="fitted model whose prediction is shown ('none': skip)"
    )
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    if args.perf_model.lower() == "none":
        args.perf_model = None
    elif not Path(args.perf_model).is_file():
        ap.error(f"--perf-model {args.perf_model} does not exist")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    perf = load_perf_model(args.perf_model) if args.perf_model else None
    per_model = {name: block_shapes(name) for name in args.models}
    shapes = sorted({s for counts in per_model.values() for s in counts})
    rows = []
    for i, shape in enumerate(shapes):
        for method in args.methods:
            row = measure(shape, method, args.repeats, perf)
            rows.append(row)
            err = f"  model {row['prediction_error']:+.0%}" if "prediction_error" in row else ""
            print(
                f"[{i + 1}/{len(shapes)}] {method:7s} {shape[0]:4d} x {shape[1]:4d}: batched {row['batched_s'] * 1e3:8.3f} ms  "
                f"per block {row['per_block_s'] * 1e3:8.3f} ms  x{row['speedup']:.1f}{err}",
                flush=True,
            )
    by_key = {(r["blocks"], r["dim"], r["method"]): r for r in rows}
    totals = []
    for name, counts in per_model.items():
        for method in args.methods:
            batched = sum(n * by_key[b, d, method]["batched_s"] for (b, d), n in counts.items())
            looped = sum(n * by_key[b, d, method]["per_block_s"] for (b, d), n in counts.items())
            totals.append(
                {
                    "model": name,
                    "method": method,
                    "factors": sum(counts.values()),
                    "batched_s": batched,
                    "per_block_s": looped,
                    "speedup": looped / batched,
                }
            )
            print(
                f"{name} {method}: {sum(counts.values())} block-diagonal factors, batched {batched:.3f} s, per block {looped:.3f} s, x{looped / batched:.1f}"
            )
    out = {"args": vars(args), "machine": machine(), "rows": rows, "totals": totals}
    path = save_json(out, "batched_decomposition.json", Path(args.out))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
