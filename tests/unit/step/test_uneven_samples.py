"""A layer that takes a data-dependent number of samples (tokens routed to an expert) differs between workers: said.

Each worker normalises its factors by its own samples and the workers'
factors are averaged, where one worker on the whole batch weighs every
sample alike, so 2 workers differ from one for that layer (measured here,
so the warning is about a real difference). The workers' sample counts and
their squares travel in the step's agreement; only the uneven layer is named.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

X = torch.randn(8, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
Y = torch.randint(0, 3, (8,), generator=torch.Generator().manual_seed(4))


class Routed(nn.Module):
    """A body, an 'expert' that only the samples routed to it (a data-dependent subset) pass through, a head."""

    def __init__(self, route: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.route = route
        self.body = nn.Linear(5, 8)
        self.expert = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        chosen = h[:, 0] > 0 if self.route else torch.ones(len(h), dtype=torch.bool)
        out = h.clone()
        out[chosen] = out[chosen] + self.expert(h[chosen])
        return self.head(out)


def _train(model: Routed, backend, rows: slice = slice(None)) -> list[torch.Tensor]:
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, kl_clip=None, backend=backend)
    for s in range(3):
        opt.zero_grad()
        F.cross_entropy(model(X[rows].to(torch.get_default_dtype()) + 0.1 * s), Y[rows]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _said(run) -> tuple[object, list[str]]:
    """``run()`` and what it said about uneven samples (recorded here: the warnings of the rank threads too)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = run()
    return out, [str(w.message) for w in caught if "different numbers of samples" in str(w.message)]


def _two_workers(route: bool) -> tuple[list[list[torch.Tensor]], list[str]]:
    models = [Routed(route), Routed(route)]
    return _said(lambda: run_ranks(2, lambda b: _train(models[b.rank], b, slice(4 * b.rank, 4 * b.rank + 4))))


def test_a_routed_layer_is_named_once_and_differs_from_one_worker(float64):
    with torch.no_grad():  # (the split routes 1 and 2 of its 4 samples at the start)
        routed = [int((torch.tanh(Routed(True).body(X[r]))[:, 0] > 0).sum()) for r in (slice(0, 4), slice(4, 8))]
    assert routed[0] != routed[1]
    single, said_single = _said(lambda: _train(Routed(True), "single"))
    ranks, said = _two_workers(True)
    assert said_single == []
    assert len(said) == 2, said  # three steps: once on each worker
    for message in said:
        assert "'expert' (" in message
        assert "'body'" not in message
        assert "'head'" not in message
    assert max(float((a - s).abs().max()) for a, s in zip(ranks[0], single)) > 1e-6


def test_every_sample_through_every_layer_is_not_said_and_equals_one_worker(float64):
    single = _train(Routed(False), "single")
    ranks, said = _two_workers(False)
    assert said == []
    for params in ranks:
        for a, s in zip(params, single):
            torch.testing.assert_close(a, s, rtol=1e-9, atol=1e-11)
