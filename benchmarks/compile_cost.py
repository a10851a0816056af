"""torch.compile with K-FAC: step time compiled vs eager, graph breaks and recompilations (one process, CPU).

    .venv/bin/python -m benchmarks.compile_cost --models mnist_cnn cifar_resnet20

Per model, five arms on copies of one initialisation and the same batch:
momentum SGD eager and compiled, ``SPDKFACOptimizer`` eager and compiled
(factors and inverses every ``--freq`` steps). Each arm's first steps
compile it (their time is reported apart, with the graph breaks and graphs
Dynamo made); then one step of every arm per round, the arms' order
rotating, ``--iters`` rounds. Then, alone (after ``torch._dynamo.reset()``),
the compiled model with the factor hooks registered as plain hooks, what the
optimizer did before ``spdkfac.step.compiled_hooks``: Dynamo traces them,
with graph breaks and recompilations. A step is zero_grad, forward,
backward and the optimizer's step; its median is a step without a factor
update, its mean the amortised step. Dynamo guards on the modules' hooks
here (``skip_nnmodule_hook_guards=False``), else the arms, instances of one
class, would share the first one's graph.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch._dynamo.utils import counters

from spdkfac import SPDKFACOptimizer
from spdkfac.models import get_model
from spdkfac.step import compiled_hooks

from .common import machine, save_json, start, stats, workload_parser

#: model -> input channels and side of its images
INPUTS = {"mnist_cnn": (1, 28), "digits_cnn": (1, 8), "cifar_resnet20": (3, 32), "mnist_mobilenet": (1, 28)}
ARMS = ("sgd-eager", "sgd-compiled", "kfac-eager", "kfac-compiled")
BEFORE = "kfac-compiled-plain-hooks"
WARMUP = 3


def build(arm: str, net: nn.Module, freq: int, perf_model: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model an arm runs and its optimizer."""
    model = torch.compile(net) if "compiled" in arm else net
    if arm.startswith("sgd"):
        return model, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    tapped = compiled_hooks.TAPS_AVAILABLE
    compiled_hooks.TAPS_AVAILABLE = tapped and not arm.endswith("plain-hooks")  # (read when the hooks are registered)
    try:
        opt = SPDKFACOptimizer(model, lr=0.01, factor_update_freq=freq, inv_update_freq=freq, backend="single", perf_model=perf_model)
    finally:
        compiled_hooks.TAPS_AVAILABLE = tapped
    return model, opt


def step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    t0 = time.perf_counter()
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - t0


def warm_up(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The first steps (they compile): their times, and the graph breaks and graphs Dynamo made."""
    breaks0, graphs0 = dynamo_counts()
    first = [step(model, opt, x, y) for _ in range(WARMUP)]
    breaks1, graphs1 = dynamo_counts()
    return {"warmup_seconds": first, "graph_breaks": breaks1 - breaks0, "graphs": graphs1 - graphs0, "times": []}


def dynamo_counts() -> tuple[int, int]:
    """(graph breaks, graphs compiled) so far in this process."""
    return sum(counters["graph_break"].values()), int(counters["stats"]["unique_graphs"])


def measure(name: str, args: Any) -> dict[str, Any]:
    channels, side = INPUTS.get(name, (3, args.resolution))
    torch.manual_seed(0)
    net = get_model(name)
    x = torch.randn(args.batch_size, channels, side, side)
    with torch.no_grad():
        y = torch.randint(0, net(x).shape[1], (args.batch_size,))
    runs = {arm: build(arm, copy.deepcopy(net), args.freq, args.perf_model) for arm in ARMS}
    result: dict[str, Any] = {arm: warm_up(*runs[arm], x, y) for arm in ARMS}
    _, graphs_before = dynamo_counts()
    for it in range(args.iters):
        shift = it % len(ARMS)
        for arm in ARMS[shift:] + ARMS[:shift]:
            result[arm]["times"].append(step(*runs[arm], x, y))
    result["graphs_compiled_while_measuring"] = dynamo_counts()[1] - graphs_before
    torch._dynamo.reset()  # the plain hooks alone: their graphs and guards would crowd the other arms' cache entries
    before = build(BEFORE, copy.deepcopy(net), args.freq, args.perf_model)
    result[BEFORE] = warm_up(*before, x, y)
    graphs_before = dynamo_counts()[1]
    result[BEFORE]["times"] = [step(*before, x, y) for _ in range(args.iters)]
    result[BEFORE]["graphs_compiled_while_measuring"] = dynamo_counts()[1] - graphs_before
    for arm in (*ARMS, BEFORE):
        result[arm]["stats"] = stats(result[arm]["times"])
    for kind in ("sgd", "kfac"):
        for stat in ("median", "mean"):
            result[f"{kind}_compiled_over_eager_{stat}"] = (
                result[f"{kind}-compiled"]["stats"][stat] / result[f"{kind}-eager"]["stats"][stat]
            )
    print(
        f"{name}: "
        + ", ".join(
            f"{arm} {result[arm]['stats']['median'] * 1e3:.1f}/{result[arm]['stats']['mean'] * 1e3:.1f} ms" for arm in (*ARMS, BEFORE)
        )
        + f" (median/mean); graph breaks {[result[arm]['graph_breaks'] for arm in (*ARMS, BEFORE)]}, graphs "
        f"{[result[arm]['graphs'] for arm in (*ARMS, BEFORE)]}, compiled while measuring {result['graphs_compiled_while_measuring']} "
        f"(plain hooks: {result[BEFORE]['graphs_compiled_while_measuring']})",
        flush=True,
    )
    torch._dynamo.reset()
    return result


def main() -> None:
    # The arms are instances of one class: without hook guards Dynamo would run the first arm's graph for all of them.
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    ap = workload_parser(__doc__, iters=30, out_name="compile_cost.json")
    ap.add_argument("--models", nargs="+", default=["mnist_cnn", "cifar_resnet20"])
    ap.add_argument("--freq", type=int, default=10, help="factor and inverse update interval of the K-FAC arms")
    ap.set_defaults(batch_size=32)
    args = ap.parse_args()
    start(args, distributed=False)
    result = {"args": vars(args), "machine": machine(), "models": {name: measure(name, args) for name in args.models}}
    print(f"wrote {save_json(result, Path(args.out).name, Path(args.out).parent)}")


if __name__ == "__main__":
    main()
