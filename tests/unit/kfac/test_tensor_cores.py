"""Half-precision rows on a GPU: which inputs keep them, which layer types take them, and the loss scale after."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import spdkfac.kfac.layers as layers_module
from spdkfac.kfac.layers import KFACLayer, make_helper
from spdkfac.kfac.tensor_cores import keeps_half_rows


def test_only_half_precision_cuda_inputs_with_float32_factors_keep_their_rows():
    assert not keeps_half_rows(torch.zeros(2, dtype=torch.bfloat16), torch.float32)  # the CPU
    assert not keeps_half_rows(torch.zeros(2, device="meta", dtype=torch.float16), torch.float32)
    assert not keeps_half_rows(torch.zeros(2), torch.float32)


MODULES = {
    "linear": (lambda: nn.Linear(4, 3), True),
    "conv": (lambda: nn.Conv2d(4, 6, 3, padding=1), True),
    "conv1x1": (lambda: nn.Conv2d(4, 6, 1, bias=True), True),
    "grouped": (lambda: nn.Conv2d(4, 6, 3, padding=1, groups=2), False),  # batched Grams: widened first
    "layernorm": (lambda: nn.LayerNorm(4), False),  # multiplies values it computed: widened first
}


@pytest.mark.parametrize("module", list(MODULES))
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0, 3.0])
def test_layer_types_that_multiply_raw_values_take_half_rows_and_the_loss_scale_comes_out_after(module, loss_scale, monkeypatch):
    """Where the rows may stay half precision, Linear and ungrouped convolutions get them (their Grams are
    products of the values as they came), the others float32; a loss scale is divided out of the float32 Gram,
    giving the factors of the float32 path. (On the CPU the spy widens the rows itself before the product.)"""
    make, takes_half = MODULES[module]
    torch.manual_seed(0)
    net = make()
    x = torch.randn(2, 4, 5, 5) if module.startswith(("conv", "grouped")) else torch.randn(6, 4)
    g = torch.randn_like(net(x).detach())
    xh, gh = x.to(torch.bfloat16), g.to(torch.bfloat16)
    reference = KFACLayer("want", make_helper(net, norm_layers=True))
    want_a = reference.compute_a(xh)
    want_g = reference.compute_g(gh, loss_scale=loss_scale)

    layer = KFACLayer("layer", make_helper(net, norm_layers=True))
    seen: list[torch.dtype] = []
    real_in, real_out = layer.helper.input_gram, layer.helper.output_gram

    def input_gram(x, dtype):
        seen.append(dtype)
        return real_in(x, torch.float32)

    def output_gram(g):
        seen.append(g.dtype)
        return real_out(g.float())

    monkeypatch.setattr(layer.helper, "input_gram", input_gram)
    monkeypatch.setattr(layer.helper, "output_gram", output_gram)
    monkeypatch.setattr(layers_module, "keeps_half_rows", lambda source, factor_dtype: True)
    got_a = layer.compute_a(xh)
    got_g = layer.compute_g(gh, loss_scale=loss_scale)
    expected = torch.bfloat16 if takes_half else torch.float32
    assert seen == [expected, expected]
    assert got_a.dtype == got_g.dtype == torch.float32
    torch.testing.assert_close(got_a, want_a, rtol=1e-6, atol=0)
    torch.testing.assert_close(got_g, want_g, rtol=1e-5, atol=0)  # (dividing by 3 after the product rounds apart)
