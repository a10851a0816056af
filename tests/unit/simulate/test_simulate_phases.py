"""The simulator's finer breakdown (hooks, preconditioning, update) on crafted profiles, the timeline fields that
measure those phases, and the per-phase comparison of ``simulator_check``."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn as nn
from test_simulate import _perf, _profile, _with_preconditioning

from spdkfac import SPDKFACOptimizer
from spdkfac.simulate import PART_OF_PHASE, PARTS, PHASES, Profile, parts_of_phases, predict, predict_phases, profile_from_dict

VARIANTS = ("sgd", "dkfac", "mpdkfac", "spdkfac")


def _v3(**changes) -> Profile:
    """The crafted profile (per-layer preconditioning 1.1 s) as a version-3 file would give it."""
    raw = _with_preconditioning(_profile())  # step_other = 1.1 s of preconditioning + 0.01 s
    prof = profile_from_dict(raw)
    fields = dict(hooks=0.03, precondition_step=1.0, update=0.004, sgd_update=0.0015, sgd_forward_backward=0.25, comm_workers=2)
    fields.update(changes)
    return dataclasses.replace(prof, **fields)


# ----------------------------------------------------------------------------------- phases and parts


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("contention", [False, True])
def test_phases_add_up_to_the_iteration_and_to_the_parts(variant, contention):
    phases = predict_phases(_v3(), _perf(), 2, variant, contention, (2, 4))
    assert list(phases)[1:] == PHASES
    assert phases["iteration"] == pytest.approx(sum(phases[p] for p in PHASES))
    parts = predict(_v3(), _perf(), 2, variant, contention, (2, 4))
    assert parts == parts_of_phases(phases)
    assert set(parts) == {"iteration", *PARTS}
    for part in PARTS:
        inside = [p for p in PHASES if PART_OF_PHASE.get(p, p) == part]
        assert parts[part] == pytest.approx(sum(phases[p] for p in inside))


def test_a_profile_without_the_new_times_predicts_what_it_did():
    """A version-2 profile (no hooks, preconditioning or update times) is charged as before: its hooks inside FF&BP,
    its preconditioning at the per-layer times, its update inside Other; the totals are unchanged by the split."""
    old = profile_from_dict(_with_preconditioning(_profile()))
    for variant in VARIANTS:
        phases = predict_phases(old, _perf(), 2, variant, update_freq=(1, 1))
        assert phases["Update"] == phases["Hooks"] == 0.0  # neither timed (nor the factors' packing)
        assert phases["FF&BP"] == pytest.approx(old.forward + old.backward - sum(f.compute for f in old.factors))
    dkfac = predict_phases(old, _perf(), 2, "dkfac")
    assert dkfac["Precondition"] == pytest.approx(1.1)
    assert dkfac["Precondition"] + dkfac["Other"] == pytest.approx(old.step_other)


# ----------------------------------------------------------------------------------- the hooks' own cost


def test_the_hooks_own_work_is_charged_on_factor_steps_and_slowed_by_communication_like_the_passes():
    """The hooks' work beyond the factors (a v3 profile's ``hooks``) is its own phase, charged on factor steps only,
    and not part of the passes' own work; under contention the all-reduces running during the passes slow the
    passes, the hooks and the factors by the same share of their seconds."""
    prof, perf = _v3(hooks=0.03), _perf()
    fwd_bwd, factors = prof.forward + prof.backward, sum(f.compute for f in prof.factors)
    own = fwd_bwd - factors - 0.03
    free = predict_phases(prof, perf, 2, "dkfac")
    assert free["FF&BP"] == pytest.approx(own)
    assert free["Hooks"] == pytest.approx(0.03)
    assert predict_phases(prof, perf, 2, "dkfac", update_freq=(10, 100))["Hooks"] == pytest.approx(0.003)
    busy = predict_phases(prof, perf, 2, "dkfac", contention=True)
    ratio = busy["FF&BP"] / own
    assert ratio > 1.0
    assert busy["Hooks"] == pytest.approx(0.03 * ratio)
    assert busy["FactorComp"] == pytest.approx(factors * ratio)
    without = predict_phases(_v3(hooks=0.0), perf, 2, "dkfac", contention=True)
    assert busy["iteration"] == pytest.approx(without["iteration"])  # the same work (taken out of the passes), slowed alike
    assert predict_phases(prof, perf, 2, "sgd")["Hooks"] == 0.0  # plain SGD has no factor hooks


def test_the_passes_are_plain_sgds_on_other_steps_and_plain_sgd_keeps_its_measured_passes():
    """With plain SGD's passes without communication profiled (v3), non-factor steps run those passes and factor
    steps the K-FAC passes' own work (what the factors cost the passes around them); plain SGD at the profiled
    worker count keeps its passes as measured with their all-reduces, elsewhere the all-reduces slow them."""
    prof, perf = _v3(hooks=0.01, sgd_forward_backward=0.25, sgd_forward_backward_local=0.125, sgd_grad_wait=0.02), _perf()
    passes = prof.forward + prof.backward - sum(f.compute for f in prof.factors) - 0.01
    assert passes > 0.125  # the crafted K-FAC passes carry extra work
    assert predict_phases(prof, perf, 2, "dkfac")["FF&BP"] == pytest.approx(passes)  # every step a factor step
    amortised = predict_phases(prof, perf, 2, "dkfac", update_freq=(4, 8))
    assert amortised["FF&BP"] == pytest.approx(0.125 * 0.75 + passes * 0.25)
    sgd = predict_phases(prof, perf, 2, "sgd", contention=True)
    assert (sgd["FF&BP"], sgd["GradComm"]) == pytest.approx((0.25, 0.02))  # measured at 2 workers
    assert predict_phases(prof, perf, 2, "sgd")["FF&BP"] == pytest.approx(0.125)  # no contention: no slowdown
    free, busy = predict_phases(prof, perf, 4, "sgd"), predict_phases(prof, perf, 4, "sgd", contention=True)
    assert free["FF&BP"] == pytest.approx(0.125)
    assert busy["FF&BP"] > 0.125
    assert busy["GradComm"] == pytest.approx(free["GradComm"])
    assert predict_phases(prof, perf, 1, "dkfac", contention=True)["FF&BP"] == pytest.approx(passes)


def test_pipelined_hooks_also_pack_their_factors_on_several_workers():
    raw = _with_preconditioning(_profile())
    for f in raw["factors"]:
        f["unpack"], f["pack"] = 0.001, 0.004
    prof = dataclasses.replace(profile_from_dict(raw), hooks=0.03, precondition_step=1.0, update=0.004)
    packing = 0.004 * len(prof.factors)
    spd, dk = predict_phases(prof, _perf(), 2, "spdkfac"), predict_phases(prof, _perf(), 2, "dkfac")
    assert spd["Hooks"] == pytest.approx(0.03 + packing)  # spdkfac pipelines: each hook packs into its fused buffer
    assert dk["Hooks"] == pytest.approx(0.03)  # D-KFAC packs in step()
    assert dk["Other"] - spd["Other"] == pytest.approx(packing)
    assert predict_phases(prof, _perf(), 1, "spdkfac")["Hooks"] == pytest.approx(0.03)  # one worker: nothing to send


# ----------------------------------------------------------------------------------- step(): preconditioning, update


def test_step_is_split_into_preconditioning_update_and_the_rest():
    prof = _v3()
    for variant in ("dkfac", "mpdkfac", "spdkfac"):
        p = predict_phases(prof, _perf(), 1, variant)
        assert p["Precondition"] == pytest.approx(1.0)  # the timed one, not the per-layer times' 1.1 s
        assert p["Update"] == pytest.approx(0.004)
        assert p["Other"] == pytest.approx(prof.step_other - 1.0 - 0.004)
    sgd = predict_phases(prof, _perf(), 2, "sgd")
    assert (sgd["Precondition"], sgd["Update"], sgd["Other"]) == pytest.approx((0.0, 0.0015, 0.002 - 0.0015))


def test_step_parts_never_exceed_the_measured_step():
    """A timed part larger than the step it was timed in (noise) is capped: no negative Other."""
    p = predict_phases(_v3(precondition_step=5.0, update=1.0), _perf(), 1, "dkfac")
    assert p["Precondition"] == pytest.approx(_v3().step_other)
    assert p["Update"] == p["Other"] == 0.0
    assert predict_phases(_v3(sgd_update=1.0), _perf(), 2, "sgd")["Other"] == 0.0


def test_distributed_preconditioning_changes_the_preconditioning_phase():
    prof = _v3()
    spd, dp = predict_phases(prof, _perf(), 2, "spdkfac", True), predict_phases(prof, _perf(), 2, "spdkfac-dp", True)
    assert dp["Precondition"] < spd["Precondition"]
    assert (dp["Update"], dp["Other"]) == pytest.approx((spd["Update"], spd["Other"]))


# ----------------------------------------------------------------------------------- what the timeline records


def _train(steps: int, **options) -> SPDKFACOptimizer:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = SPDKFACOptimizer(model, lr=0.1, backend="single", timeline=True, **options)
    x, y = torch.randn(6, 8), torch.randint(0, 4, (6,))
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return opt


def test_the_timeline_records_the_hooks_own_work_on_factor_steps_and_the_update_on_every_step():
    opt = _train(4, factor_update_freq=2, inv_update_freq=2)
    assert opt.timeline is not None
    its = opt.timeline.iterations
    assert [it.hooks > 0 for it in its] == [True, False, True, False]  # the hooks work on factor steps only
    assert all(it.update > 0 and it.precondition > 0 for it in its)
    sgd = _train(2, precondition=False)
    assert sgd.timeline is not None
    assert all(it.update > 0 and it.hooks == 0.0 for it in sgd.timeline.iterations)
    summary = opt.timeline.summary()
    assert summary["hooks"] == pytest.approx(sum(it.hooks for it in its) / 4)
    assert summary["update"] == pytest.approx(sum(it.update for it in its) / 4)


# ----------------------------------------------------------------------------------- simulator_check's table


def test_measured_phases_take_the_recorded_phases_out_of_their_parts():
    from benchmarks.simulator_check import measured_phases, phase_errors

    row = dict.fromkeys(PARTS, 0.0)
    row.update({"FF&BP": 0.30, "GradComm": 0.05, "Other": 0.20, "Hooks": 0.02, "Precondition": 0.12, "Update": 0.03, "mean_s": 0.55})
    phases = measured_phases(row)
    assert phases["FF&BP"] == pytest.approx(0.28)
    assert phases["Other"] == pytest.approx(0.05)
    assert (phases["Hooks"], phases["Precondition"], phases["Update"]) == (0.02, 0.12, 0.03)
    assert sum(phases.values()) == pytest.approx(0.55)
    old = {k: v for k, v in row.items() if k not in PART_OF_PHASE}  # a measurement from before they were recorded
    assert measured_phases(old)["FF&BP"] == 0.30
    assert measured_phases(old)["Hooks"] == 0.0
    predicted = dict.fromkeys(PHASES, 0.0) | {"FF&BP": 0.33, "Update": 0.03}
    errors = {e["phase"]: e for e in phase_errors(row, predicted)}
    assert errors["FF&BP"]["share_of_iteration"] == pytest.approx(0.05 / 0.55)
    assert errors["Update"]["diff_s"] == pytest.approx(0.0)


def test_the_command_line_predicts_the_phases(tmp_path, capsys):
    import json

    from spdkfac.simulate import main

    profile, perf, out = tmp_path / "profile.json", tmp_path / "perf.json", tmp_path / "pred.json"
    profile.write_text(json.dumps(_v3().to_dict()))
    _perf().save(str(perf))
    argv = ["predict", "--profile", str(profile), "--perf-model", str(perf), "--workers", "2", "--variants", "spdkfac"]
    assert main([*argv, "--phases", "--json", str(out)]) == 0
    head = capsys.readouterr().out.splitlines()[0].split()
    assert head[4:] == PHASES
    assert json.loads(out.read_text())["predictions"]["2:spdkfac"] == pytest.approx(predict_phases(_v3(), _perf(), 2, "spdkfac"))
    assert main([*argv, "--json", str(out)]) == 0
    assert capsys.readouterr().out.splitlines()[0].split()[4:] == PARTS
    assert json.loads(out.read_text())["predictions"]["2:spdkfac"] == pytest.approx(predict(_v3(), _perf(), 2, "spdkfac"))


def test_the_check_reports_profiles_taken_on_a_busy_machine(tmp_path):
    from benchmarks.simulator_check import profile_disturbances

    base = dataclasses.replace(profile_from_dict(_profile()), rank_passes=(0.2, 0.21), sgd_forward_backward=0.15)
    paths = {}
    for name, prof in {
        "quiet_a": base,
        "quiet_b": dataclasses.replace(base, forward=0.075),  # a few percent apart: the same machine state
        "slow": dataclasses.replace(base, forward=0.21),  # 0.20 -> 0.34 s of K-FAC work: another job ran
        "uneven": dataclasses.replace(base, rank_passes=(0.2, 0.4)),  # one rank shared its core
    }.items():
        paths[name] = str(tmp_path / f"{name}.json")
        prof.save(paths[name])
    assert profile_disturbances([paths["quiet_a"], paths["quiet_b"]]) == []
    (note,) = profile_disturbances([paths["quiet_a"], paths["slow"]])
    assert "disagree on the K-FAC pass work" in note
    assert "slow.json 0.34 s" in note
    (note,) = profile_disturbances([paths["uneven"]])
    assert "uneven.json: the ranks' K-FAC pass work differs (0.20, 0.40 s)" in note


def test_the_check_reports_the_load_the_measurements_recorded_not_the_load_when_reanalysed():
    from benchmarks.simulator_check import machine_load

    busy, quiet = [3.0, 2.9, 2.7], [0.2, 0.3, 0.4]
    assert machine_load([quiet, busy, None]) == {"load_average": busy, "load_average_when": "measured"}
    now = machine_load([None, {"not": "a load"}])
    assert now["load_average_when"] == "predicted"
    assert now["load_average"] is None or len(now["load_average"]) == 3
