"""A transposed convolution's ``A`` factor: by stride residue class against the Gram of the zero-filled patches.

    python -m benchmarks.transposed_conv_factor

``ConvTransposeHelper.input_gram`` takes ``A`` per residue class of the
output position modulo the stride, each class the patches of a plain
stride-1 convolution of the input (:mod:`spdkfac.kfac.layer_types.conv_transpose`).
This times it, alternately with the convolution helper's Gram of the whole
zero-filled patches of the equivalent convolution (what the layer would cost
without the classes), on the up-sampling layers of common decoders, and
records how far the two factors are apart (rounding only: the same sums,
reassociated). Medians of ``--iters`` rounds, float32, ``--threads`` threads.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn as nn

from spdkfac.kfac.layer_types import ConvTransposeHelper, make_helper

from .common import one_process_parser, save_result, seconds, stats

#: name -> (the layer, its input's shape): the up-sampling steps of a DCGAN generator, U-Nets and a conv decoder.
LAYERS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "DCGAN 4x4 s2, 512->256 at 8x8 (batch 64)": (lambda: nn.ConvTranspose2d(512, 256, 4, 2, 1, bias=False), (64, 512, 8, 8)),
    "DCGAN 4x4 s2, 128->64 at 32x32 (batch 64)": (lambda: nn.ConvTranspose2d(128, 64, 4, 2, 1, bias=False), (64, 128, 16, 16)),
    "U-Net 2x2 s2, 512->256 at 56x56 (batch 8)": (lambda: nn.ConvTranspose2d(512, 256, 2, 2), (8, 512, 28, 28)),
    "U-Net 2x2 s2, 128->64 at 224x224 (batch 8)": (lambda: nn.ConvTranspose2d(128, 64, 2, 2), (8, 128, 112, 112)),
    "decoder 3x3 s2 p1 op1, 32->16 at 14x14 (batch 128)": (
        lambda: nn.ConvTranspose2d(32, 16, 3, 2, 1, output_padding=1),
        (128, 32, 7, 7),
    ),
    "1-D 4 s2 p1, 256->128 at 2048 (batch 16)": (lambda: nn.ConvTranspose1d(256, 128, 4, 2, 1), (16, 256, 1024)),
    "3-D U-Net 2x2x2 s2, 64->32 at 32^3 (batch 2)": (lambda: nn.ConvTranspose3d(64, 32, 2, 2), (2, 64, 16, 16, 16)),
}


def _zero_filled(helper: ConvTransposeHelper, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The equivalent convolution's Gram of the whole zero-filled patches (with preparing its input)."""
    return helper.equivalent.input_gram(helper.prepared(x), torch.float32)


def measure(iters: int, quick: bool = False) -> dict[str, dict[str, object]]:
    """Per layer: seconds of both Grams (interleaved rounds), their ratio and the factors' largest relative difference."""
    rows: dict[str, dict[str, object]] = {}
    for name, (build, shape) in LAYERS.items():
        if quick:
            shape = (2, *shape[1:2], *(max(2, s // 8) for s in shape[2:]))
        torch.manual_seed(0)
        helper = make_helper(build())
        assert isinstance(helper, ConvTransposeHelper)
        x = torch.randn(shape)
        by_class, _ = helper.input_gram(x, torch.float32)
        whole, _ = _zero_filled(helper, x)
        difference = float((by_class - whole).abs().max() / whole.abs().max())
        classes, zero_filled = [], []
        for _ in range(iters):
            classes.append(seconds(partial(helper.input_gram, x, torch.float32)))
            zero_filled.append(seconds(partial(_zero_filled, helper, x)))
            helper.forget()
        rows[name] = {
            "input": list(shape),
            "a_dim": helper.a_shape.dim,
            "classes": stats(classes),
            "zero_filled": stats(zero_filled),
            "speedup": stats(zero_filled)["median"] / stats(classes)["median"],
            "max_relative_difference": difference,
        }
        print(f"{name}: {rows[name]['speedup']:.1f}x, factors apart by {difference:.1e}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = one_process_parser(
        __doc__,
        "transposed_conv_factor.json",
        ("--iters", 7, "timed rounds per layer (each times both Grams)"),
        "inputs 8x smaller per side, batch 2 (to test the benchmark)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    save_result(args, "layers", measure(args.iters, args.quick))


if __name__ == "__main__":
    main()
