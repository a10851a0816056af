"""Fitting recovers known parameters; bad files are rejected with reasons."""

import json
import math
import warnings

import numpy as np
import pytest
import torch

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.methods import get_method
from spdkfac.perfmodels import PerfModel, PerfModelError, fit_exponential, fit_inverse_model, fit_linear, load_perf_model
from spdkfac.perfmodels.models import EIGEN_OVER_INVERSE


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
    assert a == pytest.approx(1e-4, rel=1e-6)
    assert b == pytest.approx(7e-4, rel=1e-6)
    model, quality = fit_inverse_model(d, t)
    assert model.kind == "exp" or quality["cubic"]["mean_rel_error"] < quality["exp"]["mean_rel_error"]


def test_cubic_chosen_when_exponential_fits_badly():
    d = np.array([64, 128, 256, 512, 1024, 2048, 4096], dtype=float)
    t = 1e-5 + 2e-11 * d**3  # CPU-like: cubic growth
    model, quality = fit_inverse_model(d, t)
    assert model.kind == "cubic"
    assert quality["chosen"] == "cubic"
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
    ("mutate", "match"),
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
    assert model.inverse(2304) == 0.25
    assert model.inverse.fitted(2304) == pytest.approx(1e-5 + 1e-11 * 2304**3)
    assert model.inverse(2048) == model.inverse.fitted(2048)
    assert model.broadcast(64) == 0.002
    assert model.broadcast(65) == model.broadcast.fitted(65)
    data["inverse"]["measured"] = {"100": -1.0}
    with pytest.raises(PerfModelError, match=r"inverse.measured\[100\] must be positive"):
        PerfModel.from_dict(data)


def test_eigen_curve_round_trips_and_is_what_eigen_plans_with(tmp_path):
    data = _valid()
    data["eigen"] = {"kind": "cubic", "coeffs": [2e-5, 0, 0, 9e-11], "floor": 2e-5, "measured": {"512": 0.05}}
    path = tmp_path / "m.json"
    PerfModel.from_dict(data, "m.json").save(path)
    model = PerfModel.load(path)
    assert model.eigen is not None
    assert model.eigen.kind == "cubic"
    assert model.eigen.measured == {512: 0.05}
    assert model.to_dict()["eigen"] == PerfModel.from_dict(data).to_dict()["eigen"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a file with the curve: no estimate, no warning
        assert get_method("eigen").curve(model)(512) == 0.05
        assert get_method("eigen").curve(model)(1000) == pytest.approx(2e-5 + 9e-11 * 1000**3)
        assert get_method("inverse").curve(model) is model.inverse
    data["eigen"]["kind"] = "quartic"
    with pytest.raises(PerfModelError, match=r"eigen.kind must be"):
        PerfModel.from_dict(data)


def test_file_without_eigen_curve_loads_and_eigen_estimates_from_inverse_with_one_warning(tmp_path):
    data = _valid()
    data.pop("eigen", None)  # a file from before the eigen method
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    model = PerfModel.load(path)
    assert model.eigen is None
    assert "eigen" not in model.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        get_method("inverse").curve(model)
    with pytest.warns(UserWarning, match=f"has no eigendecomposition model: estimating it as {EIGEN_OVER_INVERSE:g}x the inversion model"):
        estimate = get_method("eigen").curve(model)
    assert estimate(1024) == pytest.approx(EIGEN_OVER_INVERSE * model.inverse(1024))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per model
        get_method("eigen").curve(model)


@pytest.mark.slow
def test_benchmark_fits_the_eigen_curve(tmp_path):
    from spdkfac.comm import get_backend
    from spdkfac.perfmodels.bench import BenchmarkConfig, run_benchmark

    cfg = BenchmarkConfig(quick=True, repeats=3, warmup=1, inverse_dims=[16, 32, 48, 64])
    model = run_benchmark(cfg, get_backend("single"))
    assert model.measurements["eigen"]["dims"] == [16, 32, 48, 64]
    assert all(t > 0 for t in model.measurements["eigen"]["seconds"])
    assert model.eigen is not None
    assert set(model.eigen.measured) == {16, 32, 48, 64}
    assert model.fit_quality["eigen"]["chosen"] == model.eigen.kind
    model.save(tmp_path / "m.json")
    assert PerfModel.load(tmp_path / "m.json").eigen.measured == model.eigen.measured
    skipped = run_benchmark(BenchmarkConfig(quick=True, repeats=3, warmup=1, inverse_dims=[16, 32], eigen=False), get_backend("single"))
    assert skipped.eigen is None
    assert "eigen" not in skipped.measurements


def test_scaled_to_another_worker_count_is_what_the_optimizer_and_the_simulator_plan_with():
    import math

    from spdkfac.simulate import ScaledModels

    model = PerfModel.default()
    model.meta["world_size"] = 2
    eight = model.scaled_to(8)
    assert eight.allreduce.alpha == pytest.approx(model.allreduce.alpha * 7)
    assert eight.allreduce.beta == pytest.approx(model.allreduce.beta * (7 / 8) / (1 / 2))
    assert eight.broadcast(64) == pytest.approx(model.broadcast(64) * math.ceil(math.log2(8)))
    assert eight.inverse(64) == model.inverse(64)
    assert eight.world_size == 8
    assert model.scaled_to(2) is model
    assert model.scaled_to(1) is model
    sim = ScaledModels(model, 8)
    assert sim.ar_alpha == eight.allreduce.alpha
    assert sim.broadcast(64) == eight.broadcast.payload(64 * 65 // 2)


def _uncalibrated(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if "uncalibrated default performance model" in str(w.message)]


def test_one_worker_plans_nothing_with_the_default_and_is_not_warned():
    """The default model decides fusion and placement, which one worker does not have: no warning there."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SPDKFACOptimizer(model, lr=0.1)
        KFACPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert not _uncalibrated(caught)


@pytest.mark.parametrize("build", ["optimizer", "preconditioner"])
def test_several_workers_are_warned_once_at_the_users_line(build):
    models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)) for _ in range(2)]

    def construct(backend):
        model = models[backend.rank]
        if build == "optimizer":
            opt = SPDKFACOptimizer(model, lr=0.1, backend=backend)
        else:
            opt = KFACPreconditioner(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), backend=backend).kfac
        opt.replan()  # (plans again for the same workers: said once per optimizer)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_ranks(2, construct)
    found = _uncalibrated(caught)
    assert len(found) == 2  # once on each rank
    assert all(w.filename == __file__ for w in found), [w.filename for w in found]
