"""Cost of the optimizer's hooks on iterations that do not update factors (target: <= 5%).

    .venv/bin/python -m benchmarks.hook_overhead --model resnet50

Two identical copies of the model, one with SPDKFACOptimizer's hooks attached
(on a step that is not a factor-update step, so the hooks only check and
return) and one without; forward+backward timed alternately, same inputs.
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


def main() -> None:
    ap = workload_parser(__doc__, iters=20, out_name="hook_overhead.json")
    ap.set_defaults(resolution=64, batch_size=8)
    args = ap.parse_args()
    start(args, distributed=False)
    torch.manual_seed(0)
    plain = get_model(args.model)
    hooked = copy.deepcopy(plain)
    opt = SPDKFACOptimizer(hooked, lr=0.0, backend="single", factor_update_freq=10**6, inv_update_freq=10**6)
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution)
    with torch.no_grad():
        classes = plain(x).shape[1]
    y = torch.randint(0, classes, (args.batch_size,))
    # The first step updates factors and inverses (a step always does while a layer has none; lr 0 keeps the
    # weights equal); every later pass is a non-factor step, on which the hooks only check and return.
    nn.functional.cross_entropy(hooked(x), y).backward()
    opt.step()
    times = {"plain": [], "hooked": []}
    for it in range(args.iters + 2):
        for name, model in (("plain", plain), ("hooked", hooked)) if it % 2 else (("hooked", hooked), ("plain", plain)):
            model.zero_grad()
            t0 = time.perf_counter()
            nn.functional.cross_entropy(model(x), y).backward()
            if it >= 2:
                times[name].append(time.perf_counter() - t0)
    assert not opt.kfac_step.factors.arrived["A"], "hooks computed factors on a non-factor step"
    p, h = stats(times["plain"]), stats(times["hooked"])
    ratio = h["median"] / p["median"]
    print(
        f"{args.model} @ {args.resolution}px batch {args.batch_size}: forward+backward plain {p['median'] * 1e3:.1f} ms, "
        f"with hooks {h['median'] * 1e3:.1f} ms -> overhead {100 * (ratio - 1):+.1f}% (target <= +5%)"
    )
    result = {"args": vars(args), "machine": machine(), "plain": p, "hooked": h, "ratio": ratio}
    print(f"wrote {save_json(result, Path(args.out).name, Path(args.out).parent)}")


if __name__ == "__main__":
    main()
