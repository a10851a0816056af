"""A second backward pass through one forward pass (``backward(retain_graph=True)``, then another) is said, once.

The gradients add up as for the summed losses, but ``G`` adds each pass's own
output-gradient products, without the cross terms of one backward pass of the
sum: the preconditioner silently differed from ``(l1 + l2).backward()``'s.
The other ways several gradients reach a layer in one step must stay silent:
a layer used twice, accumulated micro-batches, a gradient penalty's
``autograd.grad`` pass, and checkpointed segments recomputed in the backward pass.
"""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import shared_net
from torch.utils.checkpoint import checkpoint

from spdkfac import SPDKFACOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

SECOND_PASS = "a second backward pass went through the same forward pass"


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)


def _said(run: Callable[[], None]) -> int:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return sum(SECOND_PASS in str(w.message) for w in caught)


def test_two_backward_passes_through_one_forward_are_said_once():
    model, (x, y) = _net(), _data()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")

    def run() -> None:
        for s in range(3):
            opt.zero_grad()
            out = model(x + 0.1 * s)
            F.cross_entropy(out, y).backward(retain_graph=True)
            (0.5 * out.pow(2).mean()).backward()
            opt.step()

    assert _said(run) == 1
    assert opt.steps == 3


def _summed(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _data()
    out = model(x)
    (F.cross_entropy(out, y) + 0.5 * out.pow(2).mean()).backward()
    opt.step()


def _accumulated(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _data()
    for xm, ym in zip(x.chunk(2), y.chunk(2)):
        (F.cross_entropy(model(xm), ym) / 2).backward()
    opt.step()


def _penalty(model: nn.Module, opt: SPDKFACOptimizer) -> None:
    x, y = _data()
    x = x.requires_grad_()
    out = model(x)
    (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (F.cross_entropy(out, y) + grad.pow(2).mean()).backward()
    opt.step()


def _checkpointed(model: nn.Module, opt: SPDKFACOptimizer, reentrant: bool) -> None:
    x, y = _data()
    out = model[2](checkpoint(lambda t: model[1](model[0](t)), x.requires_grad_(), use_reentrant=reentrant))
    F.cross_entropy(out, y).backward()
    opt.step()


@pytest.mark.parametrize("case", ["summed", "accumulated", "penalty", "checkpoint-reentrant", "checkpoint", "used-twice"])
def test_other_ways_gradients_reach_a_layer_say_nothing(case):
    if case == "used-twice":
        model = shared_net()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
        x = torch.randn(4, 2, 6, 6, generator=torch.Generator().manual_seed(2))

        def run() -> None:
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()

    else:
        model = _net()
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", accumulation_steps=2 if case == "accumulated" else 1)
        steps = {
            "summed": _summed,
            "accumulated": _accumulated,
            "penalty": _penalty,
            "checkpoint-reentrant": lambda m, o: _checkpointed(m, o, True),
            "checkpoint": lambda m, o: _checkpointed(m, o, False),
        }

        def run() -> None:
            for _ in range(2):
                opt.zero_grad()
                steps[case](model, opt)

    assert _said(run) == 0
    assert opt.steps >= 1
