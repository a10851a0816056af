"""The distributed parts on 2-3 in-process ranks (threads): the fusion controller and the decomposition stage.

Every rank runs the real code against :mod:`spdkfac.comm.inprocess`, which
matches collectives the strict way (same order, same names, shapes, roots on
every rank), so these tests also check that the parts issue their
collectives consistently.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import pytest
import torch

from spdkfac.comm import CommBackend
from spdkfac.comm.inprocess import CollectiveMismatchError, InProcessGroup, RankError, run_ranks
from spdkfac.kfac.eigenbasis import eigen_payload, unpack_eigen
from spdkfac.kfac.layers import FactorKey
from spdkfac.kfac.linalg import invert_spd, pack_upper, unpack_upper
from spdkfac.plan.factor_fusion import plan_naive
from spdkfac.plan.placement import ALL, PlacementPlan, place
from spdkfac.step.decomposition_stage import compute_eigen, compute_inverses
from spdkfac.step.factor_allreduce import TensorFusionController

DTYPE = torch.float64


def _spd(dim: int, seed: int) -> torch.Tensor:
    """A symmetric positive semi-definite ``dim x dim`` matrix, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(dim + 3, dim, generator=g, dtype=DTYPE)
    m = x.T @ x / (dim + 3)
    return (m + m.T) / 2  # exactly symmetric, as the layers' factors are


# -- fusion controller -----------------------------------------------------------------------
DIMS: dict[FactorKey, int] = {
    ("A", "fc1"): 5,
    ("A", "fc2"): 4,
    ("A", "fc3"): 7,
    ("G", "fc1"): 3,
    ("G", "fc2"): 6,
    ("G", "fc3"): 2,
}
FORWARD = [("A", "fc1"), ("A", "fc2"), ("A", "fc3")]  # arrival order of the A factors (forward pass)
BACKWARD = [("G", "fc3"), ("G", "fc2"), ("G", "fc1")]  # and of the G factors (backward pass)
KEYS = FORWARD + BACKWARD
FUSED = {"A": [[("A", "fc1"), ("A", "fc2")], [("A", "fc3")]], "G": [[("G", "fc3")], [("G", "fc2"), ("G", "fc1")]]}
NAIVE = {kind: [[keys[i] for i in group] for group in plan_naive(len(keys))] for kind, keys in (("A", FORWARD), ("G", BACKWARD))}


def _batch_factor(key: FactorKey, rank: int, step: int) -> torch.Tensor:
    """What ``rank`` computes for ``key`` in iteration ``step`` (different on every rank)."""
    return _spd(DIMS[key], 1000 * step + 100 * rank + KEYS.index(key))


def _expected(key: FactorKey, size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed average as the engine computes it (rank-order sum, one division), and the plain mean."""
    packed = [pack_upper(_batch_factor(key, r, step)) for r in range(size)]
    total = packed[0].clone()
    for p in packed[1:]:
        total.add_(p)
    mean = pack_upper(torch.stack([_batch_factor(key, r, step) for r in range(size)]).mean(0))
    return total.div_(size), mean


def _controller_steps(
    backend: CommBackend,
    plans: dict[str, list[list[FactorKey]]] | None,
    steps: int = 2,
    order: Sequence[FactorKey] | None = None,
) -> list[dict[FactorKey, torch.Tensor]]:
    ctrl = TensorFusionController(backend)
    if plans is not None:
        for kind, groups in plans.items():
            ctrl.set_plan(kind, groups)
    out = []
    for step in range(steps):
        ctrl.begin_iteration()
        for key in order or KEYS:
            ctrl.submit(key, _batch_factor(key, backend.rank, step))
        out.append(ctrl.wait_all())
    return out


def _check_averages(per_rank: list[list[dict[FactorKey, torch.Tensor]]], size: int) -> None:
    for step in range(len(per_rank[0])):
        for key in KEYS:
            exact, mean = _expected(key, size, step)
            first = per_rank[0][step][key]
            assert first.shape == (DIMS[key] * (DIMS[key] + 1) // 2,)  # packed upper triangle
            assert torch.allclose(first, mean, rtol=1e-12, atol=1e-12), key
            assert torch.equal(first, exact), key  # the right rank's triangle in the right place of the buffer
            for results in per_rank[1:]:
                assert torch.equal(results[step][key], first), key  # bitwise equal on every rank


@pytest.mark.parametrize("size", [2, 3])
@pytest.mark.parametrize(("plans", "collectives"), [(None, 6), (FUSED, 4), (NAIVE, 2)], ids=["layerwise", "fused", "naive"])
def test_controller_averages_packed_factors_on_every_rank(size, plans, collectives):
    group = InProcessGroup(size)
    per_rank = group.run(lambda b: _controller_steps(b, plans))
    _check_averages(per_rank, size)
    history = group.history
    assert len(history) == 2 * collectives
    assert all(op == "allreduce" for op, _ in history)
    if plans is FUSED:  # groups are launched when their last member arrives, named after the first member
        assert [name for _, name in history[:4]] == [
            "spdkfac.factor.A.fc1.2",
            "spdkfac.factor.A.fc3.1",
            "spdkfac.factor.G.fc3.1",
            "spdkfac.factor.G.fc2.2",
        ]


def test_controller_replans_between_iterations():
    """Layer-wise while profiling, then a fused plan, then the naive one: each iteration averages correctly."""
    group = InProcessGroup(2)

    def fn(b: CommBackend) -> list[dict[FactorKey, torch.Tensor]]:
        ctrl = TensorFusionController(b)
        out = []
        for step, plans in enumerate([None, FUSED, NAIVE]):
            for kind in ("A", "G"):
                ctrl.set_plan(kind, None if plans is None else plans[kind])
            ctrl.begin_iteration()
            for key in KEYS:
                ctrl.submit(key, _batch_factor(key, b.rank, step))
                if key == ("A", "fc1") and plans is not None:
                    with pytest.raises(RuntimeError, match="cannot change the fusion plan"):
                        ctrl.set_plan("G", None)
            out.append(ctrl.wait_all())
        return out

    _check_averages(group.run(fn), 2)
    assert len(group.history) == 6 + 4 + 2


def test_controller_accepts_any_order_inside_a_group():
    """Under a plan the buffer layout follows the plan, not the arrival order, so only group completion order matters."""

    def fn(b: CommBackend) -> list[dict[FactorKey, torch.Tensor]]:
        order = KEYS if b.rank == 0 else [("A", "fc2"), ("A", "fc1"), ("A", "fc3"), ("G", "fc3"), ("G", "fc1"), ("G", "fc2")]
        return _controller_steps(b, FUSED, order=order)

    _check_averages(run_ranks(3, fn), 3)


@pytest.mark.parametrize("plans", [None, FUSED], ids=["layerwise", "fused"])
def test_controller_groups_completed_in_another_order_on_one_rank_are_a_mismatch(plans):
    """The controller relies on every rank computing the factors in the same order (one model, one schedule);
    a rank that completes the groups in another order issues its all-reduces in another order."""

    def fn(b: CommBackend) -> None:
        order = KEYS if b.rank == 0 else FORWARD[::-1] + BACKWARD
        _controller_steps(b, plans, steps=1, order=order)

    with pytest.raises(RankError) as info:
        run_ranks(2, fn, timeout=10)
    assert isinstance(info.value.__cause__, CollectiveMismatchError)
    assert "spdkfac.factor.A." in str(info.value)


def test_controller_discard_waits_for_launched_allreduces_and_the_next_iteration_is_clean():
    group = InProcessGroup(3)

    def fn(b: CommBackend) -> dict[FactorKey, torch.Tensor]:
        ctrl = TensorFusionController(b)
        for kind, groups in FUSED.items():
            ctrl.set_plan(kind, groups)
        ctrl.begin_iteration()
        for key in FORWARD + BACKWARD[:2]:  # A groups launched; G: one group launched, the other half filled
            ctrl.submit(key, _batch_factor(key, b.rank, 0))
        ctrl.discard()
        assert ctrl.pending == 0
        ctrl.begin_iteration()  # nothing left in flight or half filled
        for key in KEYS:
            ctrl.submit(key, _batch_factor(key, b.rank, 1))
        return ctrl.wait_all()

    results = group.run(fn)
    assert [name for _, name in group.history[:3]] == [
        "spdkfac.factor.A.fc1.2",
        "spdkfac.factor.A.fc3.1",
        "spdkfac.factor.G.fc3.1",
    ]  # waited for on every rank
    for key in KEYS:
        exact, _ = _expected(key, 3, 1)
        for res in results:
            assert torch.equal(res[key], exact)


def test_controller_factor_missing_on_every_rank_raises_and_one_rank_missing_it_surfaces_with_the_rank():
    def all_skip(b: CommBackend) -> str:
        ctrl = TensorFusionController(b)
        ctrl.set_plan("A", FUSED["A"])
        ctrl.begin_iteration()
        ctrl.submit(("A", "fc1"), _batch_factor(("A", "fc1"), b.rank, 0))
        with pytest.raises(RuntimeError, match="never computed") as info:
            ctrl.wait_all()
        return str(info.value)

    assert all("('A', 'fc2')" in msg for msg in run_ranks(2, all_skip))

    def one_skips(b: CommBackend) -> None:
        ctrl = TensorFusionController(b)
        ctrl.set_plan("A", FUSED["A"])
        ctrl.begin_iteration()
        for key in FORWARD if b.rank != 1 else FORWARD[:1]:
            ctrl.submit(key, _batch_factor(key, b.rank, 0))
        ctrl.wait_all()

    with pytest.raises(RankError, match="rank 1 raised RuntimeError: these factors were never computed"):
        run_ranks(3, one_skips, timeout=10)


# -- decomposition stage -------------------------------------------------------------------
FACTOR_DIMS: list[tuple[Hashable, int]] = [
    (("A", "l1"), 4),
    (("G", "l1"), 20),
    (("A", "l2"), 24),
    (("G", "l2"), 9),
    (("A", "l3"), 30),
    (("G", "l3"), 16),
    (("A", "l4"), 40),
    (("G", "l4"), 6),
]
DAMPING = 0.03


def _t_comp(dim: int) -> float:
    return dim**3 * 1e-9


def _t_comm(dim: int) -> float:
    return dim**2 * 1e-8 + 1e-6  # small factors are cheaper to invert than to broadcast


def _plan(strategy: str, size: int = 3) -> PlacementPlan:
    return place(strategy, FACTOR_DIMS, size, _t_comp, _t_comm)


def _factors(form: str, unowned_nan: tuple[PlacementPlan, int] | None = None) -> dict[Hashable, torch.Tensor]:
    """The averaged factors (full or packed); with ``unowned_nan`` the ones ``rank`` neither owns nor inverts are NaN."""
    out = {}
    for i, (key, dim) in enumerate(FACTOR_DIMS):
        full = _spd(dim, 5000 + i)
        if unowned_nan is not None and unowned_nan[0].owner(key) not in (ALL, unowned_nan[1]):
            full = torch.full_like(full, float("nan"))
        out[key] = full if form == "full" else pack_upper(full)
    return out


def test_the_placements_used_here_mix_owned_and_local_factors():
    lbp, seq, local = _plan("lbp"), _plan("seq"), _plan("local")
    assert {a.owner for a in lbp.assignments} == {ALL, 0, 1, 2}
    assert {a.owner for a in seq.assignments} == {0, 1, 2}
    assert {a.owner for a in local.assignments} == {ALL}


@pytest.mark.parametrize("form", ["full", "packed"])
@pytest.mark.parametrize("strategy", ["lbp", "seq", "local"])
def test_compute_inverses_gives_every_rank_every_inverse(strategy, form):
    plan = _plan(strategy)
    group = InProcessGroup(3)
    calls: list[list[Hashable]] = [[] for _ in range(3)]

    def fn(b: CommBackend) -> dict[Hashable, torch.Tensor]:
        def invert(key: Hashable, matrix: torch.Tensor) -> torch.Tensor:
            calls[b.rank].append(key)
            return invert_spd(matrix, DAMPING)

        return compute_inverses(plan, _factors(form, (plan, b.rank)), DAMPING, b, invert=invert)

    results = group.run(fn)
    for i, (key, dim) in enumerate(FACTOR_DIMS):
        reference = invert_spd(_spd(dim, 5000 + i), DAMPING)
        for res in results:
            assert res[key].shape == (dim, dim)
            assert torch.equal(res[key], results[0][key]), key  # bitwise identical on every rank
        assert torch.allclose(results[0][key], reference, rtol=1e-10, atol=1e-10), key
        damped = _spd(dim, 5000 + i) + DAMPING * torch.eye(dim, dtype=DTYPE)
        assert torch.allclose(results[0][key] @ damped, torch.eye(dim, dtype=DTYPE), atol=1e-8), key
    # Each owned factor is inverted once, by its owner; a local one by every rank.
    for r in range(3):
        assert sorted(map(str, calls[r])) == sorted(str(a.key) for a in plan.assignments if a.owner in (ALL, r))
    broadcasts = [(op, name) for op, name in group.history if op == "broadcast"]
    assert broadcasts == [("broadcast", "spdkfac.inverse." + ".".join(a.key)) for a in plan.broadcast_order()]
    assert (len(broadcasts) == 0) == (strategy == "local")


@pytest.mark.parametrize("form", ["full", "packed"])
@pytest.mark.parametrize("strategy", ["lbp", "seq", "local"])
def test_compute_eigen_gives_every_rank_the_same_decomposition(strategy, form):
    plan = _plan(strategy)
    results = run_ranks(3, lambda b: compute_eigen(plan, _factors(form, (plan, b.rank)), b))
    for i, (key, dim) in enumerate(FACTOR_DIMS):
        full = _spd(dim, 5000 + i)
        reference = unpack_eigen(eigen_payload(full), dim)
        first = results[0][key]
        for res in results[1:]:
            assert torch.equal(res[key].Q, first.Q), key
            assert torch.equal(res[key].d, first.d), key
        assert first.Q.shape == (dim, dim)
        assert first.d.shape == (dim,)
        assert torch.allclose(first.d, reference.d, rtol=1e-10, atol=1e-10), key
        assert torch.allclose(first.Q, reference.Q, rtol=1e-10, atol=1e-10), key
        assert torch.allclose(first.Q @ torch.diag(first.d) @ first.Q.T, full, atol=1e-10), key


def test_ranks_with_different_placements_are_a_mismatch():
    plans = [_plan("seq"), _plan("seq"), place("seq", FACTOR_DIMS[1:] + FACTOR_DIMS[:1], 3, _t_comp, _t_comm)]

    def fn(b: CommBackend) -> None:
        compute_inverses(plans[b.rank], _factors("full"), DAMPING, b)

    with pytest.raises(RankError) as info:
        run_ranks(3, fn, timeout=10)
    assert isinstance(info.value.__cause__, CollectiveMismatchError)
    assert "spdkfac.inverse." in str(info.value)


def test_a_failing_inversion_on_its_owner_surfaces_with_the_rank():
    plan = _plan("seq")
    bad_key, bad_owner = plan.assignments[2].key, plan.assignments[2].owner

    def fn(b: CommBackend) -> dict[Hashable, torch.Tensor]:
        factors = _factors("full")
        if b.rank == bad_owner:
            factors[bad_key] = -torch.eye(dict(FACTOR_DIMS)[bad_key], dtype=DTYPE)  # not positive definite
        return compute_inverses(plan, factors, DAMPING, b)

    with pytest.raises(RankError, match=f"rank {bad_owner} raised") as info:
        run_ranks(3, fn, timeout=10)
    assert isinstance(info.value.__cause__, torch.linalg.LinAlgError)


def test_full_and_packed_inputs_round_trip():
    """The helper itself: a packed factor unpacks to the full one (so both parametrisations test the same values)."""
    for i, (_, dim) in enumerate(FACTOR_DIMS):
        full = _spd(dim, 5000 + i)
        assert torch.equal(unpack_upper(pack_upper(full), dim), full)
