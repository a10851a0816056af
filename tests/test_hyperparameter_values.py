"""Hyperparameters: numpy scalars taken (stored plain), bools refused, a scheduler state checked value by value."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from nets import batch, small_net

from spdkfac import KFACParamScheduler, SPDKFACOptimizer
from spdkfac.config import KFACConfig

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, kl_clip=0.01, backend="single")
NUMPY = dict(
    lr=np.float32(0.1),
    momentum=np.float64(0.9),
    weight_decay=np.float32(1e-4),
    factor_decay=np.float64(0.95),
    damping=np.float64(1e-3),
    kl_clip=np.float32(1e-3),
    factor_update_freq=np.int64(2),
    inv_update_freq=np.int32(4),
    profile_steps=np.int64(2),
    fusion_threshold_bytes=np.int64(1 << 20),
    skip_nonfinite=np.int64(1),
    accumulation_steps=np.int64(1),
    replan_interval=np.int64(5),
)


def _plain(value):
    return type(value) in (float, int, bool, str) or value is None


def test_numpy_scalars_are_taken_and_stored_as_python_numbers():
    model = small_net()
    opt = SPDKFACOptimizer(model, backend="single", **NUMPY)
    group = opt.param_groups[0]
    for key in ("lr", "momentum", "weight_decay", "factor_decay", "damping", "kl_clip"):
        assert type(group[key]) is float, key
        assert group[key] == pytest.approx(float(NUMPY[key])), key
    assert (type(opt.factor_update_freq), type(opt.inv_update_freq)) == (int, int)
    assert (opt.factor_update_freq, opt.inv_update_freq) == (2, 4)
    for key, value in opt.config.as_dict().items():
        assert _plain(value) or (isinstance(value, list) and all(_plain(v) for v in value)), (key, value)
    x, y = batch(8)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    buf.seek(0)
    torch.load(buf, weights_only=True)  # numpy scalars would make this refuse the file


def test_numpy_values_of_a_step_schedule_are_stored_plain():
    opt = SPDKFACOptimizer(small_net(), **dict(KW, damping=lambda s: np.float32(0.02), factor_update_freq=lambda s: np.int64(1)))
    x, y = batch(8)
    torch.nn.functional.cross_entropy(opt.model(x), y).backward()
    opt.step()
    assert type(opt.param_groups[0]["damping"]) is float
    assert type(opt.factor_update_freq) is int


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(lr=True), TypeError, "lr must be a number, got bool"),
        (dict(damping=np.bool_(True)), TypeError, "damping must be a number"),
        (dict(factor_update_freq=True), ValueError, "factor_update_freq must be a positive integer"),
        (dict(factor_update_freq=np.float64(2.0)), ValueError, "factor_update_freq must be a positive integer"),
        (dict(lr=np.float32("nan")), ValueError, "lr must be in"),
        (dict(skip_nonfinite=np.int64(-1)), ValueError, "skip_nonfinite must be a non-negative integer"),
    ],
)
def test_bools_and_bad_numpy_values_are_still_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        SPDKFACOptimizer(small_net(), **dict(KW, **kwargs))


def test_the_config_stores_numpy_integers_as_ints():
    cfg = KFACConfig(profile_steps=np.int64(4), fusion_threshold_bytes=np.int32(1024), replan_interval=np.int64(3))
    assert (type(cfg.profile_steps), type(cfg.fusion_threshold_bytes), type(cfg.replan_interval)) == (int, int, int)


def test_scheduler_takes_numpy_values_and_stores_them_plain():
    opt = SPDKFACOptimizer(small_net(), **KW)
    sched = KFACParamScheduler(
        opt,
        damping_alpha=np.float32(0.5),
        damping_schedule=np.array([2, 1]),
        update_freq_alpha=np.int64(2),
        update_freq_schedule=[np.int64(3)],
    )
    state = sched.state_dict()
    assert state["damping_schedule"] == [1, 2]
    for key, value in state.items():
        assert all(_plain(v) for v in value) if isinstance(value, list) else _plain(value), (key, value)
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True) == state


def _scheduler():
    opt = SPDKFACOptimizer(small_net(), **dict(KW, factor_update_freq=2, inv_update_freq=4))
    return KFACParamScheduler(opt, damping_alpha=0.5, damping_schedule=[1], update_freq_alpha=2, update_freq_schedule=[2])


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("damping_alpha", -0.5, "damping_alpha must be a positive number"),
        ("damping_alpha", "0.5", "damping_alpha must be a positive number"),
        ("update_freq_alpha", float("nan"), "update_freq_alpha must be a positive number"),
        ("damping_schedule", [1, -2], "damping_schedule must be a list of epochs"),
        ("update_freq_schedule", 3, "update_freq_schedule must be a list of epochs"),
        ("update_freq_schedule", ["3"], "update_freq_schedule must be a list of epochs"),
        ("base_damping", 0.0, r"base_damping must be in \(0.0"),
        ("base_damping", None, "base_damping must be a number"),
        ("base_factor_update_freq", 0, "base_factor_update_freq must be a positive integer"),
        ("base_inv_update_freq", 2.5, "base_inv_update_freq must be a positive integer"),
        ("base_inv_update_freq", 3, r"base_inv_update_freq \(3\) must be a multiple of base_factor_update_freq \(2\)"),
        ("epoch", -1, "epoch must be a non-negative integer"),
        ("epoch", True, "epoch must be a non-negative integer"),
    ],
)
def test_scheduler_load_state_dict_checks_every_value_naming_the_key(key, value, match):
    sched = _scheduler()
    before = sched.state_dict()
    with pytest.raises(ValueError, match=f"KFACParamScheduler state: {match}"):
        sched.load_state_dict(dict(before, **{key: value}))
    assert sched.state_dict() == before  # nothing half-loaded


def test_scheduler_load_state_dict_takes_a_valid_state():
    sched, other = _scheduler(), _scheduler()
    for _ in range(3):
        other.step()
    sched.load_state_dict(dict(other.state_dict(), epoch=np.int64(3)))
    assert sched.state_dict() == other.state_dict()
    assert type(sched.epoch) is int
