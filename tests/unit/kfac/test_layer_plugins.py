"""A new layer type or compute method is one class and one registration line."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.factor_shape import FactorShape
from spdkfac.kfac.layer_types import HELPERS, LayerHelper
from spdkfac.kfac.linalg import symmetric_gram
from spdkfac.kfac.methods import METHODS, InverseMethod


class TransposedLinear(nn.Module):
    """``y = x @ W`` with ``W`` stored ``(in, out)``: the opposite layout of ``nn.Linear``."""

    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(cin, cout) / cin**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class TransposedLinearHelper(LayerHelper):
    """Owns the layout: the gradient is ``weight.grad^T`` (``out x in``)."""

    @property
    def a_shape(self) -> FactorShape:
        return FactorShape(self.weight.shape[0])

    @property
    def g_shape(self) -> FactorShape:
        return FactorShape(self.weight.shape[1])

    def input_gram(self, x, dtype):
        rows = x.to(dtype).reshape(-1, x.shape[-1])
        return symmetric_gram(rows), rows.shape[0]

    def output_gram(self, g):
        rows = g.reshape(-1, g.shape[-1])
        return symmetric_gram(rows), rows.shape[0]

    def grad(self):
        return None if self.weight.grad is None else self.weight.grad.T

    def write_grad(self, update):
        self.weight.grad.copy_(update.T)


def test_a_registered_layer_type_is_preconditioned_like_its_equivalent(monkeypatch, float64):
    monkeypatch.setitem(HELPERS, TransposedLinear, TransposedLinearHelper)
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 4, bias=False), nn.Tanh(), nn.Linear(4, 3, bias=False))
    mine = nn.Sequential(TransposedLinear(5, 4), nn.Tanh(), TransposedLinear(4, 3))
    with torch.no_grad():
        mine[0].weight.copy_(plain[0].weight.T)
        mine[2].weight.copy_(plain[2].weight.T)
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    for model in (plain, mine):
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", damping=0.01)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        assert len(opt.layers) == 2
    torch.testing.assert_close(mine[0].weight, plain[0].weight.T, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mine[2].weight, plain[2].weight.T, rtol=1e-12, atol=1e-12)


class ScaledInverse(InverseMethod):
    """The inverse method under another name (a stand-in for a new method)."""

    name = "scaled-inverse"


def test_a_registered_compute_method_is_accepted_and_saved_by_name(monkeypatch, float64):
    monkeypatch.setitem(METHODS, ScaledInverse.name, ScaledInverse)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3))
    x, y = torch.randn(6, 5), torch.randint(0, 3, (6,))
    results = {}
    for method in ("inverse", "scaled-inverse"):
        model = copy.deepcopy(base)
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", compute_method=method)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        results[method] = (model, opt.state_dict())
    assert results["scaled-inverse"][1]["kfac"]["compute_method"] == "scaled-inverse"
    for a, b in zip(results["inverse"][0].parameters(), results["scaled-inverse"][0].parameters()):
        assert torch.equal(a, b)
