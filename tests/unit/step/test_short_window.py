"""A short last accumulation window (an epoch's last micro-batches, fewer than ``accumulation_steps``) is stepped.

Hugging Face's ``Trainer`` and Lightning step the micro-batches left at an
epoch's end; with a dataset whose micro-batch count is not a multiple of
``gradient_accumulation_steps`` the optimizer refused that step ("step() after
1 backward pass(es), but accumulation_steps is 4"), ending the run after its
first epoch. Such a window is now stepped as it is: its gradient is what the
micro-batches summed (each loss divided by ``accumulation_steps``, the
optimizer's convention), ``A`` and ``G`` the means over the passes it ran. The
reference is one pass over the window's samples with the gradient scaled alike.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import assert_bitwise_equal

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import SingleProcessBackend
from spdkfac.comm.inprocess import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]

K = 4
WINDOWS = [4, 2, 4, 1, 4]  # micro-batches per step: short windows between full ones
KW = dict(lr=0.1, momentum=0.9, damping=0.01, kl_clip=0.01, factor_update_freq=1, inv_update_freq=2)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _micro_batch(s: int, i: int, rank: int = 0, size: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * s + i)
    x, y = torch.randn(4 * size, 6, generator=g), torch.randint(0, 4, (4 * size,), generator=g)
    return x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4]


def _accumulated(backend: Any, model: nn.Module, **options: Any) -> dict[str, torch.Tensor]:
    opt = SPDKFACOptimizer(model, backend=backend, accumulation_steps=K, **{**KW, **options})
    for s, window in enumerate(WINDOWS):
        opt.zero_grad()
        for i in range(window):
            x, y = _micro_batch(s, i, backend.rank, backend.size)
            (F.cross_entropy(model(x), y) / K).backward()
        opt.step()
    assert opt.steps == len(WINDOWS)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _reference(**options: Any) -> dict[str, torch.Tensor]:
    """One pass over each window's samples (A and G their means), the gradient scaled by window / K as summed."""
    model = _net()
    opt = SPDKFACOptimizer(model, backend=SingleProcessBackend(), **{**KW, **options})
    for s, window in enumerate(WINDOWS):
        opt.zero_grad()
        xs, ys = zip(*(_micro_batch(s, i) for i in range(window)))
        F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
        for p in model.parameters():
            p.grad.mul_(window / K)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    for key, value in b.items():
        torch.testing.assert_close(a[key], value, rtol=1e-11, atol=1e-13)


@pytest.mark.parametrize(
    ("options", "reference"),
    [
        ({}, {}),
        ({"compute_method": "eigen"}, {"compute_method": "eigen"}),
        ({"update_fusion": "forward"}, {"update_fusion": "forward"}),
        # (updated in backward(): the reference, whose gradient is scaled after it, is the unfused optimizer)
        ({"update_fusion": "backward", "kl_clip": None}, {"kl_clip": None}),
    ],
    ids=["inverse", "eigen", "forward-fusion", "backward-fusion"],
)
def test_a_short_window_is_one_pass_over_its_samples(options, reference):
    _close(_accumulated(SingleProcessBackend(), _net(), **options), _reference(**reference))


def test_on_two_workers_a_short_window_is_the_single_process_one():
    models = [_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _accumulated(b, models[b.rank]), timeout=120)
    assert_bitwise_equal(ranks[0], ranks[1], "rank 1 vs rank 0")
    single = _net()
    opt = SPDKFACOptimizer(single, backend=SingleProcessBackend(), accumulation_steps=K, **KW)
    for s, window in enumerate(WINDOWS):  # each micro-batch of both workers at once
        opt.zero_grad()
        for i in range(window):
            xs, ys = zip(*(_micro_batch(s, i, r, 2) for r in range(2)))
            (F.cross_entropy(single(torch.cat(xs)), torch.cat(ys)) / K).backward()
        opt.step()
    _close(ranks[0], {k: v.detach() for k, v in single.state_dict().items()})


def test_two_short_windows_in_a_row_are_refused():
    model = _net()
    opt = SPDKFACOptimizer(model, backend=SingleProcessBackend(), accumulation_steps=K, **KW)
    for s in range(2):
        opt.zero_grad()
        for i in range(2):
            x, y = _micro_batch(s, i)
            (F.cross_entropy(model(x), y) / K).backward()
        if s == 0:
            opt.step()
        else:
            with pytest.raises(RuntimeError, match="twice in a row"):
                opt.step()
