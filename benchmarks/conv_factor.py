"""A stride-1 convolution's ``A`` factor on the CPU: shared shifts against the im2col rows' one product.

    python -m benchmarks.conv_factor

On a CPU ``ConvHelper.input_gram`` takes a stride-1 k x k convolution's ``A``
from shared shifts (:mod:`spdkfac.kfac.conv_gram`) where its cost model
(``SharedShiftWork.pays``) expects them to be faster, else from the im2col
rows and one product. This times both routes, alternately, on the
convolutions of the zoo's models and of common ones, says which route the
rule takes and whether it is the faster one, and records how far the two
factors are apart (rounding only: the same sums, reassociated). Medians of
``--iters`` rounds, float32, ``--threads`` threads.

Then, for convolutions whose im2col rows exceed ``IM2COL_ROWS_BYTES`` (a
strided stem and downsampling layer, a 3-D convolution), it times the
shipped Gram (rows built a few samples at a time, the parts' Grams summed)
against the rows built at once, with the rows each holds at a time.

Last, the grid the cost model was fitted on (3x3 and 5x5 kernels, 2x2 to
16x16 maps, 8 to 512 channels, batch 8 and 64): how often the rule takes the
faster route, and the time it loses against always taking the faster one,
next to always taking either.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn as nn

from spdkfac.kfac.conv_gram import conv_input_gram
from spdkfac.kfac.layer_types import ConvHelper, LayerHelper, make_helper
from spdkfac.kfac.layer_types import conv as conv_types
from spdkfac.kfac.layer_types.conv import sample_chunks
from spdkfac.kfac.linalg import symmetric_gram

from .common import machine, one_process_parser, save_json, seconds, stats

#: name -> (the convolution, its input's shape): the zoo's small models, CIFAR ResNets, ResNet-50's 3x3 layers.
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "digits CNN 3x3, 1->16 at 8x8 (batch 32)": (lambda: nn.Conv2d(1, 16, 3, padding=1), (32, 1, 8, 8)),
    "digits CNN 3x3, 16->32 at 8x8 (batch 32)": (lambda: nn.Conv2d(16, 32, 3, padding=1), (32, 16, 8, 8)),
    "digits CNN 3x3, 32->32 at 4x4 (batch 32)": (lambda: nn.Conv2d(32, 32, 3, padding=1), (32, 32, 4, 4)),
    "MNIST CNN 5x5, 1->16 at 28x28 (batch 64)": (lambda: nn.Conv2d(1, 16, 5, padding=2), (64, 1, 28, 28)),
    "MNIST CNN 5x5, 16->32 at 14x14 (batch 64)": (lambda: nn.Conv2d(16, 32, 5, padding=2), (64, 16, 14, 14)),
    "CIFAR ResNet-20 3x3, 16->16 at 32x32 (batch 128)": (lambda: nn.Conv2d(16, 16, 3, padding=1, bias=False), (128, 16, 32, 32)),
    "CIFAR ResNet-18 3x3, 64->64 at 32x32 (batch 32)": (lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False), (32, 64, 32, 32)),
    "CIFAR ResNet-18 3x3, 512->512 at 4x4 (batch 32)": (lambda: nn.Conv2d(512, 512, 3, padding=1, bias=False), (32, 512, 4, 4)),
    "ResNet-50 3x3, 64->64 at 56x56 (batch 8)": (lambda: nn.Conv2d(64, 64, 3, padding=1, bias=False), (8, 64, 56, 56)),
    "ResNet-50 3x3, 256->256 at 14x14 (batch 8)": (lambda: nn.Conv2d(256, 256, 3, padding=1, bias=False), (8, 256, 14, 14)),
    "ResNet-50 3x3, 512->512 at 7x7 (batch 8)": (lambda: nn.Conv2d(512, 512, 3, padding=1, bias=False), (8, 512, 7, 7)),
}


def _im2col(helper: ConvHelper, x: torch.Tensor) -> torch.Tensor:
    rows = helper.input_rows(x)
    if helper.has_bias:
        rows = torch.cat([rows, rows.new_ones(rows.shape[0], 1)], dim=1)
    return symmetric_gram(rows)


def _shared(helper: ConvHelper, x: torch.Tensor) -> torch.Tensor:
    result = conv_input_gram(x, helper.kernel_size, helper.padding, helper.dilation, helper.has_bias)
    assert result is not None
    return result[0]


#: name -> (the convolution, its input's shape): layers whose im2col rows exceed IM2COL_ROWS_BYTES (64 MB).
IN_PARTS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "ResNet-50 stem 7x7 s2, 3->64 at 224x224 (batch 32)": (lambda: nn.Conv2d(3, 64, 7, 2, 3, bias=False), (32, 3, 224, 224)),
    "ResNet-50 3x3 s2, 128->128 at 56x56 (batch 32)": (lambda: nn.Conv2d(128, 128, 3, 2, 1, bias=False), (32, 128, 56, 56)),
    "3-D 3x3x3 s2, 32->64 at 32^3 (batch 8)": (lambda: nn.Conv3d(32, 64, 3, 2, 1), (8, 32, 32, 32, 32)),
}


def _at_once(helper: LayerHelper, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The Gram with every sample's rows built at once (no budget)."""
    budget = conv_types.IM2COL_ROWS_BYTES
    conv_types.IM2COL_ROWS_BYTES = 1 << 62
    try:
        return helper.input_gram(x, torch.float32)
    finally:
        conv_types.IM2COL_ROWS_BYTES = budget


def measure_parts(iters: int, quick: bool = False) -> dict[str, dict[str, object]]:
    """Per layer: seconds of the Gram from rows in parts and at once (interleaved), the rows held, the difference."""
    out: dict[str, dict[str, object]] = {}
    budget = conv_types.IM2COL_ROWS_BYTES
    for name, (build, shape) in IN_PARTS.items():
        if quick:
            shape = (4, *shape[1:2], *(max(4, s // 8) for s in shape[2:]))
        torch.manual_seed(0)
        helper = make_helper(build())
        x = torch.randn(shape)
        whole, rows = _at_once(helper, x)
        width = helper.a_shape.dim * helper.a_shape.blocks
        row_bytes = rows * width * x.element_size()
        if quick:  # (small inputs: a budget of a third of their rows, so that they still come in parts)
            conv_types.IM2COL_ROWS_BYTES = max(1, row_bytes // 3)
        try:
            parts = len(sample_chunks(x, row_bytes // x.shape[0]))
            in_parts, _ = helper.input_gram(x, torch.float32)
            difference = float((in_parts - whole).abs().max() / whole.abs().max())
            parts_s, once_s = [], []
            for _ in range(iters):
                parts_s.append(seconds(partial(helper.input_gram, x, torch.float32)))
                once_s.append(seconds(partial(_at_once, helper, x)))
        finally:
            conv_types.IM2COL_ROWS_BYTES = budget
        out[name] = {
            "input": list(shape),
            "a_dim": helper.a_shape.dim,
            "parts": parts,
            "rows_bytes_at_once": row_bytes,
            "rows_bytes_per_part": -(-row_bytes // parts),
            "in_parts": stats(parts_s),
            "at_once": stats(once_s),
            "parts_over_at_once": stats(parts_s)["median"] / stats(once_s)["median"],
            "max_relative_difference": difference,
        }
        print(f"{name}: {parts} parts, in parts / at once {out[name]['parts_over_at_once']:.2f}, apart by {difference:.1e}", flush=True)
    return out


def _time_routes(helper: ConvHelper, x: torch.Tensor, iters: int) -> dict[str, object]:
    """Both routes timed in alternation on ``x``, the route the rule takes, and the factors' difference."""
    shared, im2col = _shared(helper, x), _im2col(helper, x)
    difference = float((shared - im2col).abs().max() / im2col.abs().max())
    shared_s, im2col_s = [], []
    for _ in range(iters):
        shared_s.append(seconds(partial(_shared, helper, x)))
        im2col_s.append(seconds(partial(_im2col, helper, x)))
    shared_ms, im2col_ms = stats(shared_s)["median"], stats(im2col_s)["median"]
    work = helper.shared_shift_work(x)
    assert work is not None
    takes = "shared" if helper.shared_gram(x) is not None else "im2col"
    return {
        "input": list(x.shape),
        "a_dim": helper.a_shape.dim,
        "im2col_multiply_adds": work.im2col_multiply_adds,
        "shared_cost": work.cost(torch.get_num_threads()),
        "shared": stats(shared_s),
        "im2col": stats(im2col_s),
        "shared_over_im2col": shared_ms / im2col_ms,
        "rule_takes": takes,
        "rule_takes_the_faster": (takes == "shared") == (shared_ms <= im2col_ms),
        "max_relative_difference": difference,
    }


def measure(iters: int, quick: bool = False) -> dict[str, dict[str, object]]:
    """Per layer: seconds of both routes (interleaved rounds), the route the rule takes, and the factors' difference."""
    rows: dict[str, dict[str, object]] = {}
    for name, (build, shape) in LAYERS.items():
        if quick:
            shape = (2, *shape[1:2], *(max(2, s // 4) for s in shape[2:]))
        torch.manual_seed(0)
        helper = make_helper(build())
        assert isinstance(helper, ConvHelper)
        rows[name] = row = _time_routes(helper, torch.randn(shape), iters)
        print(f"{name}: shared/im2col {row['shared_over_im2col']:.2f}, the rule takes {row['rule_takes']}", flush=True)
    return rows


def _grid(quick: bool) -> list[tuple[int, int, int, int]]:
    """(kernel, map side, channels, batch) of the grid the cost model was fitted on, its im2col work 1e6-3e10."""
    if quick:
        return [(3, 2, 8, 8), (3, 8, 32, 8), (5, 4, 8, 8)]
    cases = itertools.product((3, 5), (2, 4, 8, 16), (8, 32, 128, 512), (8, 64))
    return [(k, h, c, n) for k, h, c, n in cases if 1e6 <= n * h * h * (c * k * k) ** 2 <= 3e10]


def measure_grid(iters: int, quick: bool = False) -> dict[str, object]:
    """The rule on the fitting grid: each case timed both ways, and the time lost against always taking the faster
    route (the sum over the cases of log(route's median / faster median)) for the rule and for either route alone."""
    cases: dict[str, dict[str, object]] = {}
    for k, h, c, n in _grid(quick):
        torch.manual_seed(0)
        helper = make_helper(nn.Conv2d(c, c, k, padding=k // 2, bias=False))
        assert isinstance(helper, ConvHelper)
        row = _time_routes(helper, torch.randn(n, c, h, h), max(3, iters // 2))
        cases[f"{k}x{k}, {c} channels at {h}x{h} (batch {n})"] = row
    lost = {"rule": 0.0, "always_shared": 0.0, "always_im2col": 0.0}
    worst = 1.0
    for row in cases.values():
        ratio = float(row["shared_over_im2col"])  # (a float: _time_routes)
        shared_loss, im2col_loss = max(0.0, math.log(ratio)), max(0.0, -math.log(ratio))
        rule_loss = shared_loss if row["rule_takes"] == "shared" else im2col_loss
        lost["rule"] += rule_loss
        lost["always_shared"] += shared_loss
        lost["always_im2col"] += im2col_loss
        worst = max(worst, math.exp(rule_loss))
    faster = sum(bool(row["rule_takes_the_faster"]) for row in cases.values())
    print(f"grid: the rule takes the faster route in {faster} of {len(cases)} cases; log time lost {lost}", flush=True)
    return {"cases": cases, "rule_takes_the_faster": faster, "log_time_lost": lost, "rule_worst": worst}


def main(argv: list[str] | None = None) -> None:
    ap = one_process_parser(
        __doc__,
        "conv_factor.json",
        ("--iters", 7, "timed rounds per layer (each times both routes)"),
        "inputs 4x smaller per side, batch 2 (to test the benchmark)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result = {"args": vars(args), "machine": machine(), "layers": measure(args.iters, args.quick)}
    result["in_parts"] = measure_parts(args.iters, args.quick)
    result["grid"] = measure_grid(args.iters, args.quick)
    out = Path(args.out)
    print(f"wrote {save_json(result, out.name, out.parent)}")


if __name__ == "__main__":
    main()
