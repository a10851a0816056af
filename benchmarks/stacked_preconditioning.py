"""Same-shape layers preconditioned stacked against layer by layer: ``step()``'s time on the machine at hand.

    python -m benchmarks.stacked_preconditioning

:mod:`spdkfac.step.stacked_preconditioning` preconditions the layers of one
shape with one batched product pair. On a GPU that removes kernel launches,
which pace a transformer's step there (docs/experiments/gpu.md; timed on the
card by ``scripts/gpu_check.sh``). This measures whether it pays where the
arithmetic paces the step, the CPU: two optimizers on two copies of each
model, one stacking and one not, stepped in alternation (K-FAC amortised:
factors every 10 steps, inverses every 100); the time of ``step()`` on the
plain steps (no factors, no decompositions), medians. The default,
``stack_groups=None``, stacks on a GPU only, from this measurement.

It also counts the ATen operations one plain ``step()`` issues in each arm,
views and aliases left out, and a multi-tensor operation as the kernels a
GPU runs for it (one where its tensors are dense and laid out alike, else
one per tensor): on a GPU each is a kernel launch, and launches pace a
transformer's step there. They are counted as this machine runs the step,
and as a GPU would: with the choices the library makes by device taken the
GPU's way (the finiteness check by one multi-tensor norm instead of a sum
per parameter, the KL clip's products summed once per stack, the
write-back's copies sorted by layout).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from spdkfac import make_optimizer
from spdkfac.kfac import linalg
from spdkfac.models import get_model
from spdkfac.step import gradient_views, preconditioning
from spdkfac.step.gradient_views import same_layout

from .common import one_process_parser, save_result, stats

#: name -> (zoo model, resolution, batch): a convolutional network with repeated blocks and a transformer.
MODELS = {"resnet50 32x32, batch 8": ("resnet50", 32, 8), "vit_s16_32 32x32, batch 8": ("vit_s16_32", 32, 8)}
QUICK_MODELS = {"cifar_resnet20 32x32, batch 4": ("cifar_resnet20", 32, 4)}


class OperationCount(TorchDispatchMode):
    """Counts the ATen operations run inside it that compute (views and aliases are not counted), a multi-tensor
    operation as the kernels a GPU runs for it: one where every tensor is dense and laid out as its partners in
    the other lists (ATen's fast path), else one per tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.count += kernels(str(func.overloadpacket), args)
        return func(*args, **(kwargs or {}))


def kernels(name: str, args: Any) -> int:
    """The kernels a GPU runs for one operation (multi-tensor ones: see :class:`OperationCount`)."""
    if not name.startswith("aten._foreach_"):
        return 1
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and all(isinstance(t, torch.Tensor) for t in a)]
    first = lists[0]
    one_dtype = all(len({t.dtype for t in tensors}) == 1 for tensors in lists)
    alike = all(same_layout(tensors[i], first[i]) for tensors in lists for i in range(len(first)))
    return 1 if one_dtype and alike else len(first)


@contextlib.contextmanager
def gpu_choices() -> Iterator[None]:
    """The library's device-dependent choices of a plain step taken as on a GPU, whatever the device."""
    saved = linalg.checks_by_norm, preconditioning.sums_stacks_at_once, gradient_views.copies_by_layout
    linalg.checks_by_norm = preconditioning.sums_stacks_at_once = gradient_views.copies_by_layout = lambda device: True  # type: ignore[assignment]
    try:
        yield
    finally:
        linalg.checks_by_norm, preconditioning.sums_stacks_at_once, gradient_views.copies_by_layout = saved  # type: ignore[assignment]


def count_plain_step(model: nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> int:
    """The operations of the next plain step (steps taken until one is next)."""
    while True:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if opt.steps % 10 != 0:
            break
        opt.step()
    with OperationCount() as counted:
        opt.step()
    return counted.count


def measure(model_name: str, resolution: int, batch: int, steps: int) -> dict[str, Any]:
    """Both arms' ``step()`` seconds on plain steps, and how many layers were stacked in how many groups."""
    warnings.filterwarnings("ignore", message="no perf_model given")
    arms: dict[bool, tuple[nn.Module, Any]] = {}
    for stacked in (False, True):
        torch.manual_seed(0)
        model = get_model(model_name)
        opt = make_optimizer("spdkfac", model, backend="single", lr=0.1, momentum=0.9, factor_update_freq=10, inv_update_freq=100)
        opt.kfac_step.preconditioner.stack_groups = stacked
        arms[stacked] = (model, opt)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 3, resolution, resolution, generator=g)
    y = torch.randint(0, 10, (batch,), generator=g)
    seconds: dict[bool, list[float]] = {False: [], True: []}
    for i in range(steps):
        for stacked in (False, True) if i % 2 else (True, False):  # (each arm first in every other round)
            model, opt = arms[stacked]
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            plain = opt.steps % 10 != 0
            start = time.perf_counter()
            opt.step()
            if plain and i >= 2:
                seconds[stacked].append(time.perf_counter() - start)
    operations, as_on_gpu = {}, {}
    for stacked, (model, opt) in arms.items():
        operations[stacked] = count_plain_step(model, opt, x, y)
        with gpu_choices():
            as_on_gpu[stacked] = count_plain_step(model, opt, x, y)
    opt = arms[True][1]
    groups = [g for g in opt.kfac_step.preconditioner.stacks.groups(opt.layers) if len(g) > 1]
    return {
        "layers": len(opt.layers),
        "groups": len(groups),
        "stacked_layers": sum(map(len, groups)),
        "per_layer": stats(seconds[False]),
        "stacked": stats(seconds[True]),
        "ratio": stats(seconds[True])["median"] / stats(seconds[False])["median"],
        "operations": {"per_layer": operations[False], "stacked": operations[True]},
        "operations_as_on_gpu": {"per_layer": as_on_gpu[False], "stacked": as_on_gpu[True]},
    }


def main(argv: list[str] | None = None) -> None:
    ap = one_process_parser(
        __doc__,
        "stacked_preconditioning.json",
        ("--steps", 40, "rounds (each steps both arms once)"),
        "a small model and few steps (to test the benchmark)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = {}
    for label, (name, resolution, batch) in (QUICK_MODELS if args.quick else MODELS).items():
        rows[label] = measure(name, resolution, batch, args.steps)
        ops, gpu = rows[label]["operations"], rows[label]["operations_as_on_gpu"]
        print(
            f"{label}: stacked/per-layer step() {rows[label]['ratio']:.2f}x; operations stacked {ops['stacked']} against "
            f"{ops['per_layer']} ({gpu['stacked']} against {gpu['per_layer']} as on a GPU)",
            flush=True,
        )
    save_result(args, "models", rows)


if __name__ == "__main__":
    main()
