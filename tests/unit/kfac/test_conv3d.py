"""Conv3d: factors and update against a float64 reference of explicit per-voxel patches (no spdkfac code)."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from layer_reference import conv_grad_rows, factors, update

from spdkfac import SPDKFACOptimizer
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
    opt = SPDKFACOptimizer(
        module, lr=1.0, momentum=0.0, damping=DAMPING, factor_decay=DECAY, kl_clip=None, backend="single", compute_method=method
    )
    out = module(x)
    out.retain_grad()
    ((out * torch.randn(out.shape)).sum() / x.shape[0]).backward()
    before = {name: p.detach().clone() for name, p in module.named_parameters()}
    grads = {name: p.grad.detach().clone() for name, p in module.named_parameters()}
    opt.step()
    (layer,) = opt.layers
    assert isinstance(layer.helper, Conv3dHelper)
    groups, og = module.groups, module.out_channels // module.groups
    a_rows, g_rows = volume_rows(module, x), conv_grad_rows(module, out.grad)
    weight_grad = grads["weight"].reshape(groups, og, -1)
    A_blocks, G_blocks, expected_w, expected_b = [], [], [], []
    for grp in range(groups):
        torch.testing.assert_close(g_rows[grp].T @ a_rows[grp], weight_grad[grp], rtol=1e-10, atol=1e-10)  # Σ g ⊗ a
        A, G = factors(a_rows[grp], g_rows[grp], x.shape[0], bias)
        A_blocks.append(DECAY * torch.eye(A.shape[0]) + (1 - DECAY) * A)
        G_blocks.append(DECAY * torch.eye(G.shape[0]) + (1 - DECAY) * G)
        grad = weight_grad[grp]
        if bias:
            grad = torch.cat([grad, grads["bias"].reshape(groups, og, 1)[grp]], dim=1)
        u = update(A_blocks[-1], G_blocks[-1], grad, DAMPING, method)
        expected_w.append(u[:, :-1] if bias else u)
        if bias:
            expected_b.append(u[:, -1])
    got_a, got_g = (layer.A, layer.G) if groups > 1 else (layer.A.unsqueeze(0), layer.G.unsqueeze(0))
    torch.testing.assert_close(got_a, torch.stack(A_blocks), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, torch.stack(G_blocks), rtol=1e-10, atol=1e-12)
    change = {name: before[name] - p.detach() for name, p in module.named_parameters()}
    torch.testing.assert_close(change["weight"], torch.stack(expected_w).reshape(module.weight.shape), rtol=1e-8, atol=1e-10)
    if bias:
        torch.testing.assert_close(change["bias"], torch.cat(expected_b), rtol=1e-8, atol=1e-10)


def test_a_conv3d_subclass_gets_the_plain_update():
    class Mine(nn.Conv3d):
        pass

    assert make_helper(Mine(2, 2, 1)) is None
    assert isinstance(make_helper(nn.Conv3d(2, 2, 1)), Conv3dHelper)
