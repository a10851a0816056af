"""eigen_refresh='warm': the warm-started eigenbasis against torch.linalg.eigh on drifting factors, the fall-backs, checkpoints."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from nets import batch, small_net, train

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.eigenbasis import eigen_precondition
from spdkfac.kfac.factor_shape import FactorShape
from spdkfac.kfac.methods import EigenMethod, get_method
from spdkfac.kfac.methods.warm import WARM_TOLERANCE, RefreshStatistics, WarmRefresh, descending_eigh
from spdkfac.perfmodels import PerfModel

DAMPING = 1e-3
#: The warm update against the exact one, relative (2-norm), on a random walk where every batch factor is full rank.
UPDATE_TOLERANCE = 0.1


def _walk(dim: int, steps: int, seed: int = 0, rows: int = 96) -> list[torch.Tensor]:
    """Running averages ``F <- 0.95 F + 0.05 X^T X / rows`` from the identity, X correlated Gaussian rows."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=gen, dtype=torch.float64) / dim**0.5 + torch.diag(torch.logspace(0, -2, dim, dtype=torch.float64))
    factor = torch.eye(dim, dtype=torch.float64)
    out = []
    for _ in range(steps):
        x = torch.randn(rows, dim, generator=gen, dtype=torch.float64) @ mix
        factor = 0.95 * factor + 0.05 * x.T @ x / rows
        out.append(factor.clone())
    return out


def _exact(factor: torch.Tensor) -> object:
    return get_method("eigen").owned(FactorShape(factor.shape[-1]), factor, DAMPING)[0]


@pytest.mark.slow
def test_warm_refresh_follows_a_slowly_drifting_factor(float64):
    """Every refresh after the first is warm (age counts up), and the preconditioned update stays within tolerance of eigh's."""
    method = EigenMethod("warm", full_every=1000)
    g_fixed = _exact(torch.diag(torch.linspace(1.0, 2.0, 6, dtype=torch.float64)))  # G fixed: the update tests A's basis
    shape = FactorShape(24)
    previous = None
    gen = torch.Generator().manual_seed(3)
    worst = 0.0
    for t, factor in enumerate(_walk(24, 40)):
        previous, payload = method.owned(shape, factor, DAMPING, previous)
        assert payload.numel() == 24 * 24 + 24 + 2  # Q, d, age, residual
        assert int(previous.age) == t  # never a fall-back eigh on this walk
        if t < 5:
            continue  # the first steps leave the identity fast
        grad = torch.randn(6, 24, generator=gen, dtype=torch.float64)
        exact = eigen_precondition(grad, _exact(factor), g_fixed, DAMPING)
        warm = eigen_precondition(grad, previous, g_fixed, DAMPING)
        worst = max(worst, float((warm - exact).norm() / exact.norm()))
        torch.testing.assert_close(previous.Q.T @ previous.Q, torch.eye(24, dtype=torch.float64), atol=1e-12, rtol=0)
        assert torch.all(previous.d[:-1] >= previous.d[1:])  # descending
    assert 0.0 < worst < UPDATE_TOLERANCE, worst


def test_a_jump_of_the_factor_triggers_a_full_eigh(float64):
    """A jump spread over every direction: the kept columns (beyond the leading 64 the block step refines) no
    longer diagonalize the factor, and a full ``eigh`` replaces the refresh."""
    method = EigenMethod("warm", full_every=1000)
    dim = 160
    shape = FactorShape(dim)
    walk = _walk(dim, 12, rows=400)
    previous = None
    for factor in walk:
        previous, _ = method.owned(shape, factor, DAMPING, previous)
    assert int(previous.age) == 11
    x = torch.randn(400, dim, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    jumped = walk[-1] + 5.0 * x.T @ x / 400
    kept, _ = method.owned(shape, jumped, DAMPING, previous)
    assert int(kept.age) == 0  # the residual check chose a full decomposition
    assert float(kept.drift) > WARM_TOLERANCE  # the residual that decided it travels with the basis
    torch.testing.assert_close(kept.Q @ torch.diag(kept.d) @ kept.Q.T, jumped, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", ["ritz", "block"])
def test_rayleigh_ritz_follows_a_low_rank_factor_where_one_subspace_step_cannot(float64, kind):
    """A rank-deficient factor (rank 48, as a wide layer's factor early in training at a small batch) jumps by a
    new low-rank batch: the previous basis is far off (residual > 0.3), one subspace step alone stays off, and the
    steps with Rayleigh–Ritz on the leading 64 columns recover eigh's eigenpairs on the factor's range (the rest
    of the basis spans its null space, with eigenvalue 0), so they stay warm."""
    gen = torch.Generator().manual_seed(4)
    dim = 256
    x = torch.randn(40, dim, generator=gen, dtype=torch.float64)
    before = x.T @ x / 40
    new = torch.randn(8, dim, generator=gen, dtype=torch.float64)
    factor = 0.95 * before + 0.05 * 4.0 * new.T @ new / 8
    basis = descending_eigh(before)[1]
    plain = WarmRefresh(kind="subspace").step(factor, basis)
    assert plain.drift > 0.3
    assert plain.refreshed is None
    d_plain, _q_plain = WarmRefresh(tolerance=float("inf"), kind="subspace").refine(factor, basis)
    step = WarmRefresh(kind=kind).step(factor, basis)
    assert step.refreshed is not None
    assert step.drift == plain.drift
    d, q = step.refreshed
    d_exact = descending_eigh(factor)[0]
    # 'block' refines the span of the shifted (F + μI) Q_k, which holds the range to within μ / λ (μ = 1.5e-8 λ_max)
    close = 1e-9 if kind == "ritz" else 1e-6
    torch.testing.assert_close(d[:48], d_exact[:48], rtol=close, atol=0)
    assert float((d_plain[:48] - d_exact[:48]).abs().max()) > 1e-3 * float(d_exact[0])  # one step alone is off
    torch.testing.assert_close(q @ torch.diag(d) @ q.T, factor, rtol=0, atol=close)
    torch.testing.assert_close(q.T @ q, torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.all(d[:-1] >= d[1:])


def _orthonormal_completion_reference(head: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """``P (PᵀP)^(-1/2)`` with ``P = (I - H Hᵀ) K``, the inverse square root from a full ``eigh`` of ``PᵀP``."""
    p = kept - head @ (head.T @ kept)
    w, v = torch.linalg.eigh(p.T @ p)
    return p @ (v @ torch.diag(w.rsqrt()) @ v.T)


@pytest.mark.parametrize("blocks", [1, 3])
def test_block_step_against_a_float64_reference(float64, blocks):
    """The default step on a drifted factor (a stack of blocks too), each part against its definition: the leading
    64 columns are the Ritz pairs of ``F`` on ``span(qr(F Q_old)_k)``; the other columns the previous ones made
    orthonormal to them (``P (PᵀP)^-½`` from a full ``eigh``), with their Rayleigh quotients in the old basis;
    an orthonormal basis, descending, and the residual the refreshed basis's own."""
    dim, k = 200, 64
    factors, bases = [], []
    for b in range(blocks):
        walk = _walk(dim, 20, seed=b, rows=300)
        factors.append(walk[-1])
        bases.append(descending_eigh(walk[-4])[1])  # three steps old
    factor, basis = torch.stack(factors), torch.stack(bases)
    step = WarmRefresh().step(factor if blocks > 1 else factor[0], basis if blocks > 1 else basis[0])
    assert step.refreshed is not None
    d, q = step.refreshed
    d, q = d.reshape(blocks, dim), q.reshape(blocks, dim, dim)
    worst = 0.0
    for b in range(blocks):
        f, old = factor[b], basis[b]
        shift = torch.finfo(torch.float64).eps ** 0.5 * float(old[:, 0] @ f @ old[:, 0])  # the step's: sqrt(eps) x λ_max
        head_span = torch.linalg.qr((f + shift * torch.eye(dim, dtype=torch.float64)) @ old[:, :k])[0]
        theta, v = torch.linalg.eigh(head_span.T @ f @ head_span)
        theta, v = theta.flip(-1), v.flip(-1)
        ritz = head_span @ v
        ritz = ritz * torch.where((ritz * old[:, :k]).sum(0) < 0, -1.0, 1.0)  # signed like the previous columns
        kept = _orthonormal_completion_reference(ritz, old[:, k:])
        reference_q = torch.cat([ritz, kept], 1)
        reference_d = torch.cat([theta, (kept * (f @ kept)).sum(0)])  # the kept columns' Rayleigh quotients
        order = torch.argsort(reference_d, descending=True, stable=True)
        reference_q, reference_d = reference_q[:, order], reference_d[order]
        torch.testing.assert_close(d[b], reference_d, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(q[b], reference_q, rtol=0, atol=1e-10)
        torch.testing.assert_close(q[b].T @ q[b], torch.eye(dim, dtype=torch.float64), rtol=0, atol=1e-12)
        assert torch.all(d[b][:-1] >= d[b][1:])
        worst = max(worst, float((f @ q[b] - q[b] * d[b]).norm() / d[b].norm()))
    assert step.drift > 0.01  # it drifted
    assert 0.0 < worst < step.drift
    # the residual the check compares is the refreshed basis's own (the largest over the blocks)
    assert step.refined == pytest.approx(worst, rel=1e-9)


def test_refresh_statistics_count_warm_scheduled_and_drift_refreshes_the_same_on_every_holder():
    stats = RefreshStatistics()
    stats.record("l/A", 8, 0, -1.0)  # first: full by schedule
    stats.record("l/A", 8, 1, 0.05)
    stats.record("l/A", 8, 0, 0.4)  # residual above the tolerance: full
    stats.record("l/G", 4, 0, -1.0)
    totals = stats.totals()
    assert (totals["warm"], totals["full_scheduled"], totals["full_drift"], totals["refreshes"]) == (1, 2, 1, 4)
    assert totals["warm_share"] == 0.25
    assert totals["fell_back"] == ["l/A"]
    assert stats.as_dict()["factors"]["l/A"] == {"dim": 8, "warm": 1, "full_scheduled": 1, "full_drift": 1, "drift": 0.4, "max_drift": 0.4}

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw = dict(lr=0.05, damping=0.01, compute_method="eigen", backend="single")
        x, y = batch(8)
        warm = SPDKFACOptimizer(small_net(), eigen_refresh="warm", eigen_full_every=3, **kw)
        exact = SPDKFACOptimizer(small_net(), **kw)
    train(warm.model, warm, x, y, 7)
    train(exact.model, exact, x, y, 2)
    report = warm.refresh_statistics()
    dense = [f"{layer.name}/{kind}" for layer in warm.layers for kind in "AG" if not layer.shape(kind).diagonal]
    assert sorted(report["factors"]) == sorted(dense)
    for name, counts in report["factors"].items():
        assert counts["warm"] + counts["full_scheduled"] + counts["full_drift"] == 7, name
        assert counts["full_scheduled"] >= 1 + counts["full_drift"] // 3, name  # the first, and the schedule
    assert report["totals"]["warm"] > 0
    assert exact.refresh_statistics()["totals"]["refreshes"] == 0  # the exact method: nothing to count


def test_a_full_eigh_every_full_every_refreshes_and_blocks_refresh_together(float64):
    method = EigenMethod("warm", full_every=3)
    shape = FactorShape(8, blocks=2)
    walks = [_walk(8, 7, seed=s) for s in (0, 1)]
    previous = None
    ages = []
    for t in range(7):
        stack = torch.stack([walks[0][t], walks[1][t]])
        previous, payload = method.owned(shape, stack, DAMPING, previous)
        assert payload.numel() == 2 * (64 + 8) + 2
        ages.append(int(previous.age))
        rebuilt = previous.Q @ torch.diag_embed(previous.d) @ previous.Q.transpose(-1, -2)
        torch.testing.assert_close(rebuilt, stack, rtol=0, atol=0.1)
    assert ages == [0, 1, 2, 0, 1, 2, 0]


def test_the_kept_value_is_what_receivers_rebuild_bitwise():
    method = EigenMethod("warm", full_every=4)
    shape = FactorShape(10)
    previous = None
    for factor in _walk(10, 3):
        previous, payload = method.owned(shape, factor.float(), DAMPING, previous)
        received = method.received(payload.clone(), shape)
        assert torch.equal(received.Q, previous.Q)
        assert torch.equal(received.d, previous.d)
        assert torch.equal(received.age, previous.age)


def test_options_are_validated():
    with pytest.raises(ValueError, match="eigen_refresh='warm' refreshes an eigenbasis"):
        SPDKFACOptimizer(small_net(), lr=0.1, eigen_refresh="warm", backend="single")
    with pytest.raises(ValueError, match="eigen_refresh must be one of"):
        SPDKFACOptimizer(small_net(), lr=0.1, compute_method="eigen", eigen_refresh="lukewarm", backend="single")
    with pytest.raises(ValueError, match="eigen_full_every must be a positive integer"):
        SPDKFACOptimizer(small_net(), lr=0.1, compute_method="eigen", eigen_refresh="warm", eigen_full_every=0, backend="single")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = SPDKFACOptimizer(small_net(), lr=0.1, compute_method="eigen", eigen_refresh="warm", eigen_full_every=5, backend="single")
    assert "eigen_refresh='warm'" in repr(opt)
    assert repr(opt.method) == "EigenMethod(refresh='warm', full_every=5, tolerance=0.15)"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eigen", "ekfac"])
def test_warm_checkpoint_resumes_bitwise(method):
    """The basis and its age are saved: a resumed run refreshes exactly as the uninterrupted one."""
    kw = dict(lr=0.05, momentum=0.9, damping=0.01, compute_method=method, eigen_refresh="warm", eigen_full_every=3, backend="single")
    x, y = batch(8)
    half = small_net()
    opt_half = SPDKFACOptimizer(half, **kw)
    train(half, opt_half, x, y, 4)
    buf = io.BytesIO()
    torch.save(opt_half.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    ages = {entry["A_eigen"].get("age") for entry in state["kfac"]["layers"].values()}
    assert ages <= {0, 1, 2}, ages  # every dense factor saved its age (None would be missing)
    resumed = SPDKFACOptimizer(half, **kw)
    opt_half.remove_hooks()
    resumed.load_state_dict(state)

    def more(opt, model, start, stop):
        for s in range(start, stop):
            xs = x + 0.1 * s
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(xs), y).backward()
            opt.step()

    more(resumed, half, 4, 8)
    # train() restarts its perturbation at 0: compare with the same inputs on the uninterrupted run
    full2 = small_net()
    opt_full2 = SPDKFACOptimizer(full2, **kw)
    train(full2, opt_full2, x, y, 4)
    more(opt_full2, full2, 4, 8)
    for k, v in full2.state_dict().items():
        assert torch.equal(half.state_dict()[k], v), k
    for a, b in zip(resumed.layers, opt_full2.layers):
        for kind in "AG":
            assert torch.equal(a.decomposition(kind).Q, b.decomposition(kind).Q)
            assert torch.equal(a.decomposition(kind).age, b.decomposition(kind).age)


def test_an_exact_checkpoint_resumed_warm_starts_with_a_full_eigh():
    kw = dict(lr=0.05, compute_method="eigen", damping=0.01, backend="single")
    x, y = batch(8)
    model = small_net()
    opt = SPDKFACOptimizer(model, **kw)
    train(model, opt, x, y, 2)
    state = opt.state_dict()
    opt.remove_hooks()
    warm = SPDKFACOptimizer(model, eigen_refresh="warm", eigen_full_every=4, **kw)
    warm.load_state_dict(state)
    assert all(int(layer.decomposition("A").age) == 4 for layer in warm.layers)  # due: the next refresh is an eigh
    train(model, warm, x, y, 1)
    assert all(int(layer.decomposition("A").age) == 0 for layer in warm.layers)


def test_the_warm_cost_enters_the_performance_model_and_old_files_load():
    perf = PerfModel.default()
    data = perf.to_dict()
    del data["eigen_warm"]  # a file from before the warm curve
    old = PerfModel.from_dict(data, "old")
    warm, exact = EigenMethod("warm", full_every=10), EigenMethod()
    with pytest.warns(UserWarning, match="no warm eigenbasis-refresh model"):
        estimated = warm.cost(old, FactorShape(1024))
    assert estimated < exact.cost(old, FactorShape(1024))
    data["eigen_warm"] = {"kind": "cubic", "coeffs": [1e-5, 0.0, 0.0, 1e-12], "floor": 1e-5}
    measured = PerfModel.from_dict(data, "new")
    assert measured.eigen_warm is not None
    t_warm, t_eig = measured.eigen_warm(1024), measured.eigen_curve()(1024)
    assert warm.cost(measured, FactorShape(1024)) == pytest.approx((9 * t_warm + t_eig) / 10)
    assert PerfModel.from_dict(measured.to_dict(), "round trip").eigen_warm(1024) == pytest.approx(t_warm)


def test_the_simulator_costs_the_warm_refresh_with_its_curve():
    """The stored ResNet-50 profile: the warm variant's decomposition stage is predicted cheaper than the exact one's."""
    import json
    from pathlib import Path

    from spdkfac.simulate import predict, profile_from_dict

    root = Path(__file__).resolve().parents[3]
    profile = profile_from_dict(json.loads((root / "benchmarks/results/profile_resnet50.json").read_text()))
    perf = PerfModel.load(root / "perfmodels/reference-cpu-gloo-2.json")
    exact = predict(profile, perf, 2, "spdkfac:compute_method=eigen")
    warm = predict(profile, perf, 2, "spdkfac:compute_method=eigen,eigen_refresh=warm")
    assert warm["InverseComp"] < 0.6 * exact["InverseComp"]
    assert warm["FF&BP"] == exact["FF&BP"]


def test_refine_returns_descending_columns_whether_or_not_the_qr_leaves_them_sorted(float64):
    """The sorted case skips the column gather; both cases give the basis and order of the reference fix-up."""
    factor = _walk(12, 30)[-1]
    exact_q = descending_eigh(factor)[1]
    swapped = exact_q[:, [1, 0, *range(2, 12)]]  # two columns out of order: the QR keeps them so
    for previous in (exact_q, swapped):
        d, q = WarmRefresh(tolerance=float("inf"), kind="subspace").refine(factor, previous)
        q_ref, r_ref = torch.linalg.qr(factor @ previous)
        sign = torch.where(r_ref.diagonal() < 0, -1.0, 1.0).to(q_ref.dtype)
        d_ref = r_ref.diagonal() * sign
        order = torch.argsort(d_ref, descending=True, stable=True)
        assert torch.equal(d, d_ref[order])
        assert torch.equal(q, (q_ref * sign)[:, order])
        assert torch.all(d[:-1] >= d[1:])


def test_cholesky_qr2_matches_householder_and_fails_on_a_singular_gram_matrix(float64):
    """benchmarks/warm_step.py's candidate: Householder's Q and |diag R| on a full-rank Y; None on a rank-deficient one."""
    from benchmarks.warm_step import cholqr2, warm_cholqr2

    gen = torch.Generator().manual_seed(5)
    y = torch.randn(20, 20, generator=gen, dtype=torch.float64)
    q, diag = cholqr2(y)
    q_h, r_h = torch.linalg.qr(y)
    sign = torch.where(r_h.diagonal() < 0, -1.0, 1.0).to(y.dtype)
    torch.testing.assert_close(q, q_h * sign, rtol=0, atol=1e-10)
    torch.testing.assert_close(diag, r_h.diagonal().abs(), rtol=1e-10, atol=0)
    x = torch.randn(5, 20, generator=gen, dtype=torch.float64)
    assert cholqr2((x.T @ x) @ torch.linalg.qr(y)[0]) is None  # rank 5 of 20: the Gram matrix is singular
    factor = _walk(12, 30)[-1]
    previous = descending_eigh(0.95 * factor + 0.05 * torch.diag(factor.diagonal()))[1]
    d_c, q_c = warm_cholqr2(factor, previous)
    d_h, q_h = WarmRefresh(tolerance=float("inf"), kind="subspace").refine(factor, previous)
    torch.testing.assert_close(d_c, d_h, rtol=1e-10, atol=0)
    torch.testing.assert_close(q_c, q_h, rtol=0, atol=1e-10)
