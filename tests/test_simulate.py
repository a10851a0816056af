"""The scale simulator's event model on a hand-made profile."""
import pytest

from spdkfac.perfmodels import PerfModel
from spdkfac.simulate import ScaledModels, predict


def _profile(n_layers=6, dim=256):
    factors = []
    for kind in ("A", "G"):
        for i in range(n_layers):
            factors.append({"kind": kind, "layer": f"l{i}", "dim": dim + 64 * i, "ready": 0.01 * (i + 1), "compute": 0.002,
                            "grad_numel": 10000 if kind == "G" else 0})
    return {"forward": 0.07, "backward": 0.12, "step_other": 0.01, "sgd_step": 0.002, "other_grad_numel": 500, "factors": factors}


def _perf(world=2):
    d = PerfModel.default().to_dict()
    d["meta"] = {"world_size": world}
    d["allreduce"] = {"alpha": 1e-3, "beta": 1e-8}
    d["broadcast"] = {"alpha": 1e-3, "beta": 1e-9}
    d["inverse"] = {"kind": "cubic", "coeffs": [1e-5, 0, 0, 1e-9], "floor": 1e-5}
    return PerfModel.from_dict(d)


def test_single_worker_has_no_communication():
    r = predict(_profile(), _perf(), 1, "spdkfac")
    assert r["GradComm"] == r["FactorComm"] == r["InverseComm"] == 0.0
    assert r["iteration"] == pytest.approx(sum(r[k] for k in ("FF&BP", "FactorComp", "InverseComp", "Other")))


def test_sgd_has_no_kfac_parts():
    r = predict(_profile(), _perf(), 4, "sgd")
    assert r["FactorComp"] == r["FactorComm"] == r["InverseComp"] == r["InverseComm"] == 0.0


def test_spdkfac_not_slower_than_baselines_without_contention():
    prof, perf = _profile(), _perf()
    for p in (2, 4, 8):
        spd = predict(prof, perf, p, "spdkfac")["iteration"]
        assert spd <= predict(prof, perf, p, "dkfac")["iteration"] + 1e-12
        assert spd <= predict(prof, perf, p, "mpdkfac")["iteration"] + 1e-12


def test_contention_exposes_all_communication():
    prof, perf = _profile(), _perf()
    free = predict(prof, perf, 2, "spdkfac")
    busy = predict(prof, perf, 2, "spdkfac", contention=True)
    assert busy["GradComm"] + busy["FactorComm"] > free["GradComm"] + free["FactorComm"]


def test_amortised_updates_shrink_kfac_parts():
    prof, perf = _profile(), _perf()
    every = predict(prof, perf, 2, "spdkfac")
    amort = predict(prof, perf, 2, "spdkfac", update_freq=(10, 100))
    assert amort["InverseComp"] == pytest.approx(every["InverseComp"] / 100)
    assert amort["FactorComp"] == pytest.approx(every["FactorComp"] / 10)


def test_ring_scaling_of_allreduce():
    m2, m8 = ScaledModels(_perf(2), 2), ScaledModels(_perf(2), 8)
    assert m2.allreduce(1e6) == pytest.approx(1e-3 + 1e-8 * 1e6)
    assert m8.ar_alpha == pytest.approx(7e-3)
    assert m8.ar_beta == pytest.approx(1e-8 * (7 / 8) / (1 / 2))
    assert m8.broadcast(100) == pytest.approx(3 * _perf().broadcast(100))
