"""The KL clip with layers at their own learning rates (a group added for an unfrozen backbone, layer-wise rates
in your optimizer's groups): each layer's update enters ``Σ lr² v·g`` with its own rate, not the first group's.

Observed through one plain-SGD step (no momentum, no weight decay) in float64: the clipped step of every layer is
``ν`` times its unclipped step, and ``ν = min(1, sqrt(κ / Σ lr_l² v_l·g_l))`` with ``v_l`` the unclipped step over
``lr_l`` and ``g_l`` the gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import KFACPreconditioner, SPDKFACOptimizer

KL_CLIP = 1e-5
RATES = {"0": 0.002, "2": 0.2}  # the backbone slow, the head fast (its group is param_groups[0])


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)


def _own_optimizer(net: nn.Sequential, kl_clip: float | None) -> Callable[[], Any]:
    """The backbone frozen when the optimizer is built, then unfrozen and given its own group (fine-tuning's way)."""
    net[0].requires_grad_(False)
    opt = SPDKFACOptimizer(net, lr=RATES["2"], momentum=0.0, kl_clip=kl_clip, backend="single")
    net[0].requires_grad_(True)
    opt.add_param_group({"params": list(net[0].parameters()), "lr": RATES["0"]})
    return opt.step


def _attached(net: nn.Sequential, kl_clip: float | None) -> Callable[[], Any]:
    sgd = torch.optim.SGD([{"params": net[2].parameters(), "lr": RATES["2"]}, {"params": net[0].parameters(), "lr": RATES["0"]}])
    KFACPreconditioner(net, kl_clip=kl_clip, backend="single", optimizer=sgd, compute_method="inverse")
    return sgd.step


def _step(build: Callable[[nn.Sequential, float | None], Callable[[], Any]], kl_clip: float | None) -> dict[str, torch.Tensor]:
    net = _net().double()
    step = build(net, kl_clip)
    x, y = _batch()
    before = {name: p.detach().clone() for name, p in net.named_parameters()}
    F.cross_entropy(net(x), y).backward()
    step()
    return {name: p.detach() - before[name] for name, p in net.named_parameters()}


@pytest.mark.parametrize("build", [_own_optimizer, _attached], ids=["add_param_group", "attached-optimizer-groups"])
def test_each_layer_enters_the_kl_clip_with_its_own_learning_rate(build: Callable[..., Any]) -> None:
    free, clipped = _step(build, None), _step(build, KL_CLIP)
    ratios = {name: (clipped[name] / free[name]).flatten() for name in free}
    nu = float(ratios["0.weight"][0])
    for name, ratio in ratios.items():
        torch.testing.assert_close(ratio, torch.full_like(ratio, nu), rtol=1e-9, atol=0, msg=name)
    net = _net().double()
    x, y = _batch()
    F.cross_entropy(net(x), y).backward()
    vg = {
        layer: sum(float((-free[f"{layer}.{p}"] / RATES[layer] * getattr(net[int(layer)], p).grad).sum()) for p in ("weight", "bias"))
        for layer in RATES
    }
    own = math.sqrt(KL_CLIP / abs(sum(RATES[layer] ** 2 * vg[layer] for layer in RATES)))
    first = math.sqrt(KL_CLIP / abs(sum(RATES["2"] ** 2 * vg[layer] for layer in RATES)))  # the rule before
    assert nu == pytest.approx(own, rel=1e-9)
    assert abs(own - first) > 0.1 * own  # (the two rules differ here: the test can tell them apart)
