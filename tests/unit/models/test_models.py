"""ImageNet model zoo: parameter counts, K-FAC layer structure, small-input forward passes, stats script."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from spdkfac.kfac.layers import kfac_layers
from spdkfac.models import MODELS, get_model
from spdkfac.models.imagenet import InceptionV4

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

EXACT_PARAMS = {"resnet50": 25_557_032, "resnet152": 60_192_808, "densenet201": 20_013_928}
INCEPTION_V4_PARAMS = 42.7e6
# Small input side used for the forward-pass check of each model.
SMALL_SIDE = {"resnet50": 64, "resnet152": 64, "densenet201": 64, "inception_v4": InceptionV4.MIN_INPUT}


def _slow_if(name: str, *slow: str):
    """A parameter, marked slow (skipped in the fast loop) for the largest models."""
    return pytest.param(name, marks=pytest.mark.slow) if name in slow else name


def _n_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _kfac_layers(model: nn.Module):
    return kfac_layers(model)


@pytest.mark.parametrize("name", [_slow_if(n, "resnet152") for n in sorted(EXACT_PARAMS)])
def test_exact_parameter_counts(name):
    assert _n_params(get_model(name, num_classes=1000)) == EXACT_PARAMS[name]


@pytest.mark.slow
def test_inception_v4_parameter_count():
    n = _n_params(get_model("inception_v4", num_classes=1000))
    assert abs(n - INCEPTION_V4_PARAMS) <= 0.01 * INCEPTION_V4_PARAMS, n


def test_resnet50_kfac_layers():
    model = get_model("resnet50", num_classes=1000)
    layers = _kfac_layers(model)
    convs = [layer for layer in layers if isinstance(layer.module, nn.Conv2d)]
    fcs = [layer for layer in layers if isinstance(layer.module, nn.Linear)]
    assert (len(layers), len(convs), len(fcs)) == (54, 53, 1)
    assert all(not layer.has_bias for layer in convs)
    for layer in convs:
        kh, kw = layer.module.kernel_size
        assert layer.a_dim == layer.module.in_channels * kh * kw
        assert layer.g_dim == layer.module.out_channels
    assert (fcs[0].a_dim, fcs[0].g_dim) == (2049, 1000)
    assert max(layer.a_dim for layer in layers) == 4608


@pytest.mark.parametrize("name", [_slow_if(n, "resnet152", "inception_v4") for n in sorted(SMALL_SIDE)])
def test_small_forward(name):
    torch.manual_seed(0)
    model = get_model(name, num_classes=7).eval()
    side = SMALL_SIDE[name]
    with torch.no_grad():
        out = model(torch.randn(1, 3, side, side))
    assert out.shape == (1, 7)
    assert torch.isfinite(out).all()


@pytest.mark.slow
def test_inception_v4_minimum_input():
    assert InceptionV4.MIN_INPUT == 75
    model = get_model("inception_v4", num_classes=3).eval()
    with torch.no_grad(), pytest.raises(RuntimeError):
        model(torch.randn(1, 3, 74, 74))


def test_registered_and_unknown_name():
    for name in ("resnet50", "resnet152", "densenet201", "inception_v4"):
        assert name in MODELS
    with pytest.raises(ValueError, match="unknown model 'nope'"):
        get_model("nope")


@pytest.mark.slow
def test_model_stats_script(tmp_path):
    out = tmp_path / "stats"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.model_stats", "--models", "resnet50", "--out-dir", str(out)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "resnet50" in proc.stdout
    stats = json.loads((out / "model_stats.json").read_text())["models"]["resnet50"]
    assert stats["params"] == EXACT_PARAMS["resnet50"]
    assert (stats["layers"], stats["num_a"], stats["num_g"], stats["max_dim"]) == (54, 54, 54, 4608)
    assert round(stats["a_elems"] / 1e6, 1) == 62.3
    assert round(stats["g_elems"] / 1e6, 1) == 14.6
    arithmetic = stats["arithmetic"]
    assert (arithmetic["resolution"], arithmetic["batch_size"]) == (224, 32)
    assert round(arithmetic["gflop"]["precondition"], 1) == 156.2  # sum of 2 g a (g + a) over ResNet-50's layers
    assert 1 < arithmetic["floor_distributed_preconditioning"] < arithmetic["floor"]
    png = (out / "factor_sizes.png").read_bytes()
    assert png.startswith(b"\x89PNG")
    assert len(png) > 1000


def test_kfac_arithmetic_counts_by_hand():
    from benchmarks.model_stats import arithmetic_floor, kfac_arithmetic

    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 6, 1, stride=2, bias=False), nn.Flatten(), nn.Linear(6 * 4 * 4, 10))
    ops = kfac_arithmetic(model, (2, 3, 8, 8))
    r1, r2, r3 = 2 * 8 * 8, 2 * 4 * 4, 2  # rows: samples x output positions
    assert ops["forward_backward"] == 3 * 2 * (r1 * 27 * 4 + r2 * 4 * 6 + r3 * 96 * 10)
    assert ops["precondition"] == 2 * (4 * 28 * 32 + 6 * 4 * 10 + 10 * 97 * 107)
    assert ops["factor_g"] == r1 * 4 * 5 + r2 * 6 * 7 + r3 * 10 * 11
    assert ops["factor_a_unfolded"] == r1 * 28 * 29
    assert ops["factor_a_plain"] == r2 * 4 * 5 + r3 * 97 * 98
    floor = arithmetic_floor(ops, factor_every=10, dp_workers=2)
    expected = 1 + (ops["precondition"] / 2 + (ops["factor_g"] + ops["factor_a_plain"]) / 10) / ops["forward_backward"]
    assert floor == pytest.approx(expected)
    assert floor < arithmetic_floor(ops, factor_every=10)
    assert next(model.parameters()).device.type == "cpu"  # the model itself is left alone
