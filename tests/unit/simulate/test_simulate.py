"""The scale simulator's event model on a hand-made profile."""

import pytest

from spdkfac.perfmodels import PerfModel
from spdkfac.simulate import Profile, ScaledModels, profile_from_dict, simulated_work_plan
from spdkfac.simulate import predict as simulate_predict


def predict(profile, *args, **kwargs):
    """The simulator's predict; the tests build profiles as JSON objects (unversioned, as older files), read here."""
    return simulate_predict(profile if isinstance(profile, Profile) else profile_from_dict(profile), *args, **kwargs)


def _profile(n_layers=6, dim=256):
    factors = []
    for kind in ("A", "G"):
        for i in range(n_layers):
            factors.append(
                {
                    "kind": kind,
                    "layer": f"l{i}",
                    "dim": dim + 64 * i,
                    "ready": 0.01 * (i + 1),
                    "compute": 0.002,
                    "grad_numel": 10000 if kind == "G" else 0,
                }
            )
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


def _comm_seconds(prof, perf, workers):
    """(gradient, factor) all-reduce seconds of the crafted profile, each factor all-reduced alone (layer-wise)."""
    m = ScaledModels(perf, workers)
    grads = sum(m.allreduce(f["grad_numel"]) for f in prof["factors"] if f["kind"] == "G") + m.allreduce(prof["other_grad_numel"])
    return grads, sum(m.allreduce(f["dim"] * (f["dim"] + 1) // 2) for f in prof["factors"])


def test_contention_pays_each_second_of_communication_once():
    """CPU workers with no spare core: every second the engine works is a second of the worker's core, taken once,
    from the passes while they run (FF&BP, Hooks and FactorComp stretched by their share) or waited for after them."""
    prof, perf = _profile(), _perf()
    grads, factors = _comm_seconds(prof, perf, 2)
    pipelined = "spdkfac:fusion=layerwise"  # each factor all-reduced from its hook as it is ready
    free, busy = predict(prof, perf, 2, pipelined), predict(prof, perf, 2, pipelined, contention=True)
    waited = free["GradComm"] + free["FactorComm"]
    assert busy["GradComm"] + busy["FactorComm"] == pytest.approx(waited)  # what runs past the passes is waited for ...
    assert 0 < waited < grads + factors
    passes = ("FF&BP", "FactorComp", "GradComm", "FactorComm")  # (the stage's broadcasts are paid apart)
    assert sum(busy[k] - free[k] for k in passes) == pytest.approx(grads + factors - waited)  # ... the rest slows them
    stretch = busy["FF&BP"] / free["FF&BP"]
    assert stretch > 1.0
    assert busy["FactorComp"] / free["FactorComp"] == pytest.approx(stretch)
    # D-KFAC sends its factors after the passes: only the gradients' all-reduces run during them.
    d_free, d_busy = predict(prof, perf, 2, "dkfac"), predict(prof, perf, 2, "dkfac", contention=True)
    assert d_busy["FactorComm"] == pytest.approx(d_free["FactorComm"])
    assert d_free["FactorComm"] > 0
    assert d_busy["iteration"] - d_free["iteration"] == pytest.approx(grads - d_free["GradComm"])  # (no broadcasts)
    # One worker communicates nothing.
    assert predict(prof, perf, 1, "spdkfac", contention=True) == predict(prof, perf, 1, "spdkfac")


def test_step_waits_for_the_gradients_first_then_for_the_factors():
    """The wait after the passes is split as step() waits: factor groups served before the last gradient are part of
    the gradient wait; D-KFAC's factors, sent after every gradient, are the factor wait."""
    prof, perf = _profile(), _perf()
    d = predict(prof, perf, 2, "dkfac")
    assert d["FactorComm"] == pytest.approx(sum(ScaledModels(perf, 2).allreduce(n) for n in _dkfac_groups(prof)))
    # A last gradient far behind every factor (a huge unpreconditioned rest): all of the wait is gradient wait.
    late = dict(prof, other_grad_numel=10**7)
    spd = predict(late, perf, 2, "spdkfac")
    assert spd["FactorComm"] == 0.0
    assert spd["GradComm"] > ScaledModels(perf, 2).allreduce(10**7)


def _dkfac_groups(prof):
    """D-KFAC's fused factor all-reduces of the crafted profile: one group per pass (all far under the threshold)."""
    return [sum(f["dim"] * (f["dim"] + 1) // 2 for f in prof["factors"] if f["kind"] == kind) for kind in ("A", "G")]


def test_amortised_updates_shrink_kfac_parts():
    prof, perf = _profile(), _perf()
    every = predict(prof, perf, 2, "spdkfac")
    amort = predict(prof, perf, 2, "spdkfac", update_freq=(10, 100))
    assert amort["InverseComp"] == pytest.approx(every["InverseComp"] / 100)
    assert amort["FactorComp"] == pytest.approx(every["FactorComp"] / 10)
    # The hooks' factor work is not left in FF&BP on the steps that skip it.
    factor_compute = sum(f["compute"] for f in prof["factors"])
    assert amort["FF&BP"] == pytest.approx(every["FF&BP"]) == pytest.approx(prof["forward"] + prof["backward"] - factor_compute)


def test_ring_scaling_of_allreduce():
    m2, m8 = ScaledModels(_perf(2), 2), ScaledModels(_perf(2), 8)
    assert m2.allreduce(1e6) == pytest.approx(1e-3 + 1e-8 * 1e6)
    assert m8.ar_alpha == pytest.approx(7e-3)
    assert m8.ar_beta == pytest.approx(1e-8 * (7 / 8) / (1 / 2))
    assert m8.broadcast(100) == pytest.approx(3 * _perf().broadcast(100))


def _with_preconditioning(prof, seconds=(0.4, 0.3, 0.2, 0.1, 0.05, 0.05)):
    prof = dict(prof)
    prof["precondition"] = [{"layer": f"l{i}", "seconds": t, "a_dim": 256 + 64 * i, "g_dim": 256 + 64 * i} for i, t in enumerate(seconds)]
    prof["step_other"] = sum(seconds) + 0.01
    return prof


def test_distributed_preconditioning_replaces_the_total_by_the_busiest_rank_plus_broadcasts():
    prof, perf = _with_preconditioning(_profile()), _perf()
    spd = predict(prof, perf, 2, "spdkfac", contention=True)
    dp = predict(prof, perf, 2, "spdkfac-dp", contention=True)
    # Recomputed here from the optimizer's balancing: the busiest rank's share plus both broadcasts (contention).
    m = ScaledModels(perf, 2)
    from spdkfac.plan.placement import balance_by_cost

    layers = prof["precondition"]
    owners = balance_by_cost([p["a_dim"] * p["g_dim"] * (p["a_dim"] + p["g_dim"]) for p in layers], 2)
    busiest = max(sum(p["seconds"] for p, o in zip(layers, owners) if o == r) for r in range(2))
    bcast = sum(m.broadcast_elements(sum(p["a_dim"] * p["g_dim"] for p, o in zip(layers, owners) if o == r)) for r in range(2))
    assert dp["Other"] == pytest.approx(spd["Other"] - 1.1 + busiest + bcast)
    assert dp["iteration"] < spd["iteration"]


def test_concurrent_result_broadcasts_share_each_ranks_link_without_contention_too():
    """MEM-OPT on 4 workers: every rank roots one broadcast of its layers' results to all and receives the other
    three at once; they share its link, so it waits for their sum (not the longest), as 'auto' charges them."""
    prof, perf = _with_preconditioning(_profile()), _perf()
    spd = predict(prof, perf, 4, "spdkfac")
    dp = predict(prof, perf, 4, "spdkfac-dp")
    plan = simulated_work_plan(profile_from_dict(prof), perf, 4, "spdkfac-dp")
    assert plan is not None
    layers = {p["layer"]: p for p in prof["precondition"]}
    names = list(layers)
    busiest = max(sum(layers[n]["seconds"] for n in plan.preconditioned_here(r, names)) for r in range(4))
    broadcasts = plan.result_broadcasts(names)
    assert len(broadcasts) > 1
    assert all(b.members == (0, 1, 2, 3) for b in broadcasts)
    m = ScaledModels(perf, 4)
    link = sum(m.broadcast_elements(sum(layers[n]["a_dim"] * layers[n]["g_dim"] for n in b.layers)) for b in broadcasts)
    longest = max(m.broadcast_elements(sum(layers[n]["a_dim"] * layers[n]["g_dim"] for n in b.layers)) for b in broadcasts)
    assert link > longest
    assert dp["Other"] == pytest.approx(spd["Other"] - 1.1 + busiest + link)


def test_distributed_preconditioning_needs_a_profile_with_per_layer_times():
    with pytest.raises(ValueError, match="per-layer preconditioning"):
        predict(_profile(), _perf(), 2, "spdkfac-dp")


def test_distributed_preconditioning_changes_nothing_on_one_worker():
    prof, perf = _with_preconditioning(_profile()), _perf()
    assert predict(prof, perf, 1, "spdkfac-dp") == predict(prof, perf, 1, "spdkfac")


@pytest.mark.multiprocess
def test_profile_under_a_launcher_records_layers_and_sgd_with_real_allreduces(tmp_path):
    """`simulate profile` on 2 real workers (torchrun): per-layer times, and the SGD passes ran with communication."""
    import json
    import os

    from launch import run_workers

    from spdkfac.kfac.layers import kfac_layers
    from spdkfac.models import get_model

    out = tmp_path / "profile.json"
    run_workers(
        "torch",
        2,
        [
            "-m",
            "spdkfac.simulate",
            "profile",
            "--model",
            "cifar_resnet20",
            "--resolution",
            "8",
            "--batch-size",
            "2",
            "--iters",
            "1",
            "--bind-cores",
            "--out",
            str(out),
        ],
    )
    prof = json.loads(out.read_text())
    assert prof["comm_workers"] == prof["concurrent_workers"] == 2
    available = sorted(os.sched_getaffinity(0))  # rank 0 profiled on its own block of the cores, as a bound run
    assert prof["bound_cores"]
    assert set(prof["bound_cores"]) <= set(available)
    assert prof["bound_cores"][0] == available[0]
    n_layers = len(kfac_layers(get_model("cifar_resnet20")))
    assert len(prof["factors"]) == 2 * n_layers
    assert len(prof["precondition"]) == n_layers
    assert all(f["compute"] > 0 and f["ready"] > 0 and f["unpack"] > 0 and f["pack"] > 0 and f["invert"] > 0 for f in prof["factors"])
    assert prof["engine_warmed"] is True  # the SGD passes ran first, with the real all-reduces
    assert prof["unpack"] == pytest.approx(sum(f["unpack"] for f in prof["factors"]))
    assert prof["sgd_forward_backward"] > 0
    assert prof["forward"] > 0
    assert prof["backward"] > 0
    assert prof["sgd_grad_wait"] >= 0
    assert prof["sgd_step"] > 0
    assert prof["unpack"] > 0
    # Every rank's own totals, for the wait on the slowest; the times are the mean over the ranks.
    assert len(prof["rank_passes"]) == len(prof["rank_inversions"]) == len(prof["rank_sgd"]) == 2
    assert all(t > 0 for key in ("rank_passes", "rank_inversions", "rank_sgd") for t in prof[key])
    assert sum(prof["rank_inversions"]) / 2 == pytest.approx(sum(f["invert"] for f in prof["factors"]))
    assert sum(prof["rank_passes"]) / 2 == pytest.approx(prof["forward"] + prof["backward"] + prof["step_other"])
    # Format 3: the hooks' own work, the preconditioning and the update inside step(), plain SGD's passes without
    # communication (measured apart from the ones with it); format 4: each iteration's spread of the ranks.
    assert prof["format_version"] == 4
    assert 0 < prof["iteration_lag_passes"] < 1
    assert 0 < prof["iteration_lag_sgd"] < 1
    assert 0 < prof["hooks"] < prof["forward"] + prof["backward"]
    assert 0 < prof["precondition_step"] + prof["update"] <= prof["step_other"]
    assert 0 < prof["sgd_update"] <= prof["sgd_step"]
    assert prof["sgd_forward_backward_local"] > 0
    assert prof["sgd_forward_backward_local"] != prof["sgd_forward_backward"]
    predicted = predict(prof, PerfModel.default(), 4, "spdkfac-dp", contention=True)
    assert predicted["iteration"] >= predicted["FF&BP"] > 0


def test_overlapped_preconditioning_hides_gradient_wait_on_steps_that_keep_the_inverses():
    prof = _with_preconditioning(_profile(), seconds=(0.004, 0.003, 0.002, 0.001, 0.0005, 0.0005))  # 11 ms in all
    perf = _perf()
    perf = PerfModel.from_dict(dict(perf.to_dict(), allreduce={"alpha": 1e-3, "beta": 1e-6}))  # a long gradient wait
    plain = predict(prof, perf, 2, "spdkfac:overlap_preconditioning=false", update_freq=(10, 100))
    over = predict(prof, perf, 2, "spdkfac", update_freq=(10, 100))
    assert plain["GradComm"] > 0.011  # longer than the preconditioning: all of it is hidden on 99 steps in 100
    assert over["GradComm"] == pytest.approx(plain["GradComm"] - 0.011 * 0.99)
    assert {k: v for k, v in over.items() if k not in ("GradComm", "iteration")} == {
        k: v for k, v in plain.items() if k not in ("GradComm", "iteration")
    }
    # Distributed preconditioning: only the busiest rank's share (layers 0 and 3..5 vs 1 and 2 by cost) is hidden.
    dp_plain = predict(prof, perf, 2, "spdkfac-dp:overlap_preconditioning=false", update_freq=(10, 100))
    dp = predict(prof, perf, 2, "spdkfac-dp", update_freq=(10, 100))
    hidden = (dp_plain["GradComm"] - dp["GradComm"]) / 0.99
    assert 0.0 < hidden < 0.011
    # Every step inverts (the paper's setting) or cores are shared: nothing is hidden.
    assert predict(prof, perf, 2, "spdkfac")["GradComm"] == predict(prof, perf, 2, "spdkfac:overlap_preconditioning=false")["GradComm"]
    busy = predict(prof, perf, 2, "spdkfac", contention=True, update_freq=(10, 100))
    assert busy == predict(prof, perf, 2, "spdkfac:overlap_preconditioning=false", contention=True, update_freq=(10, 100))


def test_overlapped_preconditioning_hides_factor_wait_on_factor_steps_that_keep_the_inverses():
    prof = _with_preconditioning(_profile(), seconds=(0.004, 0.003, 0.002, 0.001, 0.0005, 0.0005))  # 11 ms in all
    plain = predict(prof, _perf(), 2, "spdkfac:overlap_preconditioning=false", update_freq=(10, 100))
    over = predict(prof, _perf(), 2, "spdkfac", update_freq=(10, 100))
    # Short waits (gradients and factors < 11 ms): both hidden, the factors' on the 9 factor steps in 100 that
    # keep the inverses; on the inverse step (1 in 100) the preconditioning needs the new factors.
    assert 0.0 < plain["GradComm"] + plain["FactorComm"] / 0.1 < 0.011
    assert over["GradComm"] == pytest.approx(plain["GradComm"] * 0.01)
    assert over["FactorComm"] == pytest.approx(plain["FactorComm"] * 0.1)
    # Factors every step, inverses every 100: the factor wait is hidden on 99 steps in 100.
    every = predict(prof, _perf(), 2, "spdkfac", update_freq=(1, 100))
    every_plain = predict(prof, _perf(), 2, "spdkfac:overlap_preconditioning=false", update_freq=(1, 100))
    assert every["FactorComm"] == pytest.approx(every_plain["FactorComm"] * 0.01)


def test_variant_changes_are_parsed_and_checked():
    from spdkfac.variants import variant_config

    assert variant_config("spdkfac:overlap_preconditioning=false,profile_steps=2")["overlap_preconditioning"] is False
    assert variant_config("spdkfac:profile_steps=2")["profile_steps"] == 2
    assert variant_config("dkfac")["overlap_preconditioning"] is False
    with pytest.raises(ValueError, match="unknown variant"):
        variant_config("spd:overlap_preconditioning=false")
    with pytest.raises(ValueError, match="key=value"):
        variant_config("spdkfac:overlap_preconditioning")


def test_ablation_names_with_a_leading_dash_are_accepted_on_the_command_line(tmp_path, capsys):
    """argparse takes `-pipe+lbp` for an option; `--variants` must still accept the paper's ablation names."""
    import json

    from spdkfac.simulate import main
    from spdkfac.variants import variant_argv

    assert variant_argv(["--variants", "sgd", "-pipe+lbp", "-pipe-lbp:fusion=layerwise", "--workers", "2"]) == [
        "--variants",
        "sgd",
        "--variants=-pipe+lbp",
        "--variants=-pipe-lbp:fusion=layerwise",
        "--workers",
        "2",
    ]
    assert variant_argv(["--workers", "2", "-h"]) == ["--workers", "2", "-h"]  # only after --variants
    profile, perf, out = tmp_path / "profile.json", tmp_path / "perf.json", tmp_path / "pred.json"
    profile.write_text(json.dumps(_profile()))
    _perf().save(perf)
    argv = [
        "predict",
        "--profile",
        str(profile),
        "--perf-model",
        str(perf),
        "--workers",
        "2",
        "--variants",
        "-pipe+lbp",
        "sgd",
        "+pipe-lbp",
        "--json",
        str(out),
    ]
    assert main(argv) == 0
    assert list(json.loads(out.read_text())["predictions"]) == ["2:-pipe+lbp", "2:sgd", "2:+pipe-lbp"]
    assert main([*argv[:-2], "+pipe+pipe"]) == 2
    assert "unknown variant '+pipe+pipe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # not a variant: argparse's own error names it
        main([*argv[:-2], "-pipe+pipe"])
    assert "-pipe+pipe" in capsys.readouterr().err


def test_inversion_stage_charges_each_rank_its_own_packing_work():
    """Unpack what a rank inverts; pack what it broadcasts and unpack the packed copy it keeps (every rank then
    holds the same values); unpack what it receives (in its wait)."""
    bare = _profile()
    timed = _profile()
    for f in timed["factors"]:
        f["unpack"], f["pack"] = 0.010, 0.004
    unpack_all = 0.010 * len(timed["factors"])
    perf = _perf()
    owned = len(timed["factors"]) // 2  # Seq-Dist on 2 workers: every other factor on each rank
    for variant, extra_expected in (
        ("dkfac", unpack_all),  # every rank unpacks every factor, packs nothing
        ("mpdkfac", unpack_all + owned * (0.004 + 0.010)),  # the critical rank's own conversions, then the received
    ):
        plain, charged = predict(bare, perf, 2, variant), predict(timed, perf, 2, variant)
        extra = charged["iteration"] - plain["iteration"]
        assert extra == pytest.approx(extra_expected), variant
        assert charged["InverseComm"] >= plain["InverseComm"] + (0.0 if variant == "dkfac" else 0.010)  # received ones
    # One worker broadcasts nothing: it only unpacks.
    assert predict(timed, perf, 1, "spdkfac")["iteration"] - predict(bare, perf, 1, "spdkfac")["iteration"] == pytest.approx(unpack_all)
    # A profile with only the old total charges it to every rank, as before.
    total = dict(bare, unpack=unpack_all)
    assert predict(total, perf, 2, "mpdkfac")["iteration"] == pytest.approx(predict(bare, perf, 2, "mpdkfac")["iteration"] + unpack_all)


def test_averaged_profiles_predict_the_mean_workload():
    """Profiles taken before and after a measurement: times averaged field by field, mismatches refused."""
    from spdkfac.simulate import average_profiles

    early = dict(_with_preconditioning(_profile()), sgd_forward_backward=0.2, model="m", resolution=8, batch_size=2, comm_workers=2)
    late = dict(_with_preconditioning(_profile()), sgd_forward_backward=0.3, model="m", resolution=8, batch_size=2, comm_workers=2)
    late["forward"], late["backward"] = 0.09, 0.16
    late["factors"] = [dict(f, ready=2 * f["ready"], compute=3 * f["compute"]) for f in late["factors"]]
    late["precondition"] = [dict(p, seconds=p["seconds"] + 0.004) for p in late["precondition"]]
    mean = average_profiles([profile_from_dict(early), profile_from_dict(late)])
    assert mean.forward == pytest.approx(0.08)
    assert mean.backward == pytest.approx(0.14)
    assert mean.sgd_forward_backward == pytest.approx(0.25)
    assert [f.ready for f in mean.factors] == pytest.approx([1.5 * f["ready"] for f in early["factors"]])
    assert [f.compute for f in mean.factors] == pytest.approx([2 * f["compute"] for f in early["factors"]])
    assert [p.seconds for p in mean.precondition] == pytest.approx([p["seconds"] + 0.002 for p in early["precondition"]])
    assert early["forward"] == 0.07
    assert early["factors"][0]["ready"] == 0.01
    perf = _perf()
    for variant in ("sgd", "spdkfac", "spdkfac-dp"):  # the simulator is linear in these times when nothing overlaps
        both = [predict(p, perf, 2, variant, contention=True)["iteration"] for p in (early, late)]
        assert predict(mean, perf, 2, variant, contention=True)["iteration"] == pytest.approx(sum(both) / 2, rel=0.05)
    with pytest.raises(ValueError, match="resolution"):
        average_profiles([profile_from_dict(early), profile_from_dict(dict(late, resolution=16))])
    with pytest.raises(ValueError, match="different factors"):
        average_profiles([profile_from_dict(early), profile_from_dict(dict(late, factors=late["factors"][:-1]))])


def test_sgd_gradient_wait_is_the_measured_one_at_the_profiled_worker_count():
    prof = dict(_profile(), comm_workers=2, sgd_grad_wait=0.05, sgd_forward_backward=0.19)
    perf = _perf()
    at_profiled = predict(prof, perf, 2, "sgd")
    assert at_profiled["GradComm"] == pytest.approx(0.05)  # measured, not the model's on top of it
    assert at_profiled["Other"] == pytest.approx(prof["sgd_step"])
    modelled = predict(prof, perf, 8, "sgd")  # another worker count: the all-reduce model
    assert modelled["GradComm"] != pytest.approx(0.05)
    assert modelled["GradComm"] > 0
    # Older profiles hold the wait inside sgd_step: counted there once, not again from the model.
    old = {k: v for k, v in prof.items() if k != "sgd_grad_wait"}
    assert predict(old, perf, 2, "sgd")["GradComm"] == 0.0
    assert predict(prof, perf, 2, "spdkfac")["GradComm"] == predict(old, perf, 2, "spdkfac")["GradComm"]


def test_inversions_are_charged_at_the_profiles_measured_ratio_to_the_fitted_model():
    """The plan is the optimizer's (fitted model); its inversions cost what the profile measured in the job."""
    from spdkfac.plan.placement import place

    perf = _perf()
    bare = _profile()
    timed = _profile()
    for f in timed["factors"]:
        f["invert"] = 1.3 * perf.inverse(f["dim"])  # the job inverts 30% slower than the fit says
    for variant in ("dkfac", "mpdkfac", "spdkfac"):
        plain, slow = predict(bare, perf, 2, variant), predict(timed, perf, 2, variant)
        assert slow["InverseComp"] == pytest.approx(1.3 * plain["InverseComp"]), variant
        assert slow["iteration"] > plain["iteration"]
    # D-KFAC: every rank inverts every factor, so the stage is exactly the measured total.
    assert predict(timed, perf, 2, "dkfac")["InverseComp"] == pytest.approx(sum(f["invert"] for f in timed["factors"]))
    # The placement is still the one the fitted model gives (a slower inversion would move factors to broadcasts).
    dims = [((f["kind"], f["layer"]), f["dim"]) for f in timed["factors"]]
    m = ScaledModels(perf, 2)
    fitted_plan = place("lbp", dims, 2, m.inverse, m.broadcast)
    ratio = sum(f["invert"] for f in timed["factors"]) / sum(perf.inverse(d) for _, d in dims)
    spans = [0.0, 0.0]
    for a in fitted_plan.assignments:
        for r in (0, 1):
            if a.owner in (r, -1):
                spans[r] += a.t_comp * ratio + (a.t_comm if a.owner == r else 0.0)
    charged = predict(timed, perf, 2, "spdkfac")
    assert charged["InverseComp"] + charged["InverseComm"] == pytest.approx(max(spans))


def test_single_process_profile_times_every_inversion_and_predict_charges_them():
    """Profile → predict on one process: D-KFAC's inversion stage is the profile's own inversions and unpacking."""
    from spdkfac.simulate import measure_profile

    prof = measure_profile("cifar_resnet20", resolution=8, batch_size=2, iters=1)
    assert prof.comm_workers == 1
    assert prof.engine_warmed is False
    assert all(f.invert > 0 for f in prof.factors)
    stage = sum(f.invert + f.unpack for f in prof.factors)
    for perf in (PerfModel.default(), _perf()):  # whatever the fit says, the measured inversions are charged
        assert predict(prof, perf, 1, "dkfac")["InverseComp"] == pytest.approx(stage)


def test_eigen_variant_plans_and_charges_the_eigen_curve_and_payload():
    prof, perf = _profile(), _perf()
    d = perf.to_dict()
    d["eigen"] = {"kind": "cubic", "coeffs": [1e-5, 0, 0, 5e-9], "floor": 1e-5}
    eig_perf = PerfModel.from_dict(d)
    m = ScaledModels(eig_perf, 4)
    compute, comm = m.stage_costs("eigen")
    assert compute(512) == eig_perf.eigen(512)
    assert comm(512) == pytest.approx(m.broadcast_elements(512 * 512 + 512))
    assert m.stage_costs("inverse")[1](512) == pytest.approx(m.broadcast_elements(512 * 513 // 2))
    inverse = predict(prof, eig_perf, 4, "dkfac")
    eigen = predict(prof, eig_perf, 4, "dkfac:compute_method=eigen")  # every rank decomposes every factor
    assert eigen["InverseComp"] == pytest.approx(sum(eig_perf.eigen(f["dim"]) for f in prof["factors"]))
    assert inverse["InverseComp"] == pytest.approx(sum(eig_perf.inverse(f["dim"]) for f in prof["factors"]))


def test_predict_rejects_impossible_arguments_and_malformed_profiles(tmp_path, capsys):
    import json

    from spdkfac.simulate import main

    profile, perf = tmp_path / "profile.json", tmp_path / "perf.json"
    profile.write_text(json.dumps(_profile()))
    _perf().save(perf)
    base = ["predict", "--profile", str(profile), "--perf-model", str(perf)]
    assert main([*base, "--workers", "0", "4"]) == 2
    assert "--workers 0" in capsys.readouterr().err
    assert main([*base, "--update-freq", "10", "15"]) == 2
    assert "--update-freq 10 15" in capsys.readouterr().err
    broken = {k: v for k, v in _profile().items() if k != "backward"}
    profile.write_text(json.dumps(broken))
    assert main([*base, "--workers", "2"]) == 2
    err = capsys.readouterr().err
    assert str(profile) in err
    assert "['backward']" in err
    profile.write_text("{truncated")
    assert main(base) == 2
    assert "is not valid JSON" in capsys.readouterr().err
    assert main(["predict", "--profile", str(tmp_path / "none.json"), "--perf-model", str(perf)]) == 2
    assert "cannot read profile" in capsys.readouterr().err


def test_the_variants_fusion_threshold_reaches_the_simulated_plan():
    """'threshold' fusion with a tiny buffer splits the factor all-reduces into more launches, as the optimizer would."""
    default = predict(_profile(), _perf(), 4, "dkfac")
    tiny = predict(_profile(), _perf(), 4, "dkfac:fusion_threshold_bytes=64")
    assert tiny["FactorComm"] > default["FactorComm"]
