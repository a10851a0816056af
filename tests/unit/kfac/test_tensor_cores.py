"""TF32 for the factor products of half-precision inputs: only for them, and the settings restored exactly after."""

from __future__ import annotations

import pytest
import torch

from spdkfac.kfac import tensor_cores
from spdkfac.kfac.tensor_cores import exact_on_tensor_cores, half_precision_products


def _settings() -> tuple[str, ...]:
    b = torch.backends
    try:
        legacy = torch.get_float32_matmul_precision()
    except RuntimeError:  # (torch refuses to read it after the new API set TF32: the two disagree)
        legacy = "mixed"
    return (legacy, b.fp32_precision, b.cuda.matmul.fp32_precision, b.cudnn.conv.fp32_precision, b.mkldnn.matmul.fp32_precision)


@pytest.fixture
def restore_settings():
    before = _settings()
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.fp32_precision = before[1]
    torch.backends.cuda.matmul.fp32_precision = before[2]
    torch.backends.cudnn.conv.fp32_precision = before[3]
    torch.backends.mkldnn.matmul.fp32_precision = before[4]
    assert _settings() == before


def test_only_half_precision_cuda_inputs_qualify():
    assert not exact_on_tensor_cores(torch.zeros(2, dtype=torch.bfloat16))  # the CPU has no TF32 products to allow
    assert not exact_on_tensor_cores(torch.zeros(2, device="meta", dtype=torch.float16))
    with half_precision_products(torch.zeros(2, dtype=torch.bfloat16)):
        assert not torch.backends.cuda.matmul.allow_tf32


@pytest.mark.parametrize(
    "user",
    ["default", "legacy-highest", "new-ieee", "new-tf32", "legacy-high", "global-tf32"],
)
def test_the_setting_is_tf32_inside_and_exactly_restored(user, monkeypatch, restore_settings):
    """Whatever the user set (torch's old or new API), inside TF32 products are allowed with both settings agreeing
    (torch refuses a product otherwise) and on leaving every setting reads as before."""
    matmul = torch.backends.cuda.matmul
    if user == "legacy-highest":
        matmul.allow_tf32 = False
    elif user == "new-ieee":
        matmul.fp32_precision = "ieee"
    elif user == "new-tf32":
        matmul.fp32_precision = "tf32"
    elif user == "legacy-high":
        torch.set_float32_matmul_precision("high")
    elif user == "global-tf32":
        torch.backends.fp32_precision = "tf32"
    before = _settings()
    monkeypatch.setattr(tensor_cores, "exact_on_tensor_cores", lambda source: True)
    with half_precision_products(torch.zeros(1)):
        if user not in ("new-tf32", "global-tf32"):  # (those mix the two APIs themselves: torch refuses to read them)
            assert matmul.allow_tf32
        assert user == "global-tf32" or matmul.fp32_precision == "tf32"
    assert _settings() == before


def test_the_setting_is_restored_when_the_block_raises(monkeypatch, restore_settings):
    before = _settings()
    monkeypatch.setattr(tensor_cores, "exact_on_tensor_cores", lambda source: True)
    with pytest.raises(RuntimeError, match="inside"), half_precision_products(torch.zeros(1)):
        raise RuntimeError("inside")
    assert _settings() == before


@pytest.mark.parametrize("module", ["linear", "conv", "layernorm"])
@pytest.mark.parametrize("loss_scale", [1.0, 1024.0, 3.0])
def test_factor_products_allow_tf32_only_for_raw_values_and_exact_scales(module, loss_scale, monkeypatch, restore_settings):
    """The hooks' Grams run with TF32 allowed (where the input qualifies) for Linear and convolution layers, whose
    Grams multiply the values as they came; not for a norm layer's (it multiplies values it computed), nor for a
    G whose loss scale is not a power of two (dividing by it rounds)."""
    import torch.nn as nn

    from spdkfac.kfac.layers import KFACLayer, make_helper

    net = {"linear": nn.Linear(4, 3), "conv": nn.Conv2d(4, 3, 3, padding=1), "layernorm": nn.LayerNorm(4)}[module]
    layer = KFACLayer("layer", make_helper(net, norm_layers=True))
    seen: list[bool] = []
    for name in ("input_gram", "output_gram"):
        real = getattr(layer.helper, name)

        def spy(*args, real=real):
            seen.append(torch.backends.cuda.matmul.allow_tf32)
            return real(*args)

        monkeypatch.setattr(layer.helper, name, spy)
    monkeypatch.setattr(tensor_cores, "exact_on_tensor_cores", lambda source: True)
    x = torch.randn(2, 4, 5, 5) if module == "conv" else torch.randn(2, 4)
    layer.compute_a(x)
    layer.compute_g(net(x).detach(), loss_scale=loss_scale)
    raw = module != "layernorm"
    assert seen == [raw, raw and loss_scale != 3.0]
    assert not torch.backends.cuda.matmul.allow_tf32
