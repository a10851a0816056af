"""Fitting recovers known parameters; bad files are rejected with reasons."""
import json
import math
import warnings

import numpy as np
import pytest

from spdkfac.perfmodels import PerfModel, PerfModelError, fit_exponential, fit_inverse_model, fit_linear, load_perf_model


def test_fit_linear_recovers_parameters():
    m = np.logspace(3, 8, 12)
    t = 3e-4 + 2e-9 * m
    alpha, beta = fit_linear(m, t)
    assert alpha == pytest.approx(3e-4, rel=1e-6)
    assert beta == pytest.approx(2e-9, rel=1e-6)


def test_fit_exponential_recovers_parameters():
    d = np.array([64, 128, 256, 512, 1024, 2048, 4096])
    t = 1e-4 * np.exp(7e-4 * d)
    a, b = fit_exponential(d, t)
    assert a == pytest.approx(1e-4, rel=1e-6) and b == pytest.approx(7e-4, rel=1e-6)
    model, quality = fit_inverse_model(d, t)
    assert model.kind == "exp" or quality["cubic"]["mean_rel_error"] < quality["exp"]["mean_rel_error"]


def test_cubic_chosen_when_exponential_fits_badly():
    d = np.array([64, 128, 256, 512, 1024, 2048, 4096], dtype=float)
    t = 1e-5 + 2e-11 * d**3  # CPU-like: cubic growth
    model, quality = fit_inverse_model(d, t)
    assert model.kind == "cubic" and quality["chosen"] == "cubic"
    for x, y in zip(d, t):
        assert model(x) == pytest.approx(y, rel=0.05)


def _valid():
    return PerfModel.default().to_dict() | {"meta": {"world_size": 2}}


def test_roundtrip_file(tmp_path):
    p = tmp_path / "m.json"
    PerfModel.from_dict(_valid()).save(p)
    loaded = PerfModel.load(p)
    assert loaded.allreduce.alpha == PerfModel.default().allreduce.alpha
    assert loaded.world_size == 2


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("broadcast"), "missing field"),
        (lambda d: d["allreduce"].update(alpha=-1.0), "allreduce.alpha must be positive"),
        (lambda d: d["broadcast"].update(beta=math.inf), "broadcast.beta must be positive and finite"),
        (lambda d: d["inverse"].update(kind="quartic"), "inverse.kind"),
        (lambda d: d["allreduce"].pop("beta"), "missing or malformed"),
    ],
)
def test_bad_files_rejected(tmp_path, mutate, match):
    data = _valid()
    mutate(data)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(data))
    with pytest.raises(PerfModelError, match=match):
        PerfModel.load(p)


def test_not_json(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("{nope")
    with pytest.raises(PerfModelError, match="not valid JSON"):
        PerfModel.load(p)


def test_world_size_mismatch_warns():
    model = PerfModel.from_dict(_valid(), "file.json")
    with pytest.warns(UserWarning, match="measured with 2 workers but this run has 4"):
        model.check_world_size(4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.check_world_size(2)


def test_default_warns():
    with pytest.warns(UserWarning, match="uncalibrated default"):
        load_perf_model(None)


def test_measured_dimensions_take_precedence(tmp_path):
    data = _valid()
    data["inverse"] = {"kind": "cubic", "coeffs": [1e-5, 0, 0, 1e-11], "floor": 1e-5, "measured": {"2304": 0.25}}
    data["broadcast"]["measured"] = {"64": 0.002}
    path = tmp_path / "m.json"
    PerfModel.from_dict(data).save(path)
    model = PerfModel.load(path)
    assert model.inverse(2304) == 0.25 and model.inverse.fitted(2304) == pytest.approx(1e-5 + 1e-11 * 2304**3)
    assert model.inverse(2048) == model.inverse.fitted(2048)
    assert model.broadcast(64) == 0.002 and model.broadcast(65) == model.broadcast.fitted(65)
    data["inverse"]["measured"] = {"100": -1.0}
    with pytest.raises(PerfModelError, match=r"inverse.measured\[100\] must be positive"):
        PerfModel.from_dict(data)
