"""Step schedules (callables of the step) and the per-epoch KFACParamScheduler: values, timing, resume."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

from spdkfac import KFACParamScheduler, SPDKFACOptimizer

KW = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, kl_clip=0.01, backend="single")


class Spy:
    """Records per step whether factors / inverses were updated and the damping the inverses used."""

    def __init__(self, opt: SPDKFACOptimizer) -> None:
        self.factor_steps, self.inverse_steps, self.dampings = [], [], []
        step = opt.kfac_step
        update_factors, update_inverses = step.update_factors, step.update_decompositions

        def factors(*args) -> None:
            self.factor_steps.append(opt.steps)
            update_factors(*args)

        def inverses(*args) -> None:
            self.inverse_steps.append(opt.steps)
            self.dampings.append(opt.param_groups[0]["damping"])
            update_inverses(*args)

        step.update_factors, step.update_decompositions = factors, inverses


def _run(model, opt, x, y, start, stop, after_epoch=None, steps_per_epoch=None):
    for s in range(start, stop):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()
        if after_epoch is not None and (s + 1) % steps_per_epoch == 0:
            after_epoch()


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_callable_values_are_taken_at_their_steps():
    seen = []
    x, y = batch(8)
    model = small_net()

    def damping(step: int) -> float:
        seen.append(step)
        return 0.1 / (step + 1)

    opt = SPDKFACOptimizer(
        model,
        **dict(
            KW,
            damping=damping,
            kl_clip=lambda s: None if s % 2 else 0.01,
            factor_update_freq=lambda s: 1 if s < 4 else 3,
            inv_update_freq=lambda s: 2 if s < 4 else 6,
        ),
    )
    spy = Spy(opt)
    kl_clips = []
    for s in range(10):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        kl_clips.append(opt.param_groups[0]["kl_clip"])
        opt.step()
    assert spy.factor_steps == [0, 1, 2, 3, 6, 9]
    assert spy.inverse_steps == [0, 2, 6]
    assert spy.dampings == [0.1 / 1, 0.1 / 3, 0.1 / 7]
    assert kl_clips == [None if s % 2 else 0.01 for s in range(10)]
    assert seen == [0, *range(10)]  # once at construction, then once per step
    assert (opt.factor_update_freq, opt.inv_update_freq) == (3, 6)


def test_numbers_and_param_group_writes_keep_working():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **dict(KW, factor_update_freq=2, inv_update_freq=4))
    spy = Spy(opt)
    _run(model, opt, x, y, 0, 4)
    opt.param_groups[0]["damping"] = 0.5
    opt.factor_update_freq, opt.inv_update_freq = 1, 3
    _run(model, opt, x, y, 4, 10)
    assert spy.factor_steps == [0, 2, 4, 5, 6, 7, 8, 9]
    assert spy.inverse_steps == [0, 6, 9]
    assert spy.dampings == [0.01, 0.5, 0.5]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(damping=lambda s: 0.01 if s < 3 else -1.0), r"damping must be in .*schedule's value at step 3"),
        (dict(kl_clip=lambda s: "big" if s == 2 else 0.01), r"kl_clip must be a number.*at step 2"),
        (dict(factor_update_freq=lambda s: 1 if s < 4 else 0), r"factor_update_freq must be a positive integer.*at step 4"),
        (
            dict(factor_update_freq=lambda s: 1 if s < 3 else 2, inv_update_freq=3),
            r"inv_update_freq \(3\) must be a multiple of factor_update_freq \(2\).*at step 3",
        ),
    ],
)
def test_bad_scheduled_value_names_option_and_step(kwargs, match):
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **dict(KW, **kwargs))
    with pytest.raises((ValueError, TypeError), match=match):
        _run(model, opt, x, y, 0, 6)


def test_bad_value_at_first_step_fails_at_construction():
    with pytest.raises(ValueError, match=r"damping.*at step 0"):
        SPDKFACOptimizer(small_net(), **dict(KW, damping=lambda s: 0.0))
    with pytest.raises(ValueError, match="multiple of factor_update_freq"):
        SPDKFACOptimizer(small_net(), **dict(KW, factor_update_freq=lambda s: 2, inv_update_freq=3))


def test_written_bad_frequency_fails_at_the_next_step():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **KW)
    _run(model, opt, x, y, 0, 2)
    opt.factor_update_freq = 2  # inv_update_freq is still 1
    with pytest.raises(ValueError, match=r"multiple of factor_update_freq \(2\).*at step 2"):
        _run(model, opt, x, y, 2, 3)


def test_first_step_always_updates_factors_and_inverses():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **dict(KW, factor_update_freq=lambda s: 5, inv_update_freq=lambda s: 10))
    opt.steps = 3  # e.g. a counter set from outside: no inverses exist yet, so this step must make them
    spy = Spy(opt)
    _run(model, opt, x, y, 3, 12)
    assert spy.factor_steps == [3, 5, 10]
    assert spy.inverse_steps == [3, 10]


def _schedule_kw():
    return dict(
        KW,
        damping=lambda s: 0.05 * 0.7**s,
        kl_clip=lambda s: 0.01 / (1 + s),
        factor_update_freq=lambda s: 1 + s // 4,
        inv_update_freq=lambda s: 2 * (1 + s // 4),
    )


def test_resume_with_callables_is_bitwise_identical():
    x, y = batch(8)
    full = small_net()
    _run(full, SPDKFACOptimizer(full, **_schedule_kw()), x, y, 0, 11)
    first = small_net()
    opt1 = SPDKFACOptimizer(first, **_schedule_kw())
    _run(first, opt1, x, y, 0, 5)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)
    resumed = small_net(seed=7)
    resumed.load_state_dict(ckpt["model"])
    opt2 = SPDKFACOptimizer(resumed, **_schedule_kw())  # the callables are given again
    opt2.load_state_dict(ckpt["opt"])
    _run(resumed, opt2, x, y, 5, 11)
    for k, v in _params(full).items():
        assert torch.equal(_params(resumed)[k], v), k


# ------------------------------------------------------------------ KFACParamScheduler
def test_scheduler_changes_damping_and_frequencies_at_its_epochs():
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **dict(KW, damping=0.04, factor_update_freq=1, inv_update_freq=2))
    sched = KFACParamScheduler(opt, damping_alpha=0.5, damping_schedule=[1, 3], update_freq_alpha=3, update_freq_schedule=[2])
    spy = Spy(opt)
    seen = []

    def after_epoch() -> None:
        sched.step()
        seen.append((sched.epoch, opt.param_groups[0]["damping"], opt.factor_update_freq, opt.inv_update_freq))

    _run(model, opt, x, y, 0, 20, after_epoch, steps_per_epoch=4)  # 5 epochs of 4 steps
    assert seen == [(1, 0.02, 1, 2), (2, 0.02, 3, 6), (3, 0.01, 3, 6), (4, 0.01, 3, 6), (5, 0.01, 3, 6)]
    # Epochs 0-1 (steps 0-7): factors every step, inverses every 2; epoch 2 on (step 8 on): every 3 and 6.
    assert spy.factor_steps == [0, 1, 2, 3, 4, 5, 6, 7, 9, 12, 15, 18]
    assert spy.inverse_steps == [0, 2, 4, 6, 12, 18]
    assert spy.dampings == [0.04, 0.04, 0.02, 0.02, 0.01, 0.01]


def test_scheduler_rounding_keeps_inverse_a_multiple():
    opt = SPDKFACOptimizer(small_net(), **dict(KW, factor_update_freq=3, inv_update_freq=9))
    sched = KFACParamScheduler(opt, update_freq_alpha=0.5, update_freq_schedule=[1, 2, 5])
    assert [sched.update_freqs_at(e) for e in (0, 1, 2, 5)] == [(3, 9), (2, 6), (1, 3), (1, 3)]


def test_scheduler_errors():
    opt = SPDKFACOptimizer(small_net(), **dict(KW, damping=lambda s: 0.01))
    with pytest.raises(ValueError, match=r"\['damping'\] are already scheduled by a callable"):
        KFACParamScheduler(opt, damping_alpha=0.5, damping_schedule=[2])
    KFACParamScheduler(opt, update_freq_alpha=2, update_freq_schedule=[2])  # the frequencies are numbers: fine
    with pytest.raises(ValueError, match="damping_alpha must be a positive number"):
        KFACParamScheduler(opt, damping_alpha=0.0)
    with pytest.raises(ValueError, match="update_freq_schedule must be a list of epochs"):
        KFACParamScheduler(opt, update_freq_schedule=[1.5])
    with pytest.raises(TypeError, match="must be an SPDKFACOptimizer"):
        KFACParamScheduler(torch.optim.SGD(small_net().parameters(), lr=0.1))


def test_scheduler_resume_is_bitwise_identical():
    x, y = batch(8)
    recipe = dict(damping_alpha=0.5, damping_schedule=[1, 2], update_freq_alpha=2, update_freq_schedule=[2])
    kw = dict(KW, damping=0.04, factor_update_freq=1, inv_update_freq=2)

    full = small_net()
    opt = SPDKFACOptimizer(full, **kw)
    sched = KFACParamScheduler(opt, **recipe)
    _run(full, opt, x, y, 0, 15, sched.step, steps_per_epoch=3)

    first = small_net()
    opt1 = SPDKFACOptimizer(first, **kw)
    sched1 = KFACParamScheduler(opt1, **recipe)
    _run(first, opt1, x, y, 0, 6, sched1.step, steps_per_epoch=3)  # stop after epoch 1, inside the decays
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": opt1.state_dict(), "sched": sched1.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    resumed = small_net(seed=3)
    resumed.load_state_dict(ckpt["model"])
    opt2 = SPDKFACOptimizer(resumed, **kw)
    sched2 = KFACParamScheduler(opt2, **recipe)  # made from the fresh optimizer's values, as a training script does
    opt2.load_state_dict(ckpt["opt"])
    sched2.load_state_dict(ckpt["sched"])
    assert (sched2.epoch, opt2.param_groups[0]["damping"], opt2.factor_update_freq) == (2, 0.01, 2)
    _run(resumed, opt2, x, y, 6, 15, sched2.step, steps_per_epoch=3)
    for k, v in _params(full).items():
        assert torch.equal(_params(resumed)[k], v), k
    assert sched2.state_dict() == sched.state_dict()


def _two_group_optimizer(**options) -> tuple[nn.Module, SPDKFACOptimizer]:
    model = small_net()
    return model, SPDKFACOptimizer(model, **dict(KW, no_weight_decay=["kind:bias"], **options))


@pytest.mark.parametrize("name", ["damping", "kl_clip", "factor_decay"])
def test_a_layer_wide_option_written_to_one_other_group_is_refused_by_name(name):
    """K-FAC reads damping, kl_clip and factor_decay for every layer from param_groups[0]: a value set on another
    group alone would be silently overwritten, so the step refuses it, naming the group."""
    x, y = batch(8)
    model, opt = _two_group_optimizer()
    assert len(opt.param_groups) == 2
    _run(model, opt, x, y, 0, 1)
    opt.param_groups[1][name] = 0.3
    with pytest.raises(ValueError, match=rf"param_groups\[1\]\['{name}'\] is 0.3 .*one value for every layer"):
        _run(model, opt, x, y, 1, 2)


def test_layer_wide_options_written_to_the_first_or_every_group_are_used_by_every_group():
    x, y = batch(8)
    model, opt = _two_group_optimizer()
    spy = Spy(opt)
    opt.param_groups[0]["damping"] = 0.02  # before the first step, the first group alone
    _run(model, opt, x, y, 0, 1)
    for group in opt.param_groups:  # every group alike, as learning rates are often set
        group["damping"], group["factor_decay"] = 0.04, 0.9
    _run(model, opt, x, y, 1, 2)
    opt.param_groups[0]["factor_decay"] = 0.8
    _run(model, opt, x, y, 2, 3)
    assert spy.dampings == [0.02, 0.04, 0.04]
    assert [g["factor_decay"] for g in opt.param_groups] == [0.8, 0.8]
    assert [g["damping"] for g in opt.param_groups] == [0.04, 0.04]


def test_an_added_group_takes_the_layer_wide_values_in_force_and_refuses_its_own():
    x, y = batch(8)
    model, opt = _two_group_optimizer()
    _run(model, opt, x, y, 0, 1)
    opt.param_groups[0]["damping"] = 0.05
    _run(model, opt, x, y, 1, 2)
    temperature = nn.Parameter(torch.ones(()))
    with pytest.raises(ValueError, match=r"damping=0.5.*one value for every layer"):
        opt.add_param_group({"params": [temperature], "damping": 0.5})
    assert len(opt.param_groups) == 2
    opt.add_param_group({"params": [temperature], "lr": 0.01})
    assert opt.param_groups[2]["damping"] == 0.05  # the value in force, not the constructor's default
    _run(model, opt, x, y, 2, 3)  # (not mistaken for a group's own value)


def test_a_checkpoint_whose_other_groups_lag_behind_loads_with_the_first_group_s_values():
    """Before the layer-wide values were held alike, a factor_decay written to param_groups[0] stayed there alone,
    and checkpoints saved it so; they load with the first group's value in every group, not refused at the next
    step."""
    x, y = batch(8)
    model, opt = _two_group_optimizer()
    _run(model, opt, x, y, 0, 1)
    saved = opt.state_dict()
    saved["param_groups"][0]["factor_decay"] = 0.8  # as an older version saved it
    assert saved["param_groups"][1]["factor_decay"] == 0.95
    model, resumed = _two_group_optimizer(factor_decay=0.7)  # (the checkpoint's values win, as in torch.optim)
    resumed.load_state_dict(saved)
    _run(model, resumed, x, y, 1, 2)
    assert [g["factor_decay"] for g in resumed.param_groups] == [0.8, 0.8]
