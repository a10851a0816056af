"""Placement solvers (Algorithm 1, Eq. 22, local) as pure functions, any world size."""

import random

import pytest

from spdkfac.plan.placement import ALL, balance_by_cost, place, place_lbp, place_seq

COMP = lambda d: 1e-10 * d**3 + 1e-5  # noqa: E731 - cubic inversion cost
COMM = lambda d: 1e-3 + 1e-8 * d * (d + 1) / 2  # noqa: E731 - broadcast cost


def resnetish():
    dims = [147, 64, 576, 64, 64, 256, 256, 1152, 128, 512, 2304, 256, 1024, 4608, 512, 2048, 2049, 1000]
    return [((("A" if i % 2 == 0 else "G"), f"l{i}"), d) for i, d in enumerate(dims)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_lbp_local_exactly_when_compute_below_broadcast(world):
    plan = place_lbp(resnetish(), world, COMP, COMM)
    for a in plan.assignments:
        if world > 1 and plan.strategy == "lbp" and a.owner == ALL:
            assert COMP(a.dim) < COMM(a.dim)
        if world > 1 and a.owner != ALL:
            assert COMP(a.dim) >= COMM(a.dim)
    assert {a.key for a in plan.assignments} == {k for k, _ in resnetish()}


def test_lbp_sorted_descending_and_balanced():
    plan = place_lbp(resnetish(), 2, COMP, COMM)
    dims = [a.dim for a in plan.assignments]
    assert dims == sorted(dims, reverse=True)
    spans = plan.makespans()
    lower = max(*(COMP(d) for _, d in resnetish()), sum(COMP(d) for _, d in resnetish()) / 2)
    assert max(spans) >= lower
    assert max(spans) <= 1.5 * lower + sum(COMM(d) for _, d in resnetish())


@pytest.mark.parametrize("world", [2, 3, 5])
@pytest.mark.parametrize("seed", range(20))
def test_lbp_never_worse_than_seq(world, seed):
    rng = random.Random(seed)
    factors = [(f"f{i}", rng.randint(1, 3000)) for i in range(rng.randint(1, 40))]
    lbp = place_lbp(factors, world, COMP, COMM)
    seq = place_seq(factors, world, COMP, COMM)
    assert lbp.makespan <= seq.makespan + 1e-15


def test_deterministic_and_broadcast_order_consistent():
    a = place("lbp", resnetish(), 3, COMP, COMM)
    b = place("lbp", resnetish(), 3, COMP, COMM)
    assert [(x.key, x.owner) for x in a.assignments] == [(x.key, x.owner) for x in b.assignments]
    order = a.broadcast_order()
    assert sorted(x.key for x in order) == sorted(x.key for x in a.assignments if x.owner != ALL)
    for r in range(3):  # each rank's own factors keep their (descending) order
        mine = [x.dim for x in order if x.owner == r]
        assert mine == sorted(mine, reverse=True)


def test_seq_round_robin_and_local():
    factors = [(f"f{i}", 10 + i) for i in range(5)]
    seq = place("seq", factors, 2, COMP, COMM)
    assert [a.owner for a in seq.assignments] == [0, 1, 0, 1, 0]
    local = place("local", factors, 2, COMP, COMM)
    assert all(a.owner == ALL for a in local.assignments)
    assert "predicted makespan" in seq.table()


def test_bad_input():
    with pytest.raises(ValueError, match="placement must be one of"):
        place("greedy", [("a", 3)], 2, COMP, COMM)
    with pytest.raises(ValueError, match="world_size"):
        place("lbp", [("a", 3)], 0, COMP, COMM)
    with pytest.raises(ValueError, match="unique"):
        place("lbp", [("a", 3), ("a", 4)], 2, COMP, COMM)


def test_balance_by_cost_largest_first_to_least_loaded():
    owners = balance_by_cost([5, 4, 3, 3, 1], 2)
    assert owners == [0, 1, 1, 0, 1]  # 5->0, 4->1, 3->1 (4<5), 3->0 (5<7), 1->1 (7<8): loads 8 and 8
    assert balance_by_cost([5, 4, 3], 1) == [0, 0, 0]
    assert sorted(set(balance_by_cost([1.0] * 7, 3))) == [0, 1, 2]


def test_balance_by_cost_never_worse_than_largest_item_plus_even_share():
    rng = random.Random(0)
    for _ in range(50):
        costs = [rng.uniform(0, 10) for _ in range(rng.randint(1, 30))]
        p = rng.randint(1, 6)
        owners = balance_by_cost(costs, p)
        loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(p)]
        assert max(loads) <= max(costs) + sum(costs) / p + 1e-9  # the greedy bound


def test_balance_by_cost_rejects_bad_input():
    with pytest.raises(ValueError, match="world_size"):
        balance_by_cost([1.0], 0)
    with pytest.raises(ValueError, match="non-negative"):
        balance_by_cost([1.0, float("nan")], 2)


def test_eigen_placement_costed_with_the_eigen_curve_and_the_q_and_d_payload():
    import warnings

    from spdkfac import SPDKFACOptimizer
    from spdkfac.kfac.methods import payload_size, stage_costs
    from spdkfac.perfmodels import PerfModel
    from spdkfac.perfmodels.models import BroadcastModel, InverseModel

    perf = PerfModel.default()
    perf.inverse = InverseModel("cubic", {"coeffs": [1e-9, 0, 0, 1e-14], "floor": 1e-9})  # inversion: always local
    perf.eigen = InverseModel("cubic", {"coeffs": [1e-6, 0, 0, 1e-10], "floor": 1e-6}, name="eigen")
    perf.broadcast = BroadcastModel(1e-3, 1e-8, measured={1024: 0.5})
    factors = resnetish()
    inverse = place("lbp", factors, 2, *stage_costs(perf, "inverse"))
    eigen = place("lbp", factors, 2, *stage_costs(perf, "eigen"))
    assert all(a.owner == ALL for a in inverse.assignments)
    assert any(a.owner != ALL for a in eigen.assignments)
    assert any(a.owner == ALL for a in eigen.assignments)
    for a in eigen.assignments:
        assert a.t_comp == perf.eigen(a.dim)
        assert a.t_comm == pytest.approx(1e-3 + 1e-8 * (a.dim * a.dim + a.dim))  # Q and d, not a triangle
    for a in inverse.assignments:  # unchanged: the broadcast model per dimension, measured points included
        assert a.t_comm == pytest.approx(perf.broadcast(a.dim), rel=1e-12)
        assert a.t_comp == perf.inverse(a.dim)
    assert payload_size("inverse", 1024) == 1024 * 1025 // 2
    assert payload_size("eigen", 1024) == 1024 * 1025
    assert next(a for a in inverse.assignments if a.dim == 1024).t_comm == 0.5

    net = __import__("nets").small_net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the curve is there: no estimate
        opt = SPDKFACOptimizer(net, lr=0.1, backend="single", compute_method="eigen", perf_model=perf)
    assert [a.t_comp for a in opt.work_plan.inversion.assignments] == [perf.eigen(a.dim) for a in opt.work_plan.inversion.assignments]
