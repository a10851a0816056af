"""What preconditioning ``nn.MultiheadAttention`` costs: the explicit forward, and the four extra K-FAC blocks.

    .venv/bin/python -m benchmarks.attention_cost --model vit_s16_32 --batch-size 8

One process, three optimizers on three copies of the model, iterations
interleaved round-robin on the same inputs: plain SGD (torch's attention
forward), SPD-KFAC with the attention modules in ``skip_layers`` (torch's
forward; their projections get the plain update) and SPD-KFAC with them
preconditioned (the explicit forward, q/k/v/out_proj as four Linear layers).
Factors and inverses every ``--freq`` steps: iterations that update factors
and those that do not are reported apart, with forward+backward alone (where
the explicit forward's cost shows) and the whole iteration.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.models import get_model

from .common import machine, save_json, start, stats, workload_parser

CONFIGS = {
    "sgd": dict(precondition=False),
    "kfac-attention-skipped": dict(skip_layers=["MultiheadAttention"]),
    "kfac-attention-preconditioned": {},
}


def main() -> None:
    ap = workload_parser(__doc__, iters=20, out_name="attention_cost.json", model="vit_s16_32")
    ap.add_argument("--freq", type=int, default=5, help="factor and inverse update interval")
    ap.set_defaults(batch_size=8)
    args = ap.parse_args()
    start(args, distributed=False)
    torch.manual_seed(0)
    base = get_model(args.model, num_classes=10)
    models = {name: copy.deepcopy(base) for name in CONFIGS}
    opts = {
        name: SPDKFACOptimizer(
            models[name], lr=0.01, damping=0.03, backend="single", perf_model=args.perf_model,
            factor_update_freq=args.freq, inv_update_freq=args.freq, **kw,
        )
        for name, kw in CONFIGS.items()
    }  # fmt: skip
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution)
    y = torch.randint(0, 10, (args.batch_size,))
    samples: dict[str, dict[str, list[float]]] = {n: {"fb": [], "iter": [], "fb_factor": [], "iter_factor": []} for n in CONFIGS}
    warmup = args.freq  # the first round: step 0 decomposes everything, plans are profiled
    for it in range(warmup + args.iters):
        names = list(CONFIGS) if it % 2 else list(reversed(CONFIGS))
        for name in names:
            model, opt = models[name], opts[name]
            t0 = time.perf_counter()
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            if it >= warmup:
                factor = it % args.freq == 0 and name != "sgd"
                samples[name]["fb_factor" if factor else "fb"].append(t1 - t0)
                samples[name]["iter_factor" if factor else "iter"].append(t2 - t0)
    result = {
        "args": vars(args),
        "machine": machine(),
        "layers": {name: len(opt.layers) for name, opt in opts.items()},
        "coverage": {name: opts[name].kfac_summary().splitlines()[0] for name in CONFIGS},
        "times": {name: {k: stats(v) for k, v in s.items() if v} for name, s in samples.items()},
    }
    for name, t in result["times"].items():
        print(f"{name:32s} " + "  ".join(f"{k} {v['median'] * 1e3:.0f} ms" for k, v in t.items()))
    print(f"wrote {save_json(result, Path(args.out).name, Path(args.out).parent)}")


if __name__ == "__main__":
    main()
