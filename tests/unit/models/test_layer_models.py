"""The zoo's networks with grouped and depthwise convolutions, and the optimizer's coverage summary."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from nets import mixed_net

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.kfac.layers import kfac_layers
from spdkfac.models import get_model

# torchvision's counts for the same architectures (1000 classes).
PARAMS = {"mobilenet_v2": 3_504_872, "resnext50_32x4d": 25_028_904, "efficientnet_b0": 5_288_548}
# (preconditioned layers, of them with block-diagonal factors)
LAYERS = {"mobilenet_v2": (53, 17), "resnext50_32x4d": (54, 16), "efficientnet_b0": (82, 16)}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_and_kfac_layers(name):
    model = get_model(name, num_classes=1000)
    assert sum(p.numel() for p in model.parameters()) == PARAMS[name]
    layers = kfac_layers(model)
    assert (len(layers), sum(layer.shape("A").blocks > 1 for layer in layers)) == LAYERS[name]
    if name == "resnext50_32x4d":
        assert {layer.shape("A").blocks for layer in layers} == {1, 32}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n != "mobilenet_v2" else n for n in sorted(PARAMS)])
def test_32x32_variants_train_one_step(name):
    torch.manual_seed(0)
    model = get_model(f"{name}_32", num_classes=10)
    opt = SPDKFACOptimizer(model, lr=0.01, backend="single", damping=0.1)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    before = [p.detach().clone() for p in model.parameters()]
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_kfac_summary_names_what_gets_the_base_update():
    model = nn.Sequential(mixed_net(), nn.Embedding(3, 2, sparse=True), nn.Linear(2, 2))
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", skip_layers=["2"])
    summary = opt.kfac_summary()
    total = sum(p.numel() for p in model.parameters())
    covered = sum(p.numel() for layer in opt.layers for p in layer.params())
    assert f"K-FAC preconditions 9 layers: {covered:,} of {total:,}" in summary
    assert "1 x Conv2d (depthwise, block-diagonal)" in summary
    assert "1 x Conv2d (grouped, block-diagonal)" in summary
    assert "1 x ConvTranspose1d\n" in summary
    assert "1 x Conv3d\n" in summary
    assert "1 x ConvTranspose2d (grouped, block-diagonal)" in summary
    assert "1 x Embedding (diagonal A)" in summary
    assert "1 x GroupNorm, 1 x LayerNorm: normalisation layer: norm_layers='plain'" in summary
    assert "1 x Embedding: not supported: sparse gradients" in summary
    assert "1 x Linear: listed in skip_layers" in summary
    assert f"momentum SGD, not preconditioned, for {total - covered:,} parameters:" in summary


@pytest.mark.parametrize(("base", "left_to"), [("adamw", "AdamW"), ("lamb", "LAMB"), (None, "Your optimizer's update")])
def test_kfac_summary_names_the_update_the_rest_gets(base, left_to):
    """The parameters K-FAC leaves out get the base update (AdamW, LAMB) or, under the preconditioner, the user's."""
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    if base is None:
        summary = KFACPreconditioner(model, backend="single").kfac_summary()
    else:
        summary = SPDKFACOptimizer(model, lr=0.1, base=base, backend="single").kfac_summary()
    assert f"\n{left_to}, not preconditioned, for 8 parameters:\n  1 x LayerNorm" in summary


def test_kfac_summary_counts_a_tied_weight_once():
    """An embedding tied to its output layer and a second output layer with its own bias, all one parameter of three
    modules: it is counted once among the reasons."""
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 10, bias=False), nn.Linear(4, 10))
    model[3].weight = model[4].weight = model[0].weight
    with pytest.warns(UserWarning, match="tied weights"):
        summary = SPDKFACOptimizer(model, lr=0.1, backend="single").kfac_summary()
    assert "momentum SGD, not preconditioned, for 58 parameters:\n" in summary
    assert "1 x Embedding, 2 x Linear: its weight is shared by ['0.weight', '3.weight', '4.weight'] (tied weights)" in summary
    assert summary.endswith(
        "(50 parameters)\n  1 x LayerNorm: normalisation layer: norm_layers='plain' "
        "(norm_layers='kfac' gives it scale-and-shift curvature) (8 parameters)"
    )


def test_kfac_summary_says_a_class_of_its_own_has_no_layer_type():
    class Tokens(nn.Module):  # a class token: parameters its own forward() uses
        def __init__(self) -> None:
            super().__init__()
            self.cls = nn.Parameter(torch.zeros(1, 1, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.cls.expand(x.shape[0], 1, 4), x], dim=1)

    summary = SPDKFACOptimizer(nn.Sequential(Tokens(), nn.Linear(4, 2)), lr=0.1, backend="single").kfac_summary()
    assert "\n  1 x Tokens: no K-FAC layer type for this class (custom norms, tokens, fused experts: a new type is a plug-in" in summary
