"""A frozen bias (``bias.requires_grad_(False)``, trainable weight) is a constant of its layer, as if it had none.

Before, ``A`` kept the bias's ones column, so the weight was preconditioned
with the factors of weight and bias together (a different update than the
weight's own factors give), and the bias column of the update was written
to the frozen bias's ``.grad``, where ``zero_grad()`` of the optimizer never
cleared it. The reference is the same model with bias-free layers and the
biases added as constants.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")


class _Net(nn.Module):
    """A convolution, a Linear layer and a LayerNorm whose biases are frozen (``constants``: bias-free layers with
    the same biases added as buffers), then a Linear head with a trainable bias."""

    def __init__(self, constants: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.linear = nn.Linear(75, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)
        with torch.no_grad():
            self.norm.bias.normal_()
        self.constants = constants
        if constants:
            for name in ("conv", "linear", "norm"):
                module = getattr(self, name)
                self.register_buffer(f"{name}_bias", module.bias.detach().clone())
                module.bias = None
        else:
            for module in (self.conv, self.linear, self.norm):
                module.bias.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.constants:
            return self.head(torch.tanh(self.norm(self.linear(self.conv(x).flatten(1)))))
        h = self.conv(x) + self.conv_bias.view(1, -1, 1, 1)
        h = self.linear(h.flatten(1)) + self.linear_bias
        return self.head(torch.tanh(self.norm(h) + self.norm_bias))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(8, 2, 5, 5, generator=g), torch.randint(0, 3, (8,), generator=g)


@pytest.mark.parametrize("compute_method", ["inverse", "eigen", "ekfac"])
def test_a_frozen_bias_trains_as_a_constant(compute_method, float64):
    results = []
    for constants in (False, True):
        model = _Net(constants)
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", norm_layers="kfac", compute_method=compute_method)
        x, y = _data()
        for s in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x + 0.1 * s), y).backward()
            opt.step()
        results.append((model, opt))
    (frozen, frozen_opt), (constant, constant_opt) = results
    assert [la.shapes for la in frozen_opt.layers] == [la.shapes for la in constant_opt.layers]  # (no ones column)
    for name in ("conv", "linear", "norm"):
        module = getattr(frozen, name)
        assert module.bias.grad is None, name  # nothing written to a frozen parameter
        torch.testing.assert_close(module.bias, getattr(constant, f"{name}_bias"), rtol=0, atol=0)
        torch.testing.assert_close(module.weight, getattr(constant, name).weight, rtol=1e-10, atol=1e-12, msg=name)
    torch.testing.assert_close(frozen.head.weight, constant.head.weight, rtol=1e-10, atol=1e-12)


def test_a_bias_unfrozen_later_joins_its_layer_whose_factors_start_anew(float64):
    """Unfrozen between steps, the bias gets the ones column back: that layer's factors start from the identity
    (their shape changed), the other layers keep theirs, and the bias trains."""
    model = _Net(constants=False)
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    x, y = _data()
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    head_a = next(la for la in opt.layers if la.name == "head").A
    model.linear.bias.requires_grad_(True)
    bias = model.linear.bias.detach().clone()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    layers = {la.name: la for la in opt.layers}
    assert layers["linear"].has_bias
    assert layers["linear"].a_dim == 76
    assert not torch.equal(model.linear.bias, bias)
    assert not torch.equal(layers["head"].A, torch.eye(9))
    assert not torch.equal(layers["head"].A, head_a)  # (kept and updated, not started anew)
    decay = 0.95
    a = layers["linear"].A
    torch.testing.assert_close(a[-1, -1], torch.tensor(decay + (1 - decay) * 1.0, dtype=a.dtype))  # one factor step from I
