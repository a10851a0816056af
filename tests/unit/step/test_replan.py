"""Re-profiling the per-layer times and re-planning the fusion groups when they drift."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net, train

from spdkfac import SPDKFACOptimizer
from spdkfac.perfmodels import PerfModel


def _alpha_model(alpha: float) -> PerfModel:
    d = PerfModel.default().to_dict()
    d["allreduce"] = {"alpha": alpha, "beta": 1e-12}
    return PerfModel.from_dict(d, f"alpha={alpha}")


#: The fitted start-up cost of a message, and the stall that exceeds it: both far above the scheduling
#: hiccups of a loaded machine (tens of ms), so which factors share a group does not depend on the load.
ALPHA_S = 0.15
STALL_S = 0.6


class Stall(nn.Module):
    """Sleeps in the forward pass once ``slow`` is set: the layers after it become ready later."""

    def __init__(self) -> None:
        super().__init__()
        self.slow = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.slow:
            time.sleep(STALL_S)
        return x


def test_plans_are_remade_every_replan_interval():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single", profile_steps=1, replan_interval=3)
    made = []
    for _ in range(8):
        train(model, opt, x, y, 1)
        made.append(opt.kfac_step.profiler.plans_made)
    # Warm-up at factor step 1, first plan at 2; re-profile at 3 -> plan at 4; at 6 -> plan at 7.
    assert made == [0, 1, 1, 2, 2, 2, 3, 3]


@pytest.mark.slow  # (many profiled steps: the whole suite's, not the fast loop's)
def test_drifted_times_change_the_plan():
    """With alpha = 150 ms every A factor is ready within alpha of the first (one group) until a
    600 ms stall appears in the middle of the forward pass; the next profile splits the group there."""
    torch.manual_seed(0)
    stall = Stall()
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), stall, nn.Tanh(), nn.Linear(6, 3))
    x, y = torch.randn(8, 6), torch.randint(0, 3, (8,))
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single", profile_steps=1, replan_interval=2, perf_model=_alpha_model(ALPHA_S))
    train(model, opt, x, y, 2)
    assert opt.kfac_step.profiler.plans_made == 1
    assert len(opt.fusion_plan()["A"]) == 1
    stall.slow = True
    train(model, opt, x, y, 3)  # re-profile after factor step 4, new plan at 5
    assert opt.kfac_step.profiler.plans_made == 2
    assert opt.kfac_step.profiler.plan_changes == 1
    assert [[name for _, name in g] for g in opt.fusion_plan()["A"]] == [["0", "2"], ["5"]]


def test_bad_replan_interval():
    with pytest.raises(ValueError, match="replan_interval"):
        SPDKFACOptimizer(small_net(), lr=0.1, backend="single", replan_interval=0)
