"""K-FAC factor statistics of the ImageNet models (the SPD-KFAC paper's Table II and Fig. 3).

For every model: parameter count, number of preconditioned layers (those
:func:`spdkfac.kfac.layers.make_helper` accepts), number of ``A`` and ``G``
factors, the total number of upper-triangle elements ``d(d+1)/2`` over all
``A`` and over all ``G`` factors (per block for grouped convolutions, whose
factors are block-diagonal), and the largest factor (block) dimension. Factor
dimensions come from :class:`spdkfac.kfac.layers.KFACLayer`, exactly as the
optimizer sizes them. Models are built on the CPU; no forward pass is run.

    python -m benchmarks.model_stats [--models resnet50 ...] [--out-dir benchmarks/results]

Writes ``model_stats.json`` and ``factor_sizes.png`` (factor-size distribution,
as in the paper's Fig. 3) into the output directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time
from collections import Counter

import torch
import torch.nn as nn

from spdkfac.kfac.layers import KFACLayer, kfac_layers
from spdkfac.models import get_model
from spdkfac.runtime.output_path import unwritable_reason

DEFAULT_MODELS = [
    "resnet50",
    "resnet152",
    "densenet201",
    "inception_v4",
    "mobilenet_v2",
    "resnext50_32x4d",
    "efficientnet_b0",
    "convnext_t",
    "vit_s16",
    "convnext_t_32",
    "vit_s16_32",
]
#: Models for 32x32 images (``*_32``): their arithmetic is counted at 32x32, with 10 classes.
SMALL_INPUT_SUFFIX = "_32"

# The paper's Table II: parameters (M), preconditioned layers, sum of A / G upper triangles (M).
PAPER_TABLE2: dict[str, dict[str, float]] = {
    "resnet50": {"params_m": 25.6, "layers": 54, "a_elems_m": 62.3, "g_elems_m": 14.6},
    "resnet152": {"params_m": 60.2, "layers": 156, "a_elems_m": 162.0, "g_elems_m": 32.9},
    # DenseNet-201's G total is printed as 18.0M; with the exact 20,013,928-parameter network it is
    # 1.81M (98 x 128 + 98 x 32 + transitions 128/256/896 + fc 1000), so 18.0 looks like a slip for 1.80.
    "densenet201": {"params_m": 20.0, "layers": 201, "a_elems_m": 131.0, "g_elems_m": 18.0},
    "inception_v4": {"params_m": 42.7, "layers": 150, "a_elems_m": 116.4, "g_elems_m": 4.7},
}
# A figure reported in millions with one decimal "matches" when ours rounds to it (±0.05M, plus 1%).
MATCH_RTOL = 0.01


def tri(d: int) -> int:
    """Number of upper-triangle elements (diagonal included) of a symmetric d x d matrix."""
    return d * (d + 1) // 2


def _matches(ours: float, paper: float) -> bool:
    return abs(ours - paper) <= 0.05 + MATCH_RTOL * abs(paper)


def model_stats(name: str, num_classes: int = 1000, model: nn.Module | None = None) -> dict[str, object]:
    """Table II numbers and the per-factor dimensions of one registered model (``model``: that model, already built)."""
    if model is None:
        model = get_model(name, num_classes=num_classes)
    layers: list[KFACLayer] = kfac_layers(model)
    a_dims = [layer.a_dim for layer in layers]
    g_dims = [layer.g_dim for layer in layers]
    sizes = [layer.shape(kind).packed_size for layer in layers for kind in ("A", "G")]
    stats: dict[str, object] = {
        "params": sum(p.numel() for p in model.parameters()),
        "layers": len(layers),
        "num_a": len(a_dims),
        "num_g": len(g_dims),
        "a_elems": sum(layer.shape("A").packed_size for layer in layers),
        "g_elems": sum(layer.shape("G").packed_size for layer in layers),
        "max_a_dim": max(a_dims),
        "max_g_dim": max(g_dims),
        "max_dim": max(a_dims + g_dims),
        "min_factor_elems": min(sizes),
        "max_factor_elems": max(sizes),
        "a_dims": a_dims,
        "g_dims": g_dims,
        "grouped_layers": sum(layer.shape("A").blocks > 1 for layer in layers),
        "blocks": [layer.shape("A").blocks for layer in layers],
    }
    paper = PAPER_TABLE2.get(name)
    if paper is not None:
        ours = {
            "params_m": stats["params"] / 1e6,
            "layers": stats["layers"],
            "a_elems_m": stats["a_elems"] / 1e6,
            "g_elems_m": stats["g_elems"] / 1e6,
        }
        stats["paper"] = paper
        stats["matches_paper"] = {key: (ours[key] == paper[key]) if key == "layers" else _matches(ours[key], paper[key]) for key in paper}
    return stats


def kfac_arithmetic(model: nn.Module, input_shape: tuple[int, ...]) -> dict[str, float]:
    """Floating-point operations of one iteration's K-FAC work next to the layers' own, for one input batch.

    Shapes come from a forward pass on the ``meta`` device (nothing is
    computed). Per preconditioned layer with ``r`` rows (samples x output
    positions), factor dimensions ``a`` (bias row included) and ``g``:

    * ``forward_backward``: three times the forward ``2 r a_in g`` (input and
      weight gradients);
    * ``precondition``: ``2 g a (g + a)`` per iteration (``G^-1 grad A^-1``);
    * ``factor_g``: ``r g (g + 1)`` per factor update (upper-triangle Gram);
    * ``factor_a_plain``: the same for the ``A`` factors of linear layers and
      1x1 convolutions, whose rows are the input itself;
    * ``factor_a_unfolded``: the explicit-row Gram of k x k convolutions'
      ``A`` factors (shared shifts compute less of it; see ``conv_gram``).
    """
    meta = copy.deepcopy(model).to("meta")
    layers = kfac_layers(meta)
    rows: dict[str, int] = {}

    def recorder(name: str):
        def record(mod: nn.Module, inputs, out: torch.Tensor) -> None:
            channels_first = isinstance(mod, (nn.Conv1d, nn.Conv2d))
            rows[name] = out.numel() // out.shape[1] if channels_first else out.numel() // out.shape[-1]

        return record

    for layer in layers:
        layer.module.register_forward_hook(recorder(layer.name))
    meta(torch.empty(*input_shape, device="meta"))
    ops = dict.fromkeys(["forward_backward", "precondition", "factor_g", "factor_a_plain", "factor_a_unfolded"], 0.0)
    for layer in layers:
        r, a, g, b = rows[layer.name], layer.a_dim, layer.g_dim, layer.shape("G").blocks  # b blocks: grouped convolutions
        a_in = a - (1 if layer.has_bias else 0)
        unfolded = isinstance(layer.module, (nn.Conv1d, nn.Conv2d)) and math.prod(layer.module.kernel_size) > 1
        ops["forward_backward"] += 3.0 * 2 * r * a_in * g * b
        ops["precondition"] += 2.0 * g * a * (g + a) * b
        ops["factor_g"] += float(r * g * (g + 1) * b)
        if layer.shape("A").diagonal:  # an embedding's token counts
            ops["factor_a_plain"] += float(r)
        else:
            ops["factor_a_unfolded" if unfolded else "factor_a_plain"] += float(r * a * (a + 1) * b)
    return ops


def arithmetic_floor(ops: dict[str, float], factor_every: int, dp_workers: int = 1) -> float:
    """Lowest amortised K-FAC / SGD iteration-time ratio the arithmetic allows at one FLOP rate.

    Counts what no implementation avoids: the preconditioning (split over
    ``dp_workers`` when it is distributed) and, every ``factor_every``
    iterations, the G factors and the A factors of layers without unfolding.
    Inversions and the k x k convolutions' A factors are left out, so it stays
    a floor.
    """
    extra = ops["precondition"] / dp_workers + (ops["factor_g"] + ops["factor_a_plain"]) / factor_every
    return 1.0 + extra / ops["forward_backward"]


def plot_sizes(results: dict[str, dict[str, object]], path: str) -> None:
    """Scatter of factor sizes (upper-triangle elements, log x) against how many factors have that size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    markers = ["o", "s", "^", "D", "v", "P", "X", "*"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, (name, st) in enumerate(results.items()):
        counts = Counter(tri(d) for d in list(st["a_dims"]) + list(st["g_dims"]))
        sizes = sorted(counts)
        ax.scatter(
            sizes,
            [counts[s] for s in sizes],
            marker=markers[i % len(markers)],
            s=28,
            alpha=0.75,
            facecolors="none" if i % 2 else None,
            label=name,
            edgecolors=f"C{i}",
            color=f"C{i}",
        )
    ax.set_xscale("log")
    ax.set_yscale("log")  # counts range from 1 to ~100; a log axis keeps the many small counts apart
    ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%d"))
    ax.set_xlabel("factor size (upper-triangle elements)")
    ax.set_ylabel("number of factors (A and G)")
    ax.set_title("Kronecker factor size distribution (3x224x224 models)")
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(results), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fmt_row(name: str, st: dict[str, object]) -> str:
    return (
        f"{name:<17}{st['params']:>13,}{st['layers']:>8}{st['num_a']:>6}{st['num_g']:>6}"
        f"{st['a_elems'] / 1e6:>11.2f}{st['g_elems'] / 1e6:>11.2f}{st['max_dim']:>9}"
    )


def main(argv: list[str] | None = None) -> dict[str, dict[str, object]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, help="registered model names")
    parser.add_argument("--out-dir", default=os.path.join("benchmarks", "results"))
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--resolution", type=int, default=224, help="input size for the arithmetic table (models *_32: 32)")
    parser.add_argument("--batch-size", type=int, default=32, help="per-worker batch for the arithmetic table")
    parser.add_argument("--factor-every", type=int, default=10, help="factor update interval for the floor")
    parser.add_argument("--workers", type=int, default=2, help="workers sharing distributed preconditioning")
    args = parser.parse_args(argv)
    for name in ("resolution", "batch_size", "factor_every", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    problem = unwritable_reason(os.path.join(args.out_dir, "model_stats.json"), make_parents=True)  # before the models are built
    if problem:
        parser.error(f"cannot write into --out-dir {args.out_dir}: {problem}")

    results: dict[str, dict[str, object]] = {}
    for name in args.models:
        t0 = time.perf_counter()
        small = name.endswith(SMALL_INPUT_SUFFIX)
        resolution, classes = (32, 10) if small else (args.resolution, args.num_classes)
        model = get_model(name, num_classes=classes)
        results[name] = model_stats(name, classes, model)
        ops = kfac_arithmetic(model, (args.batch_size, 3, resolution, resolution))
        results[name]["arithmetic"] = {
            "resolution": resolution,
            "batch_size": args.batch_size,
            "gflop": {k: v / 1e9 for k, v in ops.items()},
            "factor_every": args.factor_every,
            "workers": args.workers,
            "floor": arithmetic_floor(ops, args.factor_every),
            "floor_distributed_preconditioning": arithmetic_floor(ops, args.factor_every, args.workers),
        }
        print(f"[model_stats] {name}: {results[name]['layers']} preconditioned layers ({time.perf_counter() - t0:.2f}s)", flush=True)

    print()
    print(f"{'model':<17}{'params':>13}{'layers':>8}{'#A':>6}{'#G':>6}{'A elems(M)':>11}{'G elems(M)':>11}{'max dim':>9}")
    for name, st in results.items():
        print(_fmt_row(name, st))
    print("\npaper Table II (M = million), ours vs paper:")
    for name, st in results.items():
        if "paper" not in st:
            continue
        p, ok = st["paper"], st["matches_paper"]
        print(
            f"  {name:<14} params {st['params'] / 1e6:.1f} vs {p['params_m']} ({'ok' if ok['params_m'] else 'differs'}), "
            f"layers {st['layers']} vs {p['layers']} ({'ok' if ok['layers'] else 'differs'}), "
            f"A {st['a_elems'] / 1e6:.1f} vs {p['a_elems_m']} ({'ok' if ok['a_elems_m'] else 'differs'}), "
            f"G {st['g_elems'] / 1e6:.1f} vs {p['g_elems_m']} ({'ok' if ok['g_elems_m'] else 'differs'})"
        )

    print(
        f"\nK-FAC arithmetic per iteration (GFLOP) at {args.resolution}x{args.resolution}, batch {args.batch_size}; "
        f"floor = lowest amortised K-FAC/SGD time ratio at one FLOP rate, factors every {args.factor_every}:"
    )
    print(
        f"{'model':<17}{'fwd+bwd':>9}{'precond':>9}{'G':>8}{'A plain':>9}{'A unfold':>10}{'floor':>8}{'floor dp/' + str(args.workers):>12}"
    )
    for name, st in results.items():
        ar, gf = st["arithmetic"], st["arithmetic"]["gflop"]
        print(
            f"{name:<17}{gf['forward_backward']:>9.1f}{gf['precondition']:>9.1f}{gf['factor_g']:>8.1f}"
            f"{gf['factor_a_plain']:>9.1f}{gf['factor_a_unfolded']:>10.1f}{ar['floor']:>7.3f}x"
            f"{ar['floor_distributed_preconditioning']:>11.3f}x"
        )

    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "model_stats.json")
    png_path = os.path.join(args.out_dir, "factor_sizes.png")
    with open(json_path, "w") as fh:
        json.dump({"num_classes": args.num_classes, "models": results}, fh, indent=1)
    plot_sizes(results, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return results


if __name__ == "__main__":
    main()
