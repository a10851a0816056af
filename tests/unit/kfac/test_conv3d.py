"""Conv3d: factors and update against a float64 reference of explicit per-voxel patches (no spdkfac code)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_reference import conv_grad_rows, grouped_step
from one_step import kfac_step

from spdkfac.kfac.layer_types import Conv3dHelper, make_helper

DAMPING, DECAY = 0.05, 0.5

CASES = {
    "3x3x3-pad": lambda bias: nn.Conv3d(2, 3, 3, padding=1, bias=bias),
    "stride-dilation": lambda bias: nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 2), dilation=(2, 1, 1), padding=(1, 1, 0), bias=bias),
    "grouped": lambda bias: nn.Conv3d(4, 6, 2, groups=2, bias=bias),
    "depthwise-reflect": lambda bias: nn.Conv3d(3, 3, 3, padding=1, groups=3, padding_mode="reflect", bias=bias),
    "circular-same": lambda bias: nn.Conv3d(2, 2, 3, padding="same", padding_mode="circular", bias=bias),
    "replicate": lambda bias: nn.Conv3d(2, 3, (1, 3, 3), padding=(0, 2, 1), padding_mode="replicate", bias=bias),
    "1x1x1-stride": lambda bias: nn.Conv3d(3, 2, 1, stride=2, bias=bias),
}


def volume_rows(module: nn.Conv3d, x: torch.Tensor) -> list[torch.Tensor]:
    """Per group: one row per sample and output voxel, (channel, kd, kh, kw) order, from the padded input by slicing."""
    pads = []
    for k, d, p in zip(module.kernel_size, module.dilation, [None] * 3 if module.padding == "same" else module.padding):
        total = d * (k - 1) if p is None else 2 * p
        pads.append((total // 2, total - total // 2))
    mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    xp = F.pad(x, [p for pair in reversed(pads) for p in pair], mode=mode)
    k, s, d = module.kernel_size, module.stride, module.dilation
    out = [(xp.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(3)]
    cg = module.in_channels // module.groups
    groups = []
    for grp in range(module.groups):
        rows = []
        for b in range(x.shape[0]):
            for pos in itertools.product(*(range(o) for o in out)):
                corner = [pos[i] * s[i] for i in range(3)]
                patch = xp[
                    b,
                    grp * cg : (grp + 1) * cg,
                    corner[0] : corner[0] + d[0] * (k[0] - 1) + 1 : d[0],
                    corner[1] : corner[1] + d[1] * (k[1] - 1) + 1 : d[1],
                    corner[2] : corner[2] + d[2] * (k[2] - 1) + 1 : d[2],
                ]
                rows.append(patch.reshape(-1))
        groups.append(torch.stack(rows))
    return groups


@pytest.mark.parametrize("method", ["inverse", pytest.param("eigen", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_conv3d_factors_and_update_match_the_reference(case, bias, method, float64):
    torch.manual_seed(0)
    module = CASES[case](bias).double()
    x = torch.randn(2, module.in_channels, 3, 4, 5)
    grad_out, grads, change, opt = kfac_step(module, x, method, DAMPING, DECAY)
    (layer,) = opt.layers
    assert isinstance(layer.helper, Conv3dHelper)
    groups, og = module.groups, module.out_channels // module.groups
    a_rows, g_rows = volume_rows(module, x), conv_grad_rows(module, grad_out)
    weight_grad = grads["weight"].reshape(groups, og, -1)
    bias_grads = grads["bias"].reshape(groups, og) if bias else None
    A, G, updates = grouped_step(a_rows, g_rows, weight_grad, bias_grads, x.shape[0], method, DAMPING, DECAY)
    expected_w = [u[:, :-1] if bias else u for u in updates]
    expected_b = [u[:, -1] for u in updates] if bias else []
    got_a, got_g = (layer.A, layer.G) if groups > 1 else (layer.A.unsqueeze(0), layer.G.unsqueeze(0))
    torch.testing.assert_close(got_a, A, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, G, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(change["weight"], torch.stack(expected_w).reshape(module.weight.shape), rtol=1e-8, atol=1e-10)
    if bias:
        torch.testing.assert_close(change["bias"], torch.cat(expected_b), rtol=1e-8, atol=1e-10)


def test_a_conv3d_subclass_with_its_own_forward_gets_the_plain_update():
    class Mine(nn.Conv3d):
        def forward(self, x):
            return super().forward(x.flip(-1))

    class Same(nn.Conv3d):
        pass

    assert make_helper(Mine(2, 2, 1)) is None
    assert isinstance(make_helper(Same(2, 2, 1)), Conv3dHelper)
    assert isinstance(make_helper(nn.Conv3d(2, 2, 1)), Conv3dHelper)
