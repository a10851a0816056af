"""Variant specs (``name:key=value,...``): unknown options and bad values refused when parsed, naming them."""

import inspect

import pytest

from spdkfac import SPDKFACOptimizer
from spdkfac.variants import variant_config, variant_keys


def test_the_valid_keys_are_the_optimizers_keyword_arguments():
    names = set(inspect.signature(SPDKFACOptimizer.__init__).parameters) - {"self", "model", "grad_scaler"}
    assert set(variant_keys()) == names


def test_an_unknown_key_is_refused_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown option 'nosuchkey' in variant 'spdkfac:nosuchkey=1'; the options are .*damping"):
        variant_config("spdkfac:nosuchkey=1")


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("spdkfac:fusion=bogus", "fusion must be one of"),
        ("spdkfac:pipelining=1", "pipelining must be a bool"),
        ("spdkfac:damping=-1", r"damping must be in \(0.0"),
        ("spdkfac:damping=abc", "damping must be a number"),
        ("spdkfac:factor_update_freq=0", "factor_update_freq must be a positive integer"),
        ("spdkfac:momentum=2", r"momentum must be in \[0.0, 1.0"),
        ("spdkfac:profile_steps=1.5", "profile_steps must be a positive integer"),
        ("spdkfac:perf_model=3", "perf_model must be a file path"),
        ("spdkfac:backend=1", "backend must be a name"),
        ("spdkfac:skip_layers=none", "skip_layers in a variant spec must be one module or class name"),
        ("spdkfac:factor_update_freq=10,inv_update_freq=15", r"inv_update_freq \(15\) must be a multiple of factor_update_freq \(10\)"),
    ],
)
def test_a_bad_value_is_refused_naming_the_option(spec, match):
    with pytest.raises(ValueError, match=rf"bad value in variant '{spec}': {match}"):
        variant_config(spec)


def test_good_changes_are_kept_as_the_optimizer_takes_them():
    config = variant_config("spdkfac:factor_update_freq=10,inv_update_freq=20,damping=0.01,kl_clip=none,skip_layers=Linear")
    assert (config["factor_update_freq"], config["inv_update_freq"], config["damping"], config["kl_clip"]) == (10, 20, 0.01, None)
    assert config["skip_layers"] == ("Linear",)  # one name, not its letters


def _parse(tmp_path, *extra):
    from benchmarks.convergence import parse_args

    return parse_args(["--data", "digits", "--perf-model", "none", "--out", str(tmp_path / "conv"), *extra])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("spdkfac:nosuchkey=1", "--optimizers: unknown option 'nosuchkey' in variant 'spdkfac:nosuchkey=1'; the options are"),
        ("spdkfac:damping=-1", "--optimizers: bad value in variant 'spdkfac:damping=-1': damping must be in"),
        ("spdkfac:lr=0.1", "sets ['lr'], which this benchmark sets itself (--lr-grid)"),
        ("spdkfac:factor_update_freq=10", "inv_update_freq 1 is not a multiple of factor_update_freq 10"),
    ],
)
def test_the_convergence_benchmark_refuses_a_bad_spec_when_parsing(tmp_path, capsys, monkeypatch, spec, message):
    import benchmarks.convergence as convergence

    monkeypatch.setattr(convergence, "make_optimizer", None)  # nothing may be built: the error comes first
    with pytest.raises(SystemExit) as exc:
        _parse(tmp_path, "--optimizers", "sgd", spec)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_the_convergence_benchmark_takes_a_good_spec(tmp_path):
    args = _parse(tmp_path, "--optimizers", "sgd", "spdkfac:factor_update_freq=10,inv_update_freq=10")
    assert args.optimizers == ["sgd", "spdkfac:factor_update_freq=10,inv_update_freq=10"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("spdkfac:nosuchkey=1", "unknown option 'nosuchkey'"),
        ("spdkfac:kl_clip=0.1", "variant 'spdkfac:kl_clip=0.1' sets ['kl_clip'], which this benchmark sets itself"),
        ("sgd:timeline=false", "variant 'sgd:timeline=false' sets ['timeline']"),
    ],
)
def test_the_iteration_time_benchmark_refuses_a_bad_spec_when_parsing(tmp_path, capsys, monkeypatch, spec, message):
    import benchmarks.iteration_time as iteration_time

    monkeypatch.setattr(iteration_time, "start", None)  # nothing may start: the error comes first
    with pytest.raises(SystemExit) as exc:
        iteration_time.main(["--variants", "sgd", spec, "--out", str(tmp_path / "it.json")])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
