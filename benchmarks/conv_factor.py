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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from spdkfac.kfac.conv_gram import conv_input_gram
from spdkfac.kfac.layer_types import ConvHelper, make_helper
from spdkfac.kfac.linalg import symmetric_gram

from .common import one_process_parser, save_result, stats

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


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(iters: int, quick: bool = False) -> dict[str, dict[str, object]]:
    """Per layer: seconds of both routes (interleaved rounds), the route the rule takes, and the factors' difference."""
    rows: dict[str, dict[str, object]] = {}
    for name, (build, shape) in LAYERS.items():
        if quick:
            shape = (2, *shape[1:2], *(max(2, s // 4) for s in shape[2:]))
        torch.manual_seed(0)
        helper = make_helper(build())
        assert isinstance(helper, ConvHelper)
        x = torch.randn(shape)
        shared, im2col = _shared(helper, x), _im2col(helper, x)
        difference = float((shared - im2col).abs().max() / im2col.abs().max())
        shared_s, im2col_s = [], []
        for _ in range(iters):
            shared_s.append(_seconds(partial(_shared, helper, x)))
            im2col_s.append(_seconds(partial(_im2col, helper, x)))
        shared_ms, im2col_ms = stats(shared_s)["median"], stats(im2col_s)["median"]
        work = helper.shared_shift_work(x)
        assert work is not None
        takes = "shared" if helper.shared_gram(x) is not None else "im2col"
        rows[name] = {
            "input": list(shape),
            "a_dim": helper.a_shape.dim,
            "im2col_multiply_adds": work.im2col_multiply_adds,
            "shared_cost": work.cost(),
            "shared": stats(shared_s),
            "im2col": stats(im2col_s),
            "shared_over_im2col": shared_ms / im2col_ms,
            "rule_takes": takes,
            "rule_takes_the_faster": (takes == "shared") == (shared_ms <= im2col_ms),
            "max_relative_difference": difference,
        }
        print(f"{name}: shared/im2col {shared_ms / im2col_ms:.2f}, the rule takes {takes}, factors apart by {difference:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = one_process_parser(
        __doc__,
        "conv_factor.json",
        ("--iters", 7, "timed rounds per layer (each times both routes)"),
        "inputs 4x smaller per side, batch 2 (to test the benchmark)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    save_result(args, "layers", measure(args.iters, args.quick))


if __name__ == "__main__":
    main()
