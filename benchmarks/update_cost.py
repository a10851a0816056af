"""Where an iteration's time goes, for update fusion: the separate update pass against forward + backward.

    python -m benchmarks.update_cost --model mobilenet_v2_32 --batch-size 32

Fusing the update into the forward or backward pass can save at most what the
separate update pass costs: re-reading every parameter, gradient and momentum
buffer, cold (on a GPU also a few kernel launches per parameter). This times,
interleaved in one process, forward + backward and the unfused momentum-SGD
update (weight decay on), and reports the update's share of the iteration and
the memory bandwidth it reaches (9 tensor passes of 4 bytes per parameter:
``grad + wd*p``, the momentum buffer, the parameter).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn as nn

from spdkfac.models import get_model
from spdkfac.update.base_update import apply_base_update

from .common import log, machine, save_json, start, workload_parser

PASSES = 9  # tensors read or written per parameter element by momentum SGD with weight decay


def measure_passes(model: nn.Module, batch_size: int, resolution: int, iters: int) -> tuple[list[float], list[float]]:
    """Seconds of forward + backward and of the unfused momentum-SGD update, ``iters`` interleaved repetitions each."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": params, "lr": 1e-4, "momentum": 0.9, "weight_decay": 5e-4}]
    state: dict[torch.Tensor, dict] = {p: {} for p in params}
    x = torch.randn(batch_size, 3, resolution, resolution)
    y = torch.randint(0, 10, (batch_size,))
    fwd_bwd, update = [], []
    for i in range(iters + 2):  # two warm-up repetitions (the momentum buffers are made in the first)
        t0 = time.perf_counter()
        for p in params:
            p.grad = None
        nn.functional.cross_entropy(model(x), y).backward()
        t1 = time.perf_counter()
        with torch.no_grad():
            apply_base_update("sgd", groups, state)
        t2 = time.perf_counter()
        if i >= 2:
            fwd_bwd.append(t1 - t0)
            update.append(t2 - t1)
    return fwd_bwd, update


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__, iters=20, out_name="update_cost.json", model="mobilenet_v2_32")
    args = ap.parse_args(argv)
    start(args, distributed=False)
    torch.manual_seed(0)
    model = get_model(args.model)
    params = [p for p in model.parameters() if p.requires_grad]
    fwd_bwd, update = measure_passes(model, args.batch_size, args.resolution, args.iters)
    numel = sum(p.numel() for p in params)
    fb, up = statistics.median(fwd_bwd), statistics.median(update)
    result = {
        "args": vars(args),
        "machine": machine(),
        "model": args.model,
        "parameters": numel,
        "tensors": len(params),
        "fwd_bwd_s": fb,
        "update_s": up,
        "update_share": up / (fb + up),
        "update_bytes": PASSES * 4 * numel,
        "update_gb_per_s": PASSES * 4 * numel / up / 1e9,
        "samples": {"fwd_bwd": fwd_bwd, "update": update},
    }
    path = save_json(result, Path(args.out).name, Path(args.out).parent)
    log(
        0,
        f"{args.model}, batch {args.batch_size}: forward+backward {fb * 1e3:.1f} ms, update {up * 1e3:.2f} ms "
        f"({result['update_share']:.1%} of the iteration; {len(params)} tensors, {numel / 1e6:.2f} M parameters, "
        f"{result['update_gb_per_s']:.1f} GB/s); wrote {path}",
    )


if __name__ == "__main__":
    main()
