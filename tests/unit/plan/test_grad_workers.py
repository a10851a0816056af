"""KAISA's gradient workers (``grad_worker_fraction``) and its ``'auto'`` choice, on 4 in-process ranks.

N workers must give the parameters one worker gives on the global batch, and
every rank bitwise the same parameters, for every fraction; each rank holds
only its layers' decompositions.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from nets import batch, small_net, train

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import CommBackend
from spdkfac.comm.inprocess import InProcessBackend, RankError, run_ranks
from spdkfac.kfac.factor_shape import FactorShape
from spdkfac.kfac.methods import EKFACMethod, get_method
from spdkfac.perfmodels import PerfModel
from spdkfac.plan.grad_worker_choice import GradWorkerProblem, plan_memory, result_broadcast_seconds
from spdkfac.plan.grad_workers import GradWorkerGroups, grad_worker_count, valid_fractions
from spdkfac.plan.memory_check import layer_memory
from spdkfac.plan.placement import ALL
from spdkfac.plan.work_plan import LayerShape, WorkPlan, layer_seconds, preconditioning_seconds

P = 4
STEPS = 4
BASE: dict[str, Any] = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=1)
GLOBAL_BATCH = 48  # more samples than any factor's dimension (full-rank factors), where a warm refresh is compared
SHAPES = [LayerShape(f"fc{i}", 10 + i, 6 + i % 3) for i in range(8)]  # similar sizes: groups hold alike


def _perf(inverse_cubic: float = 1e-3, broadcast_alpha: float = 1e-1, allreduce_alpha: float | None = None) -> PerfModel:
    """Decompositions dear next to broadcasts for d >= 6 (so factors are owned and broadcast), or as given."""
    d = PerfModel.default().to_dict()
    if allreduce_alpha is not None:
        d["allreduce"] = {"alpha": allreduce_alpha, "beta": 1e-9}
    d["inverse"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, inverse_cubic], "floor": 1e-6}
    d["eigen"] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, inverse_cubic], "floor": 1e-6}
    d["broadcast"] = {"alpha": broadcast_alpha, "beta": 1e-6}
    return PerfModel.from_dict(d, "crafted")


@pytest.fixture(autouse=True)
def _float64():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="performance model")
        yield
    torch.set_default_dtype(old)


# -- the groups ----------------------------------------------------------------------------------
def test_groups_and_receivers_partition_the_ranks():
    groups = GradWorkerGroups(8, 2)
    assert groups.count == 4
    assert [groups.members(k) for k in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [groups.receivers(j) for j in range(2)] == [(0, 2, 4, 6), (1, 3, 5, 7)]
    for k in range(groups.count):  # each receiver group holds exactly one member of every gradient-worker group
        for j in range(2):
            assert len(set(groups.members(k)) & set(groups.receivers(j))) == 1


def test_fraction_to_count():
    assert [grad_worker_count(f, 4) for f in (0.25, 0.5, 1.0)] == [1, 2, 4]
    assert grad_worker_count(0.25, 2) == 1  # max(1, frac * P): an elastic restart at fewer workers
    assert valid_fractions(6) == [1 / 6, 2 / 6, 3 / 6, 1.0]
    with pytest.raises(ValueError, match=r"0\.25 gives 1\.5 gradient workers .* one of 0\.166667, 0\.333333, 0\.5, 1"):
        grad_worker_count(0.25, 6)
    with pytest.raises(ValueError, match="whole divisor"):
        grad_worker_count(0.75, 4)
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        grad_worker_count(0.0, 4)


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="pass only one of them"):
        SPDKFACOptimizer(small_net(), lr=0.1, backend="single", distribute_preconditioning=True, grad_worker_fraction=0.5)
    with pytest.raises(ValueError, match="grad_worker_fraction must be a number"):
        SPDKFACOptimizer(small_net(), lr=0.1, backend="single", grad_worker_fraction="half")
    with pytest.raises(ValueError, match="set grad_worker_fraction='auto'"):
        SPDKFACOptimizer(small_net(), lr=0.1, backend="single", grad_worker_fraction=0.5, memory_budget=10**6)
    with pytest.raises(RankError, match="whole divisor"):
        run_ranks(P, lambda b: SPDKFACOptimizer(small_net(), lr=0.1, backend=b, perf_model=_perf(), grad_worker_fraction=0.75))


# -- the plan ------------------------------------------------------------------------------------
@pytest.mark.parametrize("native", [True, False])
def test_plan_owners_are_gradient_workers(native):
    plan = WorkPlan.make(SHAPES, 8, _perf(), "lbp", "inverse", grad_workers=2, native_subgroups=native)
    assert plan.grad_worker_fraction == 0.25
    owned = [a for a in plan.inversion.assignments if a.owner != ALL]
    assert owned  # some factors are placed and broadcast inside their group
    for a in plan.inversion.assignments:
        _kind, layer = a.key
        assert a.members == plan.gradient_workers(layer)
        assert a.owner == ALL or a.owner in a.members
    names = [s.name for s in SHAPES]
    for b in plan.result_broadcasts(names):
        assert b.root in plan.gradient_workers(b.layers[0])
        assert b.root in b.members
        if native:
            assert b.members == tuple(range(b.root % 2, 8, 2))
        else:
            assert b.members == tuple(range(8))
            assert b.root == plan.gradient_workers(b.layers[0])[0]
    # Every rank gets every layer's update: it preconditions it, or is a member of a broadcast carrying it.
    for r in range(8):
        here = set(plan.preconditioned_here(r, names))
        got = {n for b in plan.result_broadcasts(names) if r in b.members for n in b.layers}
        assert here | got == set(names)


def test_all_gradient_workers_is_the_plain_plan():
    perf = _perf()
    plain = WorkPlan.make(SHAPES, 4, perf, "lbp", "inverse")
    full = WorkPlan.make(SHAPES, 4, perf, "lbp", "inverse", grad_workers=4, native_subgroups=True)
    assert full.groups is None
    assert full.result_broadcasts([s.name for s in SHAPES]) == []
    assert [(a.key, a.owner) for a in full.inversion.assignments] == [(a.key, a.owner) for a in plain.inversion.assignments]
    memopt = WorkPlan.make(SHAPES, 4, perf, "lbp", "inverse", distribute_preconditioning=True)
    assert memopt.grad_workers == 1
    assert set(memopt.preconditioners.values()) == set(range(4))


def test_layer_groups_balance_decompositions_and_preconditioning():
    """A group decomposes its layers' factors and preconditions them: both count, the decompositions per refresh."""
    perf = _perf()
    # Three layers dear to decompose (one wide factor) but cheap to precondition, one the other way round.
    shapes = [LayerShape(f"wide{i}", 60, 2) for i in range(3)] + [LayerShape("square", 40, 40)]
    names = [s.name for s in shapes]

    def busiest(plan: WorkPlan, inv_update_freq: int) -> float:
        per_rank = [0.0, 0.0]
        for s in shapes:
            per_rank[plan.preconditioners[s.name]] += layer_seconds(perf, get_method("inverse"), s, inv_update_freq)
        return max(per_rank)

    every = WorkPlan.make(shapes, 2, perf, "lbp", "inverse", grad_workers=1, inv_update_freq=1)
    # Decomposing every step, the wide layers are shared out (by preconditioning alone, all three would share a rank).
    assert len({every.preconditioners[n] for n in names[:3]}) == 2
    rare = WorkPlan.make(shapes, 2, perf, "lbp", "inverse", grad_workers=1, inv_update_freq=100)
    # Decomposing once in 100 steps, the preconditioning decides: the square layer alone against the three wide ones.
    assert {rare.preconditioners[n] for n in names[:3]} == {1 - rare.preconditioners["square"]}
    assert busiest(every, 1) < busiest(rare, 1)
    assert busiest(rare, 100) <= busiest(every, 100)
    # The eigen method's preconditioning is twice the inverse method's products (into the eigenbasis and back).
    square = shapes[-1]
    assert preconditioning_seconds(perf, get_method("eigen"), square) == 2 * preconditioning_seconds(perf, get_method("inverse"), square)


# -- N workers equal one worker ------------------------------------------------------------------
def _reference(cfg: dict[str, Any], steps: int = STEPS, global_batch: int = 4 * P) -> dict[str, torch.Tensor]:
    x, y = batch(global_batch)
    model = small_net().double()
    opt = SPDKFACOptimizer(model, backend="single", perf_model=_perf(), **cfg)
    train(model, opt, x.double(), y, steps)
    return model.state_dict()


def _shard(rank: int, size: int, global_batch: int = 4 * P) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(global_batch)
    local = global_batch // size
    return x.double()[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]


def _distributed(
    cfg: dict[str, Any], steps: int = STEPS, size: int = P, global_batch: int = 4 * P
) -> list[tuple[dict[str, torch.Tensor], SPDKFACOptimizer]]:
    models = [small_net().double() for _ in range(size)]  # built here: small_net seeds the global generator

    def body(backend: CommBackend) -> tuple[dict[str, torch.Tensor], SPDKFACOptimizer]:
        model = models[backend.rank]
        opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **cfg)
        train(model, opt, *_shard(backend.rank, size, global_batch), steps, accumulate=cfg.get("accumulation_steps", 1))
        return model.state_dict(), opt

    return run_ranks(size, body, timeout=120)


def _assert_matches(results: list[tuple[dict[str, torch.Tensor], SPDKFACOptimizer]], ref: dict[str, torch.Tensor]) -> None:
    for name, value in ref.items():
        torch.testing.assert_close(results[0][0][name], value, rtol=1e-9, atol=1e-11)
        for params, _ in results[1:]:
            assert torch.equal(params[name], results[0][0][name]), f"{name} differs between ranks"
    assert any(not torch.allclose(ref[k], v.double()) for k, v in small_net().state_dict().items())  # training moved


@pytest.mark.slow
@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_every_fraction_matches_one_worker(method):
    usage = {}
    for fraction in (0.25, 0.5, 1.0):
        cfg = dict(BASE, compute_method=method, grad_worker_fraction=fraction)
        results = _distributed(cfg)
        _assert_matches(results, _reference(cfg))
        opts = [opt for _, opt in results]
        assert opts[0].work_plan.grad_workers == round(fraction * P)
        # A rank holds exactly its layers' decompositions, as the plan's memory count says.
        for rank, opt in enumerate(opts):
            for layer in opt.layers:
                assert layer.decomposed == opt.work_plan.holds(rank, layer.name), (fraction, rank, layer.name)
            assert sum(opt.memory_usage().values()) == plan_memory(opt.work_plan, method, 8)[rank]
        usage[fraction] = [sum(opt.memory_usage().values()) for opt in opts]
    # The total falls with the fraction; the fullest worker's never grows (here the largest layer alone fills it).
    assert sum(usage[0.25]) < sum(usage[0.5]) < sum(usage[1.0])
    assert max(usage[0.25]) <= max(usage[0.5]) < max(usage[1.0])


@pytest.mark.slow
def test_warm_refresh_splits_only_the_preconditioning_and_resumes_exactly():
    """A warm refresh starts from the previous basis, so every rank holds every basis (placed as COMM-OPT) and the
    fraction splits only the preconditioning: one worker's result, and the saving rank's checkpoint holds every
    basis and its age, so a run resumed from it continues bit for bit. More samples than any factor's dimension
    (distinct eigenvalues: within a repeated one a warm basis follows rounding, tests/unit/kfac/test_ekfac.py)."""
    cfg = dict(BASE, compute_method="eigen", eigen_refresh="warm", eigen_full_every=3, grad_worker_fraction=0.5)
    results = _distributed(cfg, steps=5, global_batch=GLOBAL_BATCH)
    _assert_matches(results, _reference(cfg, steps=5, global_batch=GLOBAL_BATCH))
    opts = [opt for _, opt in results]
    plan = opts[0].work_plan
    names = [layer.name for layer in opts[0].layers]
    assert plan.held_everywhere
    assert plan.grad_workers == 2
    comm_opt = WorkPlan.make([LayerShape.of(la) for la in opts[0].layers], P, opts[0].perf_model, "lbp", opts[0].method)
    assert plan.inversion.assignments == comm_opt.inversion.assignments
    assert any(int(layer.decomposition("A").age) > 0 for layer in opts[0].layers)  # warm refreshes ran
    statistics = [opt.refresh_statistics() for opt in opts]  # every rank counts every factor's refreshes alike
    assert statistics[0]["totals"]["warm"] > 0
    assert all(s == statistics[0] for s in statistics)
    for rank, opt in enumerate(opts):
        assert all(layer.decomposed for layer in opt.layers)
        assert 0 < len(plan.preconditioned_here(rank, names)) < len(names)
        assert sum(opt.memory_usage().values()) == plan_memory(plan, opt.method, 8)[rank]  # the bases' ages counted too

    models = {run: [small_net().double() for _ in range(P)] for run in ("resumed", "uninterrupted")}

    def body(backend: CommBackend) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any]]:
        x, y = _shard(backend.rank, P, GLOBAL_BATCH)
        out = []
        for run in ("resumed", "uninterrupted"):
            model = models[run][backend.rank]
            opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **cfg)
            train(model, opt, x, y, 3)
            state = copy.deepcopy(opt.state_dict())
            if run == "resumed":
                opt.remove_hooks()
                opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **cfg)
                opt.load_state_dict(state)
            train(model, opt, x, y, 3)
            out.append(model.state_dict())
        return out[0], out[1], state["kfac"]

    ranks = run_ranks(P, body, timeout=120)
    for resumed, uninterrupted, saved in ranks:
        for name, value in uninterrupted.items():
            assert torch.equal(resumed[name], value), name
        assert all(entry[f"{kind}_eigen"]["age"] is not None for entry in saved["layers"].values() for kind in "AG")
        for layer, entry in saved["layers"].items():  # every rank saves the same bases: rank 0's checkpoint is everyone's
            assert torch.equal(entry["A_eigen"]["Q"], ranks[0][2]["layers"][layer]["A_eigen"]["Q"])


@pytest.mark.slow
def test_amortised_accumulated_and_without_pipelining_match_one_worker():
    cfg = dict(BASE, grad_worker_fraction=0.5, factor_update_freq=2, inv_update_freq=4, accumulation_steps=2, kl_clip=None)
    results = _distributed(cfg, steps=6)
    _assert_matches(results, _reference({**cfg, "accumulation_steps": 1}, steps=6))
    assert results[0][1].kfac_step.overlapped_steps == 4  # preconditioned while gradients were still averaged
    cfg = dict(BASE, grad_worker_fraction=0.5, pipelining=False, fusion="threshold", compute_method="eigen")
    _assert_matches(_distributed(cfg), _reference(cfg))


@pytest.mark.slow
def test_engines_without_subgroup_broadcasts_match_one_worker(monkeypatch):
    """The fallback: broadcasts to every rank (non-holders drop the decompositions), one sender per group."""
    monkeypatch.setattr(InProcessBackend, "native_subgroups", False)
    monkeypatch.setattr(InProcessBackend, "broadcast_within_async", CommBackend.broadcast_within_async)
    cfg = dict(BASE, grad_worker_fraction=0.5)
    results = _distributed(cfg)
    _assert_matches(results, _reference(cfg))
    plan = results[0][1].work_plan
    assert not plan.native_subgroups
    assert all(len(b.members) == P for b in plan.result_broadcasts(list(plan.layer_groups)))


def test_each_ranks_link_carries_every_result_broadcast_it_takes_part_in():
    """Concurrent broadcasts share a rank's link: its busy time is the sum of theirs (each at its group's size),
    so at 1/P every rank moves every other group's preconditioned gradients, and fewer with more gradient workers."""
    perf = _perf(broadcast_alpha=0.5).scaled_to(8)
    elements = {s.name: s.a_dim * s.g_dim for s in SHAPES}
    busy = {}
    for g in (1, 2, 4, 8):
        plan = WorkPlan.make(SHAPES, 8, perf, "lbp", "inverse", grad_workers=g, native_subgroups=True)
        busy[g] = result_broadcast_seconds(plan, perf, elements)
        expected = [0.0] * 8
        for b in plan.result_broadcasts(list(elements)):
            fit = perf.scaled_to(len(b.members)).broadcast
            for r in b.members:
                expected[r] += fit.alpha + fit.beta * sum(elements[n] for n in b.layers)
        assert busy[g] == pytest.approx(expected)
    assert busy[8] == [0.0] * 8  # COMM-OPT sends nothing
    assert max(busy[1]) > max(busy[2]) > max(busy[4]) > 0
    # MEM-OPT: every rank takes part in all 8 broadcasts (one per group), each to all 8 ranks.
    plan = WorkPlan.make(SHAPES, 8, perf, "lbp", "inverse", grad_workers=1, native_subgroups=True)
    assert all(len(b.members) == 8 for b in plan.result_broadcasts(list(elements)))
    assert min(busy[1]) >= 8 * perf.broadcast.alpha


# -- 'auto' --------------------------------------------------------------------------------------
def test_auto_picks_the_fastest_fraction_that_fits():
    """Broadcasts cost 1 s, decompositions nothing: COMM-OPT sends no result; 2 gradient workers receive one
    broadcast per step (from the other group), 1 receives three; memory grows with the fraction."""
    perf = _perf(inverse_cubic=1e-12, broadcast_alpha=1.0)
    problem = GradWorkerProblem(SHAPES, 4, perf, "lbp", "inverse", native_subgroups=True)
    options = problem.options()
    memory = {o.grad_workers: o.memory for o in options}
    assert memory[1] < memory[2] < memory[4]
    seconds = {o.grad_workers: o.seconds for o in options}
    assert seconds[4] < seconds[2] < seconds[1]
    assert problem.choose().grad_workers == 4
    assert problem.choose(memory[4] - 1).grad_workers == 2
    assert problem.choose(memory[2] - 1).grad_workers == 1
    with pytest.raises(
        ValueError, match=rf"memory_budget={memory[1] - 1} bytes fits no .* least K-FAC state per worker is {memory[1]} bytes"
    ):
        problem.choose(memory[1] - 1)


def test_auto_prefers_fewer_gradient_workers_when_decompositions_dominate():
    """Decompositions dear, broadcasts cheap: spreading each layer's decompositions over fewer ranks is no slower,
    and MEM-OPT balances the largest factors over all ranks without sending them."""
    perf = _perf(inverse_cubic=1.0, broadcast_alpha=1e-9)
    problem = GradWorkerProblem(SHAPES, 4, perf, "lbp", "inverse", native_subgroups=True)
    options = {o.grad_workers: o for o in problem.options()}
    best = problem.choose()
    assert best.seconds == min(o.seconds for o in options.values())
    assert best.grad_workers < 4


def test_auto_hides_the_preconditioning_under_the_gradient_allreduce_when_the_optimizer_overlaps_them():
    """Preconditioning dear, decompositions amortised away, broadcasts cheap: without the overlap splitting the
    matmuls (MEM-OPT) is fastest; when every layer is preconditioned while a long gradient all-reduce runs, the
    matmuls are free and COMM-OPT, which sends nothing, wins."""
    perf = _perf(inverse_cubic=1e-3, broadcast_alpha=1e-2, allreduce_alpha=1e3)
    common = dict(native_subgroups=True, inv_update_freq=10**9)
    serial = GradWorkerProblem(SHAPES, 4, perf, "lbp", "inverse", overlap_preconditioning=False, **common)
    overlapped = GradWorkerProblem(SHAPES, 4, perf, "lbp", "inverse", overlap_preconditioning=True, **common)
    assert serial.choose().grad_workers == 1
    assert overlapped.choose().grad_workers == 4
    assert overlapped.choose().seconds < serial.choose().seconds
    # Steps that decompose cannot overlap (they need this step's factors first): decomposing every step, nothing hides.
    every = [
        GradWorkerProblem(SHAPES, 4, perf, "lbp", "inverse", native_subgroups=True, overlap_preconditioning=o).options()
        for o in (False, True)
    ]
    assert [o.seconds for o in every[0]] == [o.seconds for o in every[1]]
    # One worker has no all-reduce to hide anything under: the option changes nothing there.
    one = [
        GradWorkerProblem(SHAPES, 1, perf, "lbp", "inverse", overlap_preconditioning=o, **common).choose().seconds for o in (False, True)
    ]
    assert one[0] == one[1] > 0


@pytest.mark.slow
def test_auto_state_dict_and_restart_at_another_worker_count(capsys):
    """'auto' prints its choice, keeps it in state_dict; a checkpoint of 4 workers resumed on 2 re-chooses there,
    and the run still equals one worker on the global batch."""
    cfg = dict(BASE, grad_worker_fraction="auto")
    first = _distributed(cfg, steps=3)
    assert "grad_worker_fraction='auto' chose" in capsys.readouterr().out
    state = first[0][1].state_dict()
    record = state["kfac"]["grad_workers"]
    assert record["auto"]
    assert record["workers"] == P
    assert record["predicted_memory_bytes"] > 0
    params = first[0][0]
    models = [small_net().double() for _ in range(2)]

    def resume(backend: CommBackend) -> tuple[dict[str, torch.Tensor], SPDKFACOptimizer]:
        model = models[backend.rank]
        model.load_state_dict(params)
        opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **cfg)
        opt.load_state_dict(copy.deepcopy(state))  # as a file read by each process: momentum buffers not shared
        x, y = _shard(backend.rank, 2)
        train(model, opt, x + 0.3, y, 3)  # the data of steps 3..5
        return model.state_dict(), opt

    resumed = run_ranks(2, resume, timeout=120)
    assert resumed[0][1].state_dict()["kfac"]["grad_workers"]["workers"] == 2
    assert f"the checkpoint ran {record['grad_workers']}/{P} gradient workers; re-chosen for 2 workers" in capsys.readouterr().out
    _assert_matches(resumed, _reference(cfg, steps=6))


@pytest.mark.slow
def test_state_dict_round_trip_resumes_bit_for_bit():
    cfg = dict(BASE, grad_worker_fraction=0.5)
    straight = _distributed(cfg, steps=3)
    first = _distributed(cfg, steps=2)
    state, params = first[0][1].state_dict(), first[0][0]  # rank 0's: only its layers' decompositions
    models = [small_net().double() for _ in range(P)]

    def resume(backend: CommBackend) -> dict[str, torch.Tensor]:
        model = models[backend.rank]
        model.load_state_dict(params)
        opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **cfg)
        opt.load_state_dict(copy.deepcopy(state))
        x, y = _shard(backend.rank, P)
        train(model, opt, x + 0.2, y, 1)  # step 2's data, bitwise (x + 0.1 * s of a later step would round otherwise)
        return model.state_dict()

    for params_r in run_ranks(P, resume, timeout=120):
        for name, value in straight[0][0].items():
            assert torch.equal(params_r[name], value), name


def test_ekfac_state_is_counted_where_its_layer_is_preconditioned():
    """EKFAC's per-layer scaling lives on the layer's gradient workers (with a warm basis held by every worker too)."""
    shapes = [LayerShape(f"l{i}", 8, 8) for i in range(4)]
    for refresh in ("exact", "warm"):
        method = get_method(EKFACMethod(refresh))
        plan = WorkPlan.make(shapes, 2, PerfModel.default().scaled_to(2), "lbp", method, grad_workers=1)
        for rank in range(2):
            mine = sum(plan.holds(rank, s.name) for s in shapes)
            preconditioned = sum(rank in plan.preconditioning_ranks(s.name) for s in shapes)
            memory = sum(m.bytes for m in layer_memory(plan, method, rank, dict.fromkeys([s.name for s in shapes], 4)))
            factors, kept = 4 * 2 * 36 * 4, method.kept_size(FactorShape(8)) * 4  # (packed 8x8 triangles)
            assert memory == factors + mine * 2 * kept + preconditioned * 64 * 4, (refresh, rank)
            assert 0 < preconditioned < 4
            assert mine == (4 if refresh == "warm" else preconditioned)
