"""One sample without its batch dimension (torch's unbatched input: a Linear's 1-D input, a Conv2d's ``(C, H, W)``):
K-FAC counts it as one sample, so the steps equal those on the same sample given with a batch dimension of 1.

Before, a Linear's or LayerNorm's unbatched input was read as a batch of its
first dimension (a silently different step) and a convolution's failed inside
the factor computation.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer

CASES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "linear": (lambda: nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)), (3,)),
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 3, 3), nn.Tanh(), nn.Conv1d(3, 2, 3)), (2, 9)),
    "conv2d-strided": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3), nn.Tanh(), nn.Conv2d(3, 2, 3, stride=2)), (2, 9, 9)),
    "conv3d": (lambda: nn.Sequential(nn.Conv3d(2, 3, 2), nn.Tanh(), nn.Conv3d(3, 2, 2)), (2, 4, 4, 4)),
    "conv-transpose2d": (lambda: nn.Sequential(nn.ConvTranspose2d(2, 3, 3, stride=2), nn.Tanh(), nn.Conv2d(3, 2, 3)), (2, 4, 4)),
    "layernorm-rmsnorm": (lambda: nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 5), nn.RMSNorm(5)), (3,)),
}


def _train(case: str, unbatched: bool, compute_method: str) -> tuple[list[torch.Tensor], SPDKFACOptimizer]:
    make, shape = CASES[case]
    torch.manual_seed(0)
    model = make().double()
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, backend="single", compute_method=compute_method, norm_layers="kfac")
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(*shape, generator=g, dtype=torch.float64)
        opt.zero_grad()
        out = model(x if unbatched else x.unsqueeze(0))
        (out.sin().sum()).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.mark.parametrize("compute_method", ["inverse", "eigen"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_unbatched_sample_is_one_sample(case: str, compute_method: str) -> None:
    got, opt = _train(case, True, compute_method)
    want, ref = _train(case, False, compute_method)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for layer, ref_layer in zip(opt.kfac_step.layers, ref.kfac_step.layers, strict=True):
        assert layer.local_samples == 1
        for kind in ("A", "G"):
            torch.testing.assert_close(layer.packed_factor(kind), ref_layer.packed_factor(kind), rtol=1e-12, atol=1e-12)
