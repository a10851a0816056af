"""ConvTranspose1d/2d: factors and update against a float64 reference written from the transposed convolution's definition.

The reference builds, per output position, the row of input values each
weight entry multiplies there: ``y[o, p] = Σ_{i,k} W[i, o, k] x[i, q]`` with
``p = q s - padding + k d``, so entry ``(i, k)`` of position ``p``'s row is
``x[i, (p + padding - k d) / s]`` where that is a whole input index, else 0
(explicit loops, no zero insertion and no spdkfac code). K-FAC of those rows
and the output-gradient rows is then that of a convolution
(:mod:`layer_reference`); the rows reproduce autograd's weight gradient.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn as nn
from layer_reference import conv_grad_rows, grouped_step
from one_step import kfac_step

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.layer_types import ConvTransposeHelper, make_helper

DAMPING, DECAY = 0.05, 0.5

CASES = {
    "stride2-output-padding": lambda bias: nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1, bias=bias),
    "k4-s2-p1": lambda bias: nn.ConvTranspose2d(4, 2, 4, stride=2, padding=1, bias=bias),  # DCGAN's and U-Net's up-sampling
    "grouped-dilated": lambda bias: nn.ConvTranspose2d(4, 6, 3, stride=2, dilation=2, padding=1, groups=2, bias=bias),
    "depthwise": lambda bias: nn.ConvTranspose2d(3, 3, 3, padding=1, groups=3, bias=bias),
    "padding-beyond-kernel": lambda bias: nn.ConvTranspose2d(2, 3, 2, stride=3, padding=2, output_padding=1, bias=bias),
    "rectangular": lambda bias: nn.ConvTranspose2d(2, 3, (3, 2), stride=(2, 1), padding=(0, 1), bias=bias),
    "1x1-stride": lambda bias: nn.ConvTranspose2d(3, 2, 1, stride=2, bias=bias),
    "1d-stride-output-padding": lambda bias: nn.ConvTranspose1d(3, 4, 3, stride=2, padding=1, output_padding=1, bias=bias),
    "1d-grouped": lambda bias: nn.ConvTranspose1d(4, 2, 4, stride=2, padding=1, groups=2, bias=bias),
    "3d-stride-output-padding": lambda bias: nn.ConvTranspose3d(2, 3, 3, stride=2, padding=1, output_padding=1, bias=bias),
    "3d-grouped-anisotropic": lambda bias: nn.ConvTranspose3d(4, 2, (1, 2, 2), stride=(1, 2, 2), groups=2, bias=bias),
}
#: An input's spatial size per number of spatial dimensions.
SIZES = {1: (5,), 2: (4, 5), 3: (2, 3, 4)}


def transposed_rows(module: nn.ConvTranspose1d | nn.ConvTranspose2d, x: torch.Tensor, out_size: tuple[int, ...]) -> list[torch.Tensor]:
    """Per group: one row ``(C_in/groups * prod(k))`` per sample and output position, ordered (channel, kernel offset)."""
    spatial = x.shape[2:]
    dims = len(spatial)
    cg = module.in_channels // module.groups
    groups = []
    for grp in range(module.groups):
        rows = []
        for b in range(x.shape[0]):
            for p in itertools.product(*(range(s) for s in out_size)):
                row = torch.zeros(cg, *module.kernel_size, dtype=x.dtype)
                for k in itertools.product(*(range(s) for s in module.kernel_size)):
                    q = []
                    for axis in range(dims):
                        num = p[axis] + module.padding[axis] - k[axis] * module.dilation[axis]
                        if num % module.stride[axis] or not 0 <= num // module.stride[axis] < spatial[axis]:
                            break
                        q.append(num // module.stride[axis])
                    else:
                        row[(slice(None), *k)] = x[(b, slice(grp * cg, (grp + 1) * cg), *q)]
                rows.append(row.reshape(-1))
        groups.append(torch.stack(rows))
    return groups


def _step(module: nn.Module, x: torch.Tensor, method: str):
    return kfac_step(module, x, method, DAMPING, DECAY)


@pytest.mark.parametrize("method", ["inverse", pytest.param("eigen", marks=pytest.mark.slow)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_transposed_conv_factors_and_update_match_the_reference(case, bias, method, float64):
    torch.manual_seed(0)
    module = CASES[case](bias).double()
    x = torch.randn(2, module.in_channels, *SIZES[len(module.kernel_size)])
    grad_out, grads, change, opt = _step(module, x, method)
    (layer,) = opt.layers
    assert isinstance(layer.helper, ConvTransposeHelper)
    groups, cg = module.groups, module.in_channels // module.groups
    og = module.out_channels // groups
    a_rows, g_rows = transposed_rows(module, x, tuple(grad_out.shape[2:])), conv_grad_rows(module, grad_out)
    # The weight (in, out/groups, *k) as per-group g x a matrices: rows the output channels, columns (in channel, offset).
    as_matrix = grads["weight"].reshape(groups, cg, og, -1).transpose(1, 2).reshape(groups, og, -1)
    bias_grads = grads["bias"].reshape(groups, og) if bias else None
    A, G, updates = grouped_step(a_rows, g_rows, as_matrix, bias_grads, x.shape[0], method, DAMPING, DECAY)
    expected_w = [(u[:, :-1] if bias else u).reshape(og, cg, -1).transpose(0, 1) for u in updates]
    expected_b = [u[:, -1] for u in updates] if bias else []
    got_a, got_g = layer.A, layer.G
    if groups == 1:
        got_a, got_g = got_a.unsqueeze(0), got_g.unsqueeze(0)
    torch.testing.assert_close(got_a, A, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_g, G, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(change["weight"], torch.cat(expected_w).reshape(module.weight.shape), rtol=1e-8, atol=1e-10)
    if bias:
        torch.testing.assert_close(change["bias"], torch.cat(expected_b), rtol=1e-8, atol=1e-10)


def test_output_size_the_hooks_cannot_see_is_refused_by_name():
    module = nn.ConvTranspose2d(2, 3, 3, stride=2, padding=1)
    opt = SPDKFACOptimizer(module, lr=0.1, backend="single")
    x = torch.randn(2, 2, 4, 4)
    module(x, output_size=[7, 7]).sum().backward()  # what output_padding=0 gives: accepted
    opt.step()
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"ConvTranspose2d: the output is \(8, 8\) where output_padding=\(0, 0\) gives \(7, 7\)"):
        module(x, output_size=[8, 8]).sum().backward()


def test_a_subclass_with_its_own_forward_gets_the_plain_update():
    class Up(nn.ConvTranspose2d):
        def forward(self, x, output_size=None):
            return super().forward(x, output_size) * 2

    class Same(nn.ConvTranspose2d):
        pass

    assert make_helper(Up(2, 2, 2)) is None
    assert isinstance(make_helper(Same(2, 2, 2)), ConvTransposeHelper)
    assert isinstance(make_helper(nn.ConvTranspose1d(2, 2, 2)), ConvTransposeHelper)


@pytest.mark.parametrize(
    "module",
    [
        nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=1),
        nn.ConvTranspose2d(2, 3, 3, stride=2, dilation=2, padding=1, bias=False),  # gcd(s, d) > 1: classes with no offset
        nn.ConvTranspose2d(2, 3, 5, stride=3, dilation=2, padding=4, output_padding=1),
        nn.ConvTranspose2d(2, 2, (4, 1), stride=(3, 2), padding=(2, 0)),
        nn.ConvTranspose2d(2, 2, 1, stride=3),
        nn.ConvTranspose1d(3, 2, 4, stride=2, padding=3, output_padding=1),
        nn.ConvTranspose3d(2, 2, (2, 3, 3), stride=(1, 2, 3), padding=(0, 1, 1), output_padding=(0, 1, 2), dilation=(1, 1, 2)),
    ],
    ids=["s2", "s2-d2", "s3-d2-k5", "rectangular", "1x1-s3", "1d", "3d"],
)
def test_the_residue_class_gram_equals_the_whole_patch_gram(module):
    """Per stride residue class, over its own offsets only: the same A as the Gram of the whole zero-filled patches."""
    helper = make_helper(module.double())
    assert isinstance(helper, ConvTransposeHelper)
    x = torch.randn(3, module.in_channels, *{1: (7,), 2: (5, 6), 3: (3, 4, 5)}[len(module.kernel_size)], dtype=torch.float64)
    by_class, count = helper.input_gram(x, torch.float64)
    whole, whole_count = helper.equivalent.input_gram(helper.prepared(x), torch.float64)
    assert count == whole_count
    torch.testing.assert_close(by_class, whole, rtol=1e-12, atol=1e-12)
    assert torch.equal(by_class, by_class.T)
