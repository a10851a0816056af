"""A layer called with no sample (an empty batch on one worker, a branch nothing was routed to): it counts as a
layer that did not run in that step, on that worker. Before, a convolution's factor divided by zero in the
forward pass and a Linear's factor became NaN."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import assert_bitwise_equal

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.factor_shape import FactorShape

HYPER = dict(lr=0.05, momentum=0.0, damping=0.01, factor_decay=0.9, kl_clip=0.01)


class Routed(nn.Module):
    """A trunk and two heads; the second (a convolution and a Linear) sees only the samples ``route`` selects."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Conv2d(2, 3, 3)
        self.head = nn.Linear(3 * 4 * 4, 5)
        self.branch_conv = nn.Conv2d(3, 2, 3)
        self.branch_fc = nn.Linear(2 * 2 * 2, 5)

    def forward(self, x: torch.Tensor, route: torch.Tensor | None) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        out = self.head(h.flatten(1))
        if route is not None:  # (None: the branch is not called at all)
            picked = torch.tanh(self.branch_conv(h[route])).flatten(1)
            out = out.index_add(0, route.nonzero().flatten(), self.branch_fc(picked))
        return out


def _data(step: int, n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 2, 6, 6, generator=g, dtype=torch.float64), torch.randint(0, 5, (n,), generator=g)


#: step -> which samples the branch takes: some, none (called with an empty batch, or not called), some.
ROUTES = [
    torch.tensor([1, 0, 1, 1, 0, 0], dtype=torch.bool),
    torch.zeros(6, dtype=torch.bool),
    torch.tensor([0, 1, 1, 0, 0, 1], dtype=torch.bool),
]


def _train(call_empty: bool) -> tuple[nn.Module, SPDKFACOptimizer]:
    torch.manual_seed(0)
    model = Routed().double()
    opt = SPDKFACOptimizer(model, backend="single", **HYPER)
    for step, route in enumerate(ROUTES):
        x, y = _data(step)
        opt.zero_grad()
        F.cross_entropy(model(x, route if route.any() or call_empty else None), y).backward()
        opt.step()
    return model, opt


def test_a_branch_called_with_no_sample_is_a_branch_not_called() -> None:
    """Factors and parameters as when the branch is not called in that step (no momentum: a zero gradient and
    none then update alike)."""
    empty, empty_opt = _train(call_empty=True)
    absent, absent_opt = _train(call_empty=False)
    for (name, a), b in zip(empty.named_parameters(), absent.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14, msg=name)
    for layer, other in zip(empty_opt.kfac_step.layers, absent_opt.kfac_step.layers, strict=True):
        for kind in ("A", "G"):
            torch.testing.assert_close(layer.packed_factor(kind), other.packed_factor(kind), rtol=1e-12, atol=1e-14)
    assert all(torch.isfinite(p).all() for p in empty.parameters())


def test_a_batch_of_no_sample_is_refused_on_a_factor_step_with_the_reason() -> None:
    torch.manual_seed(0)
    model = Routed().double()
    opt = SPDKFACOptimizer(model, backend="single", **HYPER)
    x, y = _data(0, n=0)
    opt.zero_grad()
    (F.cross_entropy(model(x, None), y, reduction="sum")).backward()
    with pytest.raises(RuntimeError, match=r"no Kronecker factor was computed \(here the layers were called with no sample"):
        opt.step()


def test_an_empty_shard_on_one_worker_averages_the_others_factors(float64: Any) -> None:
    """In-process ranks: rank 1's branch gets no sample in step 1; the ranks stay bitwise replicas and the branch's
    A factor folds in rank 0's batch factor alone (the mean over the workers that ran it)."""
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        models.append(Routed())

    def run(backend: Any) -> list[dict[str, Any]]:
        model = models[backend.rank]
        opt = SPDKFACOptimizer(model, backend=backend, **HYPER)
        inputs: list[torch.Tensor] = []
        model.branch_fc.register_forward_pre_hook(lambda module, args: inputs.append(args[0].detach().clone()))
        seen = []
        for step, route in enumerate(ROUTES):
            x, y = _data(10 * step + backend.rank)
            if step == 1:
                route = torch.full((6,), backend.rank == 0)  # all six on rank 0, none on rank 1
            inputs.clear()
            opt.zero_grad()
            F.cross_entropy(model(x, route), y).backward()
            layer = opt.kfac_step._by_name["branch_fc"]
            before = layer.packed_factor("A")
            before = before.clone() if before is not None else None
            opt.step()
            seen.append(
                {
                    "params": [p.detach().clone() for p in model.parameters()],
                    "A": layer.packed_factor("A").clone(),
                    "A_before": before,
                    "input": inputs[0],
                }
            )
        return seen

    ranks = run_ranks(2, run, timeout=60)
    for step in range(len(ROUTES)):
        assert_bitwise_equal(ranks[1][step]["params"], ranks[0][step]["params"], f"step {step}: params of rank 1 vs rank 0")
        assert_bitwise_equal(ranks[1][step]["A"], ranks[0][step]["A"], f"step {step}: branch_fc's A, rank 1 vs rank 0")
    x = ranks[0][1]["input"]
    assert x.shape[0] == 6
    assert ranks[1][1]["input"].shape[0] == 0
    rows = torch.cat([x, torch.ones(6, 1)], dim=1)
    batch_a = FactorShape(rows.shape[1]).pack(rows.T @ rows / 6)  # (the packed form the layer keeps)
    decay = HYPER["factor_decay"]
    torch.testing.assert_close(ranks[0][1]["A"], decay * ranks[0][1]["A_before"] + (1 - decay) * batch_a, rtol=1e-10, atol=1e-12)
