"""Files and output paths outside the training job: versions checked, profiles validated, outputs checked up front."""

import dataclasses
import json
import math
from pathlib import Path

import pytest
from test_simulate import _perf, _profile

from spdkfac.perfmodels import PerfModel, PerfModelError
from spdkfac.perfmodels import models as perf_models
from spdkfac.perfmodels.__main__ import main as perfmodels_main
from spdkfac.perfmodels.file_version import FormatVersionError, check_format_version
from spdkfac.simulate import load_profiles, main, profile_check, profile_file, profile_from_dict

ROOT = Path(__file__).resolve().parents[3]


# -- format_version --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["perfmodels/reference-cpu-gloo-2.json", "benchmarks/results/simulator_check/perfmodel.json"])
def test_the_shipped_performance_models_still_load(path):
    assert json.loads((ROOT / path).read_text())["format_version"] == perf_models.FORMAT_VERSION
    assert PerfModel.load(ROOT / path).allreduce.alpha > 0


def test_a_newer_performance_model_is_refused_naming_the_file_and_both_versions(tmp_path):
    path = tmp_path / "future.json"
    path.write_text(json.dumps(dict(PerfModel.default().to_dict(), format_version=99)))
    with pytest.raises(PerfModelError, match=rf"{path} has format_version 99, newer .*up to {perf_models.FORMAT_VERSION}"):
        PerfModel.load(path)


@pytest.mark.parametrize(("version", "match"), [(0, "got 0"), ("1", "got '1'"), (True, "got True"), (1.5, "got 1.5"), (None, "got None")])
def test_an_invalid_performance_model_version_is_refused(tmp_path, version, match):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(dict(PerfModel.default().to_dict(), format_version=version)))
    with pytest.raises(PerfModelError, match=f"{path}: format_version must be a positive integer, {match}"):
        PerfModel.load(path)


def test_a_performance_model_without_a_version_is_refused(tmp_path, capsys):
    data = PerfModel.default().to_dict()
    del data["format_version"]
    path = tmp_path / "m.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PerfModelError, match=f"{path} has no format_version"):
        PerfModel.load(path)
    assert perfmodels_main(["show", str(path)]) == 2
    assert "error: performance model" in capsys.readouterr().err


def test_profile_versions_below_one_or_not_integers_are_refused():
    for version in (0, -1, "1", 1.0, True):
        with pytest.raises(FormatVersionError, match="format_version must be a positive integer"):
            profile_from_dict(dict(_profile(), format_version=version), "p.json")
    assert check_format_version(1, 1, "profile", "p.json", "re-profile") == 1


# -- profile values --------------------------------------------------------------------------------------------


def _v1():
    return json.loads(json.dumps(profile_from_dict(_profile()).to_dict()))  # as read from a version-1 file


@pytest.mark.parametrize("versioned", [True, False])
@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d.update(forward=math.nan), "forward"),
        (lambda d: d.update(backward=-0.1), "backward"),
        (lambda d: d["factors"][1].update(compute=None), r"factors\[1\] \(layer l1\)\.compute"),
        (lambda d: d["factors"][2].update(dim=-3), r"factors\[2\] \(layer l2\)\.dim"),
        (lambda d: d["factors"][2].update(dim=0), r"factors\[2\] \(layer l2\)\.dim"),
        (lambda d: d["factors"][2].update(dim=2.5), r"factors\[2\] \(layer l2\)\.dim"),
        (lambda d: d["factors"][0].update(ready=math.inf), r"factors\[0\] \(layer l0\)\.ready"),
        (lambda d: d["factors"][0].update(kind="X"), r"factors\[0\] \(layer l0\)\.kind"),
        (lambda d: d["factors"][0].update(grad_numel=-1), r"factors\[0\] \(layer l0\)\.grad_numel"),
        (lambda d: d.update(other_grad_numel="500"), "other_grad_numel"),
        (lambda d: d.update(comm_workers=0), "comm_workers"),
        (lambda d: d.update(sgd_step=math.nan), "sgd_step"),
    ],
)
def test_impossible_profile_values_are_refused_naming_the_file_and_field(mutate, field, versioned):
    raw = _v1() if versioned else _profile()
    mutate(raw)
    with pytest.raises(ValueError, match=rf"profile p\.json: field\S* \W*{field}\W* must be"):
        profile_from_dict(raw, "p.json")


def test_a_factor_that_is_not_an_object_is_refused_in_an_unversioned_profile():
    raw = _profile()
    raw["factors"][0] = 5
    with pytest.raises(
        ValueError, match=r"profile p\.json: field factors\[0\] must be an object \(kind, layer, dim, ready, compute, grad_numel\)"
    ):
        profile_from_dict(raw, "p.json")


@pytest.mark.parametrize("versioned", [True, False])
def test_a_factor_without_a_required_field_is_refused_naming_it(versioned):
    raw = _v1() if versioned else _profile()
    del raw["factors"][3]["compute"]
    with pytest.raises(ValueError, match=r"profile p\.json: field factors\[3\] lacks \['compute'\]"):
        profile_from_dict(raw, "p.json")


def test_every_profile_field_has_a_validation_rule():
    """A new field whose type the checker does not know would go unchecked: this fails first."""
    for cls in (profile_file.Profile, profile_file.FactorProfile, profile_file.LayerPreconditionProfile):
        for f in dataclasses.fields(cls):
            annotation = str(f.type)
            rule, _ = profile_check._rule(annotation)
            assert rule is not None or annotation in profile_check.NESTED, f"{cls.__name__}.{f.name}: {annotation}"


@pytest.mark.parametrize("bad", [{"compute": None}, {"compute": math.nan}, {"dim": -8}])
def test_predict_exits_with_an_error_on_a_bad_profile_value(tmp_path, capsys, bad):
    profile, perf = tmp_path / "profile.json", tmp_path / "perf.json"
    raw = _v1()
    raw["factors"][0].update(bad)
    profile.write_text(json.dumps(raw))  # a NaN is written as NaN, as in a profile that timed one
    _perf().save(perf)
    assert main(["predict", "--profile", str(profile), "--perf-model", str(perf), "--workers", "2"]) == 2
    captured = capsys.readouterr()
    field = next(iter(bad))
    assert captured.err.startswith(f"error: profile {profile}: field factors[0] (layer l0).{field} must be"), captured.err
    assert "nan" not in captured.out


def test_the_shipped_profiles_still_load():
    for name in ("profile_resnet50.json", "simulator_check/profile_before.json"):
        assert load_profiles([str(ROOT / "benchmarks" / "results" / name)]).factors
