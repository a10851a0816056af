"""Fusion planner (Eq. 15) on hand-computed cases."""

import pytest

from spdkfac.plan.factor_fusion import plan_groups, plan_naive, plan_optimal, plan_threshold, serve_in_order, simulate_plan

READY = [1.0, 2.0, 3.0, 4.0, 5.0]
SIZES = [100, 100, 100, 100, 100]


def test_alpha_zero_never_merges():
    assert plan_optimal(READY, SIZES, alpha=0.0, beta=0.05) == [[0], [1], [2], [3], [4]]
    # Even when communication is backed up (beta large), merging saves nothing at alpha = 0.
    assert plan_optimal(READY, SIZES, alpha=0.0, beta=1.0) == [[0], [1], [2], [3], [4]]


def test_huge_alpha_merges_everything():
    assert plan_optimal(READY, SIZES, alpha=1e6, beta=1e-3) == [[0, 1, 2, 3, 4]]


def test_worked_example_eq15():
    # alpha = 1.5, beta = 0.01/element. Ready times 0.5, 1.0, 3.0, 3.2, 6.0; sizes 100, 50, 300, 10, 20.
    # g0 = [0] starts at 0.5; factor 1 ready at 1.0 < 0.5 + 1.5 -> merge (g0 = [0, 1], size 150).
    # g0 start = 1.0 (last member ready); factor 2 ready 3.0 >= 1.0 + 1.5 -> close g0.
    #   g0 comm ends 1.0 + 1.5 + 1.5 = 4.0.
    # g1 = [2] starts max(3.0, 4.0) = 4.0; factor 3 ready 3.2 < 4.0 + 1.5 -> merge (size 310).
    # g1 start = max(3.2, 4.0) = 4.0; factor 4 ready 6.0 >= 5.5 -> close g1 (ends 4.0 + 1.5 + 3.1 = 8.6).
    ready = [0.5, 1.0, 3.0, 3.2, 6.0]
    sizes = [100, 50, 300, 10, 20]
    plan = plan_optimal(ready, sizes, alpha=1.5, beta=0.01)
    assert plan == [[0, 1], [2, 3], [4]]
    end, nonoverlap = simulate_plan(plan, ready, sizes, 1.5, 0.01)
    # g2 starts max(6.0, 8.6) = 8.6, ends 8.6 + 1.5 + 0.2 = 10.3
    assert end == pytest.approx(10.3)
    assert nonoverlap == pytest.approx(4.3)
    # Eq. 15 beats no fusion on this example.
    assert end < simulate_plan([[i] for i in range(5)], ready, sizes, 1.5, 0.01)[0]


def test_threshold_and_naive():
    assert plan_threshold([10, 10, 10, 50, 5], threshold_bytes=120, element_size=4) == [[0, 1, 2], [3], [4]]
    assert plan_naive(3) == [[0, 1, 2]]
    assert plan_groups("layerwise", READY, SIZES, 1.0, 1.0) == [[i] for i in range(5)]


def test_bad_input():
    with pytest.raises(ValueError, match="non-decreasing"):
        plan_optimal([2.0, 1.0], [1, 1], 1.0, 1.0)
    with pytest.raises(ValueError, match="fusion must be one of"):
        plan_groups("bogus", READY, SIZES, 1.0, 1.0)


def test_serve_in_order_is_one_engine_queue():
    """Each launch starts when made and the previous one is done, in the order given (not re-sorted)."""
    assert serve_in_order([(0.0, 10), (1.0, 10), (50.0, 5)], lambda m: 2.0 + m) == [12.0, 24.0, 57.0]
    assert serve_in_order([(5.0, 1), (0.0, 1)], lambda m: 1.0) == [6.0, 7.0]
    assert serve_in_order([], lambda m: 1.0) == []
    # simulate_plan is that queue over a plan's groups (launched at their last member's readiness).
    ready, sizes = [0.5, 1.0, 3.0, 3.2, 6.0], [100, 50, 300, 10, 20]
    plan = [[0, 1], [2, 3], [4]]
    ends = serve_in_order([(ready[g[-1]], sum(sizes[i] for i in g)) for g in plan], lambda m: 1.5 + 0.01 * m)
    assert simulate_plan(plan, ready, sizes, 1.5, 0.01)[0] == ends[-1] == pytest.approx(10.3)
