"""The simulator's parts: it replays the optimizer's work plan, and its profile files are typed and versioned."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_simulate import _perf, _profile, _with_preconditioning

from spdkfac.plan import work_plan
from spdkfac.plan.placement import PlacementPlan
from spdkfac.plan.work_plan import LayerShape, WorkPlan
from spdkfac.simulate import (
    FORMAT_VERSION,
    Profile,
    load_profiles,
    measure_profile,
    predict,
    prediction,
    profile_from_dict,
    upgrade_unversioned,
)

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def _shapes(prof):
    dims = {(f["kind"], f["layer"]): f["dim"] for f in prof["factors"]}
    return [LayerShape(name, dims[("A", name)], dims[("G", name)]) for kind, name in dims if kind == "A"]


@pytest.mark.parametrize(
    ("variant", "placement", "distributed"),
    [
        ("spdkfac", "lbp", False),
        ("mpdkfac", "seq", False),
        ("dkfac", "local", False),
        ("spdkfac-dp", "lbp", True),
    ],
)
def test_predict_places_inversions_and_preconditioning_with_the_optimizers_work_plan(monkeypatch, variant, placement, distributed):
    raw = _with_preconditioning(_profile())
    perf = _perf()
    made = []
    original = WorkPlan.make.__func__

    def spy(cls, *args, **kwargs):
        plan = original(cls, *args, **kwargs)
        made.append(plan)
        return plan

    monkeypatch.setattr(prediction.WorkPlan, "make", classmethod(spy))
    predict(profile_from_dict(raw), perf, 4, variant)
    assert len(made) == 1
    expected = WorkPlan.make(_shapes(raw), 4, perf.scaled_to(4), placement, "inverse", distributed)
    assert [(a.key, a.owner) for a in made[0].inversion.assignments] == [(a.key, a.owner) for a in expected.inversion.assignments]
    assert made[0].preconditioners == expected.preconditioners
    assert bool(expected.preconditioners) == distributed


def test_predict_has_no_placement_of_its_own(monkeypatch):
    """Another work plan (every factor on rank 0) changes the prediction: the plan is the one predict charges."""
    prof, perf = profile_from_dict(_profile()), _perf()
    balanced = predict(prof, perf, 4, "mpdkfac")
    make = WorkPlan.make

    def all_on_rank0(cls, layers, workers, perf, placement, compute_method, distribute_preconditioning=False, **kwargs):
        plan = make(layers, workers, perf, placement, compute_method, distribute_preconditioning, **kwargs)
        moved = [replace(a, owner=0) for a in plan.inversion.assignments]
        return replace(plan, inversion=PlacementPlan(placement, workers, moved))

    monkeypatch.setattr(prediction.WorkPlan, "make", classmethod(all_on_rank0))
    lopsided = predict(prof, perf, 4, "mpdkfac")
    inversions = sum(perf.inverse(f.dim) for f in prof.factors)
    assert lopsided["InverseComp"] == pytest.approx(inversions / 4)  # the mean rank's, as the timeline records it
    stage = lopsided["InverseComp"] + lopsided["InverseComm"]  # every rank waits for rank 0
    assert stage >= inversions
    assert balanced["InverseComp"] + balanced["InverseComm"] < stage / 2


def test_predict_takes_fusion_groups_and_the_overlap_rule_from_the_work_plan(monkeypatch):
    calls = {"fusion": [], "overlap": []}
    fusion, overlap = work_plan.fusion_groups, work_plan.overlaps_preconditioning

    def fusion_spy(*args, **kwargs):
        calls["fusion"].append(args)
        return fusion(*args, **kwargs)

    def overlap_spy(*args, **kwargs):
        calls["overlap"].append(args)
        return overlap(*args, **kwargs)

    monkeypatch.setattr(prediction, "fusion_groups", fusion_spy)
    monkeypatch.setattr(prediction, "overlaps_preconditioning", overlap_spy)
    predict(profile_from_dict(_with_preconditioning(_profile())), _perf(), 2, "dkfac:fusion_threshold_bytes=64", update_freq=(10, 100))
    assert [args[:2] for args in calls["fusion"]] == [("threshold", False)] * 2  # A pass, G pass
    assert all(args[6] == 64 for args in calls["fusion"])  # the variant's threshold reaches the planner
    assert (False, True, 2, False) in calls["overlap"]  # D-KFAC disables the overlap; the rule is asked per step kind


def test_an_unversioned_profile_is_read_through_the_one_upgrade():
    old = load_profiles([str(RESULTS / "profile_resnet50.json")])  # pack_unpack only, no invert, no sgd_grad_wait
    assert isinstance(old, Profile)
    assert old.format_version == FORMAT_VERSION
    assert old.untimed_unpack == 0.0
    assert all(f.unpack == f.pack == 0.0 and f.invert is None for f in old.factors)
    assert old.sgd_grad_wait == 0.0
    assert old.comm_workers == 2
    assert len(old.precondition) == len(old.factors) // 2
    raw = _profile()
    raw["unpack"] = 0.25  # a total only: every rank pays it
    upgraded = upgrade_unversioned(raw)
    assert upgraded.untimed_unpack == 0.25
    assert upgraded.comm_workers == 1
    assert upgraded.precondition == ()
    for f in raw["factors"]:
        f["unpack"], f["pack"], f["invert"] = 0.01, 0.002, 0.003
    timed = upgrade_unversioned(raw)
    assert timed.untimed_unpack == 0.0
    assert all((f.unpack, f.pack, f.invert) == (0.01, 0.002, 0.003) for f in timed.factors)
    raw["factors"][0].pop("invert")  # not every inversion timed: none counts as timed
    assert all(f.invert is None for f in upgrade_unversioned(raw).factors)


def test_a_newer_profile_version_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps(dict(_profile(), format_version=FORMAT_VERSION + 1)))
    with pytest.raises(ValueError, match=f"{path}.*format_version {FORMAT_VERSION + 1}"):
        load_profiles([str(path)])
    path.write_text(json.dumps(dict(upgrade_unversioned(_profile()).to_dict(), surprise=1)))
    with pytest.raises(ValueError, match="unknown field"):
        load_profiles([str(path)])


def test_measured_profile_round_trips_through_its_file(tmp_path):
    prof = measure_profile("cifar_resnet20", resolution=8, batch_size=2, iters=1)
    path = tmp_path / "profile.json"
    prof.save(str(path))
    assert json.loads(path.read_text())["format_version"] == FORMAT_VERSION
    loaded = load_profiles([str(path)])
    assert loaded == prof
    assert predict(loaded, _perf(), 2, "spdkfac") == predict(prof, _perf(), 2, "spdkfac")


def test_predict_refuses_an_untyped_profile():
    with pytest.raises(TypeError, match="profile_from_dict"):
        predict(_profile(), _perf(), 2, "spdkfac")


def test_the_plan_sees_the_layers_in_the_optimizers_order(monkeypatch):
    """The preconditioning entries are recorded in ``opt.layers`` order, which the optimizer plans with."""
    raw = _with_preconditioning(_profile())
    raw["precondition"] = raw["precondition"][::-1]  # a model whose A factors become ready in another order
    seen = []
    make = WorkPlan.make

    def spy(cls, layers, *args, **kwargs):
        seen.append([s.name for s in layers])
        return make(layers, *args, **kwargs)

    monkeypatch.setattr(prediction.WorkPlan, "make", classmethod(spy))
    predict(profile_from_dict(raw), _perf(), 2, "spdkfac")
    predict(profile_from_dict(_profile()), _perf(), 2, "spdkfac")  # no entries: the A factors' order
    assert seen == [[f"l{i}" for i in reversed(range(6))], [f"l{i}" for i in range(6)]]
