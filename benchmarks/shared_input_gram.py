"""Linear layers reading one input: its Gram computed once, against once per layer, on a Llama-style model's factor steps.

    python -m benchmarks.shared_input_gram

In a Llama-style block q, k and v read one normalised input, and so do the
MLP's gate and up: five of the seven ``A`` factors are two distinct Grams.
:mod:`spdkfac.kfac.layer_types.shared_input` computes each once and copies it.
This times whole iterations (forward, backward, ``step()``) on factor steps
(factors every step, decompositions only at the first), for two copies of one
model stepped in alternation on the same batches: one optimizer shares the
Grams, the other computes each (its Linear layers' cache taken away). It
records the Grams computed per step in each arm, the medians, their ratio,
and whether the two arms' parameters are bitwise equal at the end (they must
be: the copy is the same values).
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.layer_types import LinearHelper
from spdkfac.models.llama import CharLlama

from .common import one_process_parser, save_result, stats

#: name -> (width, heads, MLP width, context, batch): a char-level size and a wider one (Llama's MLP at ~8/3).
SIZES: dict[str, tuple[int, int, int, int, int]] = {
    "char_llama (width 128, 64 tokens, batch 32)": (128, 4, 344, 64, 32),
    "width 512, 128 tokens, batch 16": (512, 8, 1376, 128, 16),
}


def _counting(arm: list[int]) -> Any:
    """``LinearHelper._input_gram`` that counts its calls into ``arm``."""
    compute = LinearHelper._input_gram

    def counted(helper: LinearHelper, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        arm.append(1)
        return compute(helper, x, dtype)

    return counted


def measure(steps: int, quick: bool = False) -> dict[str, dict[str, Any]]:
    """Per size: seconds per factor step in each arm (interleaved), Grams per step, and the arms' bitwise agreement."""
    rows: dict[str, dict[str, Any]] = {}
    original = LinearHelper._input_gram
    for name, (dim, heads, mlp, context, batch) in SIZES.items():
        if quick:
            dim, heads, mlp, context, batch = 16, 2, 40, 8, 2
        arms: dict[str, dict[str, Any]] = {}
        for arm in ("shared", "apart"):
            torch.manual_seed(0)
            model = CharLlama(97, context, dim, 2, heads, mlp)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # (no perf_model: the default's, alike in both arms)
                opt = SPDKFACOptimizer(model, lr=0.01, backend="single", factor_update_freq=1, inv_update_freq=10**6)
            if arm == "apart":
                for layer in opt.layers:
                    if isinstance(layer.helper, LinearHelper):
                        layer.helper.shared = None
            arms[arm] = {"model": model, "opt": opt, "seconds": [], "grams": []}
        data = torch.Generator().manual_seed(1)
        try:
            for step in range(steps + 1):
                ids = torch.randint(0, 97, (batch, context + 1), generator=data)
                for arm in arms.values():
                    counted: list[int] = []
                    LinearHelper._input_gram = _counting(counted)  # type: ignore[method-assign]
                    start = time.perf_counter()
                    arm["opt"].zero_grad()
                    F.cross_entropy(arm["model"](ids[:, :-1]), ids[:, 1:]).backward()
                    arm["opt"].step()
                    if step:  # (the first step decomposes too)
                        arm["seconds"].append(time.perf_counter() - start)
                        arm["grams"].append(len(counted))
        finally:
            LinearHelper._input_gram = original  # type: ignore[method-assign]
        shared, apart = arms["shared"], arms["apart"]
        equal = all(torch.equal(a, b) for a, b in zip(shared["model"].parameters(), apart["model"].parameters()))
        rows[name] = {
            "width": dim,
            "tokens_per_step": batch * context,
            "grams_per_step": {"shared": shared["grams"][0], "apart": apart["grams"][0]},
            "shared": stats(shared["seconds"]),
            "apart": stats(apart["seconds"]),
            "speedup": stats(apart["seconds"])["median"] / stats(shared["seconds"])["median"],
            "parameters_bitwise_equal": equal,
        }
        row = rows[name]
        print(
            f"{name}: Linear Grams per step {row['grams_per_step']['apart']} -> {row['grams_per_step']['shared']}, "
            f"factor step {row['speedup']:.3f}x faster, parameters bitwise equal: {equal}",
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = one_process_parser(
        __doc__,
        "shared_input_gram.json",
        ("--steps", 15, "timed factor steps per arm (after one untimed)"),
        "a tiny model (to test the benchmark)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    save_result(args, "models", measure(args.steps, args.quick))


if __name__ == "__main__":
    main()
