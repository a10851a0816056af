"""Each cost term of the simulator on crafted profiles, and the simulator and the optimizer agreeing on every decision."""

import dataclasses
import json
import math
import re
import threading
import warnings

import pytest
import torch
from test_simulate import _perf, _profile, _with_preconditioning

from spdkfac.comm.inprocess import InProcessGroup, run_ranks
from spdkfac.models import get_model
from spdkfac.perfmodels import PerfModel
from spdkfac.plan.placement import ALL
from spdkfac.simulate import FORMAT_VERSION, Profile, average_profiles, load_profiles, measure_profile, predict, profile_from_dict
from spdkfac.simulate.prediction import communication_scale, expected_max_normal, iteration_lag_share, rank_lag, simulated_work_plan
from spdkfac.simulate.profile_check import ProfileValueError
from spdkfac.simulate.profiling import _across_ranks, iteration_lag
from spdkfac.simulate.scaling import ScaledModels
from spdkfac.variants import make_optimizer

VERSION_3_FIELDS = ("hooks", "precondition_step", "update", "sgd_update", "sgd_forward_backward_local")
VERSION_4_FIELDS = ("iteration_lag_passes", "iteration_lag_sgd")


def _typed(raw=None, **changes):
    prof = profile_from_dict(raw if raw is not None else _profile())
    return dataclasses.replace(prof, **changes)


def _timed(unpack=0.010, pack=0.004):
    """The crafted profile with every factor's conversions and inversion timed."""
    raw = _profile()
    for f in raw["factors"]:
        f["unpack"], f["pack"] = unpack, pack
    return _typed(raw)


# ----------------------------------------------------------------- the wait for the slowest rank


def test_expected_maximum_of_normal_draws():
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(3) == pytest.approx(1.5 / math.sqrt(math.pi), abs=1e-6)
    assert expected_max_normal(8) == pytest.approx(1.4236, abs=1e-3)
    assert [expected_max_normal(n) for n in (2, 4, 8, 16, 32, 64)] == sorted(expected_max_normal(n) for n in (2, 4, 8, 16, 32, 64))


def test_rank_lag_is_the_slowest_ranks_excess_scaled_to_the_worker_count():
    assert rank_lag((1.0, 1.2), 2) == pytest.approx(0.1 / 1.1)  # (max - mean) / mean at the profiled count
    assert rank_lag((1.0, 1.2), 8) == pytest.approx(0.1 / 1.1 * expected_max_normal(8) / expected_max_normal(2))
    assert rank_lag((1.0, 1.0, 1.3, 1.1), 4) == pytest.approx(0.2 / 1.1)
    assert rank_lag((1.0, 1.2), 1) == 0.0  # one worker waits for nobody
    assert rank_lag((1.0,), 8) == rank_lag((), 8) == 0.0  # one profiled rank measures no spread
    assert rank_lag((0.0, 0.0), 2) == 0.0


def test_kfac_passes_lag_is_waited_for_at_the_gradient_allreduce():
    prof = _typed(rank_passes=(1.0, 1.2))
    even = _typed(rank_passes=(1.1, 1.1))
    for workers in (2, 8):
        lagging, level = predict(prof, _perf(), workers, "spdkfac"), predict(even, _perf(), workers, "spdkfac")
        work = level["FF&BP"] + level["FactorComp"] + level["Other"]
        assert lagging["GradComm"] - level["GradComm"] == pytest.approx(rank_lag((1.0, 1.2), workers) * work)
        assert {k: v for k, v in lagging.items() if k not in ("GradComm", "iteration")} == {
            k: v for k, v in level.items() if k not in ("GradComm", "iteration")
        }
    assert predict(prof, _perf(), 1, "spdkfac") == predict(even, _perf(), 1, "spdkfac")


def test_inversion_lag_is_waited_for_at_the_broadcasts_or_the_next_gradient_allreduce():
    prof = _typed(rank_inversions=(2.0, 3.0))
    even = _typed(rank_inversions=(2.5, 2.5))
    perf = _perf()
    scale = rank_lag((2.0, 3.0), 4)

    def critical_inversions(variant):  # the critical rank's, while another rank inverts too
        plan = simulated_work_plan(prof, perf, 4, variant)
        spans = plan.inversion.makespans()
        critical = max(range(4), key=lambda r: spans[r])
        own = [sum(a.t_comp for a in plan.inversion.assignments if a.owner in (r, ALL)) for r in range(4)]
        return min(own[critical], max(own[r] for r in range(4) if r != critical))

    for variant, part in (("mpdkfac", "InverseComm"), ("dkfac", "GradComm")):  # D-KFAC broadcasts nothing
        lagging, level = predict(prof, perf, 4, variant), predict(even, perf, 4, variant)
        inversions = critical_inversions(variant)
        assert lagging[part] - level[part] == pytest.approx(scale * inversions)
        assert lagging["iteration"] - level["iteration"] == pytest.approx(scale * inversions)
    # Amortised: only the inverse steps wait for it.
    amortised = predict(prof, perf, 4, "mpdkfac", update_freq=(1, 10))["InverseComm"]
    level = predict(even, perf, 4, "mpdkfac", update_freq=(1, 10))["InverseComm"]
    assert amortised - level == pytest.approx(scale * critical_inversions("mpdkfac") / 10)


def test_a_rank_inverting_alone_does_not_lag():
    """The profile measures the ranks' spread with every rank inverting at once; where the others already wait for
    its broadcasts the critical rank has the machine to itself. Seq-Dist on 2 workers with one huge factor first:
    rank 0 inverts it alone, and lags only for as long as rank 1 inverts too."""
    raw = _profile()
    raw["factors"][0]["dim"] = 3000  # A of l0: the first factor in the optimizer's order, rank 0's
    prof, even = _typed(raw, rank_inversions=(2.0, 3.0)), _typed(raw, rank_inversions=(2.5, 2.5))
    perf = _perf()
    plan = simulated_work_plan(prof, perf, 2, "mpdkfac").inversion
    own = [sum(a.t_comp for a in plan.assignments if a.owner == r) for r in range(2)]
    assert own[0] > 10 * own[1]
    lagging, level = predict(prof, perf, 2, "mpdkfac"), predict(even, perf, 2, "mpdkfac")
    assert lagging["InverseComm"] - level["InverseComm"] == pytest.approx(rank_lag((2.0, 3.0), 2) * own[1])
    # Balanced (LBP): both ranks invert throughout, the critical one lags for all of its inversions.
    lbp = simulated_work_plan(prof, perf, 2, "spdkfac").inversion
    spans = lbp.makespans()
    critical = max(range(2), key=lambda r: spans[r])
    mine = [sum(a.t_comp for a in lbp.assignments if a.computes(r)) for r in range(2)]
    assert predict(prof, perf, 2, "spdkfac")["iteration"] - predict(even, perf, 2, "spdkfac")["iteration"] == pytest.approx(
        rank_lag((2.0, 3.0), 2) * min(mine[critical], mine[1 - critical])
    )


def test_sgd_lag_only_where_the_profile_did_not_measure_the_wait():
    prof = _typed(rank_sgd=(0.5, 0.7), comm_workers=2, sgd_grad_wait=0.05)
    even = _typed(rank_sgd=(0.6, 0.6), comm_workers=2, sgd_grad_wait=0.05)
    assert predict(prof, _perf(), 2, "sgd") == predict(even, _perf(), 2, "sgd")  # the measured wait holds it
    lagging, level = predict(prof, _perf(), 8, "sgd"), predict(even, _perf(), 8, "sgd")
    assert lagging["GradComm"] - level["GradComm"] == pytest.approx(rank_lag((0.5, 0.7), 8) * (level["FF&BP"] + level["Other"]))


# ----------------------------------------------------------------- the inversion stage


def test_owner_unpacks_the_copy_it_keeps_of_each_inverse_it_broadcasts():
    perf = _perf()
    bare, timed = _typed(), _timed()
    plan = simulated_work_plan(timed, perf, 2, "mpdkfac")
    for rank in range(2):  # Seq-Dist: each rank owns half the factors, no factor is everywhere
        assert sum(a.owner == rank for a in plan.inversion.assignments) == 6
    plain, charged = predict(bare, perf, 2, "mpdkfac"), predict(timed, perf, 2, "mpdkfac")
    # Each rank: unpack its 6 factors, pack and unpack its 6 inverses (mean rank's computation) ...
    assert charged["InverseComp"] - plain["InverseComp"] == pytest.approx(6 * (0.010 + 0.004 + 0.010))
    # ... and unpack the 6 it receives, in its wait.
    assert charged["InverseComm"] - plain["InverseComm"] == pytest.approx(6 * 0.010)
    # An eigendecomposition's owner keeps views into the buffer it sends: no second unpacking.
    eig_plain = predict(bare, perf, 2, "mpdkfac:compute_method=eigen")
    eig = predict(timed, perf, 2, "mpdkfac:compute_method=eigen")
    assert eig["InverseComp"] - eig_plain["InverseComp"] == pytest.approx(6 * (0.010 + 0.004))


def test_stage_split_is_the_mean_ranks_computation_and_the_wait_for_the_critical_rank():
    prof, perf = _typed(), _perf()
    r = predict(prof, perf, 4, "mpdkfac")
    charged = simulated_work_plan(prof, perf, 4, "mpdkfac").inversion  # inversions at the fitted model (no timings)
    own = [sum(a.t_comp for a in charged.assignments if a.owner == rank) for rank in range(4)]
    spans = charged.makespans()
    assert r["InverseComp"] == pytest.approx(sum(own) / 4)
    assert r["InverseComp"] + r["InverseComm"] == pytest.approx(max(spans))


def test_under_contention_each_rank_pays_the_broadcasts_it_receives():
    prof, perf = _typed(), _perf()
    free, busy = predict(prof, perf, 2, "mpdkfac"), predict(prof, perf, 2, "mpdkfac", contention=True)
    plan = simulated_work_plan(prof, perf, 2, "mpdkfac").inversion
    stage = [s + sum(a.t_comm for a in plan.assignments if a.owner not in (rank, ALL)) for rank, s in enumerate(plan.makespans())]
    assert busy["InverseComp"] == pytest.approx(free["InverseComp"])
    assert busy["InverseComp"] + busy["InverseComm"] == pytest.approx(max(stage))
    assert busy["InverseComm"] > free["InverseComm"]
    # D-KFAC broadcasts nothing: contention changes nothing in its stage.
    d_free, d_busy = predict(prof, perf, 2, "dkfac"), predict(prof, perf, 2, "dkfac", contention=True)
    assert (d_busy["InverseComp"], d_busy["InverseComm"]) == (d_free["InverseComp"], d_free["InverseComm"])


# ----------------------------------------------------------------- the hooks' own cost


def test_factors_are_packed_on_factor_steps_by_the_hooks_with_pipelining():
    bare = _typed(step_other=0.5)
    timed = dataclasses.replace(_timed(unpack=0.0, pack=0.004), step_other=0.5)
    packing = 0.004 * len(timed.factors)
    perf = _perf()
    for variant, workers, moved in (("spdkfac", 2, packing), ("dkfac", 2, 0.0), ("spdkfac", 1, 0.0)):
        plain, charged = predict(bare, perf, workers, variant), predict(timed, perf, workers, variant)
        assert charged["FF&BP"] - plain["FF&BP"] == pytest.approx(moved), variant
        assert plain["Other"] - charged["Other"] == pytest.approx(moved), variant
    # Steps that keep the factors pack nothing.
    for variant in ("spdkfac", "dkfac"):
        amortised = predict(timed, perf, 2, variant, update_freq=(10, 100))
        plain = predict(bare, perf, 2, variant, update_freq=(10, 100))
        in_passes = packing / 10 if variant == "spdkfac" else 0.0
        assert amortised["FF&BP"] - plain["FF&BP"] == pytest.approx(in_passes)
        assert plain["Other"] - amortised["Other"] == pytest.approx(packing - (packing / 10 - in_passes))
    # Never more than the rest of step() the profile measured.
    assert predict(_timed(pack=1.0), perf, 2, "spdkfac")["Other"] == 0.0


def test_steps_between_factor_steps_send_the_gradients_alone():
    """Only factor steps send factors: the amortised gradient wait is a factor step's (with pipelining its factor
    groups go out during backward, ahead of the last gradients) for their share, plain SGD's for the rest."""
    prof, slow = _typed(), _perf().to_dict()
    slow["allreduce"] = {"alpha": 1e-3, "beta": 1e-7}  # a network slow enough for the factors to matter
    perf = PerfModel.from_dict(slow)
    sgd = predict(prof, perf, 4, "sgd")["GradComm"]
    for variant in ("spdkfac", "dkfac"):
        every = predict(prof, perf, 4, variant)["GradComm"]
        amortised = predict(prof, perf, 4, variant, update_freq=(10, 100))["GradComm"]
        assert amortised == pytest.approx(0.9 * sgd + 0.1 * every), variant
    assert predict(prof, perf, 4, "spdkfac")["GradComm"] > 10 * sgd  # (the pipelined factors do hold them back here)


# ----------------------------------------------------------------- the per-rank totals in the profile file


def test_profile_files_keep_the_per_rank_totals_and_read_version_1(tmp_path):
    prof = _typed(rank_passes=(1.0, 1.2), rank_inversions=(2.0, 3.0), rank_sgd=(0.5, 0.6))
    path = tmp_path / "v2.json"
    prof.save(str(path))
    raw = json.loads(path.read_text())
    assert raw["format_version"] == FORMAT_VERSION == 4
    assert load_profiles([str(path)]) == prof
    old = {k: v for k, v in raw.items() if k not in ("rank_passes", "rank_inversions", "rank_sgd", *VERSION_3_FIELDS, *VERSION_4_FIELDS)}
    old["format_version"] = 1
    path.write_text(json.dumps(old))
    read = load_profiles([str(path)])
    assert (read.rank_passes, read.rank_inversions, read.rank_sgd) == ((), (), ())
    assert predict(read, _perf(), 2, "spdkfac") == predict(_typed(), _perf(), 2, "spdkfac")
    path.write_text(json.dumps(dict(old, rank_passes=[1.0, 1.2])))  # a version-1 file never held them
    with pytest.raises(ValueError, match=r"unknown field.*rank_passes"):
        load_profiles([str(path)])
    path.write_text(json.dumps(dict(raw, rank_inversions=[2.0, -1.0])))
    with pytest.raises(ProfileValueError, match="rank_inversions"):
        load_profiles([str(path)])


def test_averaged_profiles_average_the_totals_rank_by_rank():
    a = _typed(rank_passes=(1.0, 1.2), rank_inversions=(2.0, 3.0))
    b = _typed(rank_passes=(1.4, 1.0), rank_inversions=(2.0, 3.0))
    mean = average_profiles([a, b])
    assert mean.rank_passes == pytest.approx((1.2, 1.1))
    assert mean.rank_inversions == pytest.approx((2.0, 3.0))
    assert average_profiles([a, _typed()]).rank_passes == ()  # one without totals: none


def test_a_profile_across_ranks_is_the_mean_with_each_ranks_totals():
    base = _typed(_with_preconditioning(_profile()), sgd_step=0.002, sgd_forward_backward=0.2, sgd_grad_wait=0.0)

    def ranked(rank):
        factors = tuple(dataclasses.replace(f, invert=0.01 * (rank + 1), compute=0.002 * (rank + 1)) for f in base.factors)
        return dataclasses.replace(base, forward=0.07 * (rank + 1), factors=factors)

    # Iteration by iteration rank 1 is slower, then rank 0: each iteration waits for its own slowest.
    work = {0: ([1.0, 3.0], [0.5, 0.5]), 1: ([3.0, 1.0], [0.5, 0.5])}
    results = run_ranks(2, lambda backend: _across_ranks(ranked(backend.rank), backend, work[backend.rank]))
    assert results[0] == results[1]
    merged = results[0]
    assert merged.forward == pytest.approx(0.07 * 1.5)
    assert all(f.invert == pytest.approx(0.015) and f.compute == pytest.approx(0.003) for f in merged.factors)
    n = len(base.factors)
    assert merged.rank_inversions == pytest.approx((0.01 * n, 0.02 * n))
    own = [ranked(r).forward + ranked(r).backward + ranked(r).step_other for r in range(2)]
    assert merged.rank_passes == pytest.approx(tuple(own))
    assert merged.rank_sgd == pytest.approx((0.202, 0.202))
    assert merged.precondition == base.precondition
    assert merged.iteration_lag_passes == pytest.approx(1.0 / 2.0)  # max - mean = 1 s of a 2 s mean, in both iterations
    assert merged.iteration_lag_sgd == 0.0


def test_the_iteration_lag_is_each_iterations_slowest_rank_not_the_slowest_total():
    # Equal totals (no persistent difference): only the per-iteration spread is waited for.
    assert iteration_lag([[1.0, 2.0], [2.0, 1.0]]) == pytest.approx(0.5 / 1.5)
    assert iteration_lag([[1.0, 1.0], [1.0, 1.0]]) == 0.0
    # A persistently slower rank: the same as the lag of the totals.
    assert iteration_lag([[1.0, 1.0], [1.2, 1.2]]) == pytest.approx(rank_lag((1.0, 1.2), 2))
    # Three ranks: max - mean per iteration 2, 2/3, 1/3, 1 (mean 1) of a 2.5 s mean.
    assert iteration_lag([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]) == pytest.approx(1.0 / 2.5)
    assert iteration_lag([[1.0, 2.0]]) == iteration_lag([]) == 0.0  # one rank waits for nobody


def test_the_lag_charged_comes_from_each_iteration_where_the_profile_measured_it():
    totals = _typed(rank_passes=(1.0, 1.0), rank_sgd=(0.5, 0.5), comm_workers=2, sgd_grad_wait=0.05)
    spread = dataclasses.replace(totals, iteration_lag_passes=0.1, iteration_lag_sgd=0.2)
    perf = _perf()
    for workers in (2, 8):
        level, lagging = predict(totals, perf, workers, "dkfac"), predict(spread, perf, workers, "dkfac")
        work = sum(level[k] for k in ("FF&BP", "FactorComp", "Other"))  # every computing phase (parts of these)
        scale = expected_max_normal(workers) / expected_max_normal(2)
        assert lagging["GradComm"] - level["GradComm"] == pytest.approx(0.1 * scale * work)
        assert iteration_lag_share(0.1, (1.0, 1.0), workers) == pytest.approx(0.1 * scale)
    # Plain SGD at another worker count: its own passes' spread; at the profiled count its measured wait holds it.
    level, lagging = predict(totals, perf, 8, "sgd"), predict(spread, perf, 8, "sgd")
    work = level["FF&BP"] + level["Other"]
    assert lagging["GradComm"] - level["GradComm"] == pytest.approx(0.2 * expected_max_normal(8) / expected_max_normal(2) * work)
    assert predict(spread, perf, 2, "sgd") == predict(totals, perf, 2, "sgd")
    assert iteration_lag_share(None, (1.0, 1.2), 8) == rank_lag((1.0, 1.2), 8)  # older profiles: the totals' lag
    assert iteration_lag_share(0.1, (), 8) == iteration_lag_share(0.1, (1.0, 1.0), 1) == 0.0


# ----------------------------------------------------------------- decisions: the simulator's are the optimizer's


@pytest.fixture(scope="module")
def small_profile() -> Profile:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return measure_profile("cifar_resnet20", resolution=8, batch_size=2, iters=1)


@pytest.mark.parametrize("workers", [2, 3, 8])
@pytest.mark.parametrize(
    "variant",
    [
        "spdkfac",
        "mpdkfac",
        "dkfac",
        "spdkfac-dp",
        "spdkfac:compute_method=eigen",
        "spdkfac:grad_worker_fraction=auto",
        "spdkfac:grad_worker_fraction=auto,overlap_preconditioning=false",
        "spdkfac:grad_worker_fraction=0.5",
    ],
)
def test_the_simulator_plans_what_the_optimizer_plans(small_profile, variant, workers, tmp_path):
    """Placement, broadcast order and preconditioning owners of an optimizer on ``workers`` ranks, from the same
    performance-model file, equal the plan predict charges for that model's profile (and a configuration the
    optimizer refuses at this worker count, the simulator refuses with the same message)."""
    perf = _perf(world=2)
    path = tmp_path / "perf.json"
    perf.save(str(path))
    group = InProcessGroup(workers)
    model = get_model("cifar_resnet20")
    try:
        simulated = simulated_work_plan(small_profile, perf, workers, variant)
    except ValueError as exc:
        refused = exc
    else:
        refused = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if refused is not None:
            with pytest.raises(ValueError, match=f"^{re.escape(str(refused))}$"):
                make_optimizer(variant, model, lr=0.1, backend=group.backends[0], perf_model=str(path))
            return
        opt = make_optimizer(variant, model, lr=0.1, backend=group.backends[0], perf_model=str(path))
    assert simulated is not None

    def decisions(plan):
        return (
            [(a.key, a.owner) for a in plan.inversion.assignments],
            [a.key for a in plan.inversion.broadcast_order()],
            plan.preconditioners,
            (plan.grad_workers, plan.layer_groups),
            [(s.name, s.a_dim, s.g_dim) for s in plan.layers],
        )

    assert decisions(simulated) == decisions(opt.work_plan)
    costs = [[(round(a.t_comp, 12), round(a.t_comm, 12)) for a in p.inversion.assignments] for p in (simulated, opt.work_plan)]
    assert costs[0] == costs[1]  # planned with the same models at this worker count
    assert ScaledModels(perf, workers).scaled.allreduce == opt.perf_model.allreduce  # the fusion planner's inputs too


def test_plain_sgd_has_no_work_plan(small_profile):
    assert simulated_work_plan(small_profile, _perf(), 4, "sgd") is None


#: The core variant in the fast loop; the others (a second of two in-process ranks each) in the whole suite.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "variant", ["spdkfac", pytest.param("dkfac", marks=SLOW), pytest.param("mpdkfac:fusion_threshold_bytes=4096", marks=SLOW)]
)
def test_the_simulator_fuses_with_the_optimizers_inputs(small_profile, variant, monkeypatch, tmp_path):
    """Two in-process ranks train until the optimizer has planned its fusion; the simulator plans each pass with the
    same policy, pipelining, factor order and sizes, all-reduce model and threshold (the plan is then the same for
    the same ready times: the optimal rule is unchanged by shifting them all, and the passes start at another
    instant in the profile than in the optimizer's clock)."""
    import torch.nn.functional as F

    from spdkfac.simulate import prediction
    from spdkfac.step import factor_profiler as profiler

    perf = _perf(world=2)
    path = tmp_path / "perf.json"
    perf.save(str(path))
    calls: dict[str, list[tuple]] = {"optimizer": [], "simulator": []}

    def spy(who, real):
        def planned(*args, **kwargs):
            groups = real(*args, **kwargs)
            calls[who].append((args, kwargs.get("element_size", 4), groups, threading.get_ident()))
            return groups

        return planned

    monkeypatch.setattr(profiler, "fusion_groups", spy("optimizer", profiler.fusion_groups))
    monkeypatch.setattr(prediction, "fusion_groups", spy("simulator", prediction.fusion_groups))

    def train(backend):
        torch.manual_seed(0)
        model = get_model("cifar_resnet20")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = make_optimizer(variant, model, lr=0.01, backend=backend, perf_model=str(path), profile_steps=1)
        x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
        for _ in range(3):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return opt.fusion_plan()

    plans = run_ranks(2, train)
    assert plans[0] == plans[1]
    predict(small_profile, perf, 2, variant)
    first = calls["optimizer"][0][3]
    optimizer_calls = [c for c in calls["optimizer"] if c[3] == first]  # one rank's A and G passes (all plan alike)
    assert len(optimizer_calls) == len(calls["simulator"]) == 2
    for kind, (o_args, o_size, o_groups, _), (s_args, s_size, _, _) in zip(("A", "G"), optimizer_calls, calls["simulator"]):
        policy, pipelining, o_ready, sizes, alpha, beta, threshold = o_args
        assert (policy, pipelining, sizes, threshold, o_size) == (s_args[0], s_args[1], s_args[3], s_args[6], s_size), kind
        assert (alpha, beta) == pytest.approx((s_args[4], s_args[5])), kind
        order = [key for group in plans[0][kind] for key in group]
        assert order == [f.key for f in small_profile.factors if f.kind == kind]  # the profile's arrival order
        shifted = [t + 0.5 for t in o_ready]
        assert prediction.fusion_groups(policy, pipelining, shifted, s_args[3], s_args[4], s_args[5], s_args[6]) == o_groups
        assert [[order[i] for i in g] for g in o_groups] == plans[0][kind]


@pytest.mark.parametrize(
    "variant",
    [
        "spdkfac",
        pytest.param("dkfac", marks=SLOW),
        pytest.param("mpdkfac", marks=SLOW),
        pytest.param("spdkfac:overlap_preconditioning=false", marks=SLOW),
        pytest.param("spdkfac-dp", marks=SLOW),
    ],
)
def test_the_simulator_overlaps_the_steps_the_optimizer_overlaps(variant):
    """Two in-process ranks, factors every 2 and inverses every 4 steps: the share of steps the optimizer preconditioned
    while gradients were still averaged (and of factor steps before waiting for the factors) is the share the
    simulator hides waits on."""
    import torch.nn.functional as F

    from spdkfac.simulate.prediction import _overlap_shares
    from spdkfac.variants import variant_config

    steps, freq = 8, (2, 4)

    def train(backend):
        torch.manual_seed(0)
        model = get_model("cifar_resnet20")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = make_optimizer(variant, model, lr=0.01, backend=backend, factor_update_freq=freq[0], inv_update_freq=freq[1])
        x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 10, (2,))
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return opt.kfac_step.overlapped_steps, opt.kfac_step.overlapped_factor_steps

    counts = run_ranks(2, train)
    assert counts[0] == counts[1]
    enabled = bool(variant_config(variant).get("overlap_preconditioning", True))
    shares = _overlap_shares(enabled, True, 2, 1 / freq[0], 1 / freq[1])
    assert (counts[0][0] / steps, counts[0][1] / steps) == pytest.approx(shares)


def test_under_contention_every_all_reduce_costs_what_the_profiles_sgd_passes_measured():
    # Plain SGD's model at 2 workers: six 1.1 ms gradient all-reduces during backward, 1.005 ms after it.
    during, after = 6 * (1e-3 + 1e-8 * 10000), 1e-3 + 1e-8 * 500
    lag = 0.01 * (0.18 + 2 * during + 0.002)  # the wait for each iteration's slowest rank, measured apart
    measured = _typed(
        comm_workers=2,
        sgd_forward_backward_local=0.18,
        sgd_forward_backward=0.18 + 2 * during,  # the real all-reduces slowed the passes twice as much as modelled...
        sgd_grad_wait=lag + 2 * after,  # ... and left twice the modelled wait after them
        iteration_lag_sgd=0.01,
    )
    perf = _perf()
    assert communication_scale(measured, perf) == pytest.approx(2.0)
    older = dataclasses.replace(measured, iteration_lag_sgd=None)  # no per-iteration spread: no measurement to use
    assert communication_scale(older, perf) == 1.0
    assert communication_scale(dataclasses.replace(measured, comm_workers=1), perf) == 1.0
    scaled, plain = (predict(p, perf, 2, "dkfac", contention=True) for p in (measured, older))
    computing = ("FF&BP", "FactorComp")  # what the engine's work during the passes stretches
    assert sum(scaled[k] for k in computing) - sum(plain[k] for k in computing) == pytest.approx(during)
    assert scaled["GradComm"] == pytest.approx(2 * plain["GradComm"])  # the last gradient, after backward
    assert scaled["FactorComm"] == pytest.approx(2 * plain["FactorComm"])
    assert plain["FactorComm"] > 0
    # Without contention the fitted model stands (communication costs the passes nothing).
    assert predict(measured, perf, 2, "dkfac") == predict(older, perf, 2, "dkfac")
