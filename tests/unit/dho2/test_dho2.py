"""DHO2: Hessian-vector products, the (distributed) Lanczos iteration, the hybrid step, ADMM, and the optimizer.

Float64 throughout. The references are independent: explicit Hessians
(``torch.autograd.functional.hessian``) and their ``torch.linalg.eigh``, and a
float64 re-implementation of Eqs. 2-4 / 13 and Algorithm 3 written from the
paper, with a textbook AdamW.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from nets import dho2_batch, dho2_net
from torch.func import functional_call

from spdkfac import make_optimizer
from spdkfac.comm import SingleProcessBackend, run_ranks
from spdkfac.comm.inprocess import InProcessGroup
from spdkfac.dho2 import (
    ADMMState,
    DHO2Optimizer,
    EigenBasis,
    HessianVectorProduct,
    RowSplit,
    default_lanczos_steps,
    distributed_lanczos,
    extreme_eigenpairs,
    hybrid_delta,
)
from spdkfac.dho2.config import DEFAULT_ADMM_RULE, DEFAULT_SIGMA
from spdkfac.dho2.lanczos import start_vector
from spdkfac.step.nonfinite import NonFiniteError

tiny_net, data = dho2_net, dho2_batch

pytestmark = pytest.mark.usefixtures("float64")


def loss_at(model: nn.Module, w: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy with the parameters taken from the flat vector ``w``."""
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    pieces = torch.split(w, [math.prod(s) for s in shapes])
    params = {n: piece.view(s) for n, piece, s in zip(names, pieces, shapes)}
    return nn.functional.cross_entropy(functional_call(model, params, (x,)), y)


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def hessian(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor | None = None) -> torch.Tensor:
    w = flat(model) if w is None else w
    return torch.autograd.functional.hessian(lambda v: loss_at(model, v, x, y), w)


# ----------------------------------------------------------------------------- HVP
def test_hvp_matches_the_explicit_hessian_and_finite_differences():
    model, (x, y) = tiny_net(), data()
    H = hessian(model, x, y)
    hvp = HessianVectorProduct(nn.functional.cross_entropy(model(x), y), list(model.parameters()), SingleProcessBackend())
    v = torch.randn(hvp.n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    assert torch.allclose(hvp(v), H @ v, rtol=0, atol=1e-12)
    # Central differences of the gradient along v.
    w, eps = flat(model), 1e-5

    def grad(u: torch.Tensor) -> torch.Tensor:
        u = u.clone().requires_grad_()
        return torch.autograd.grad(loss_at(model, u, x, y), u)[0]

    fd = (grad(w + eps * v) - grad(w - eps * v)) / (2 * eps)
    assert torch.allclose(hvp(v), fd, rtol=0, atol=1e-8)


def test_hvp_averages_over_workers_to_the_global_batch_hessian():
    x, y = data(24)
    H = hessian(tiny_net(), x, y)
    v = torch.randn(H.shape[0], generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    models = [tiny_net() for _ in range(3)]  # built here: the ranks' threads share torch's random generator

    def fn(backend):
        model = models[backend.rank]
        shard = slice(backend.rank * 8, (backend.rank + 1) * 8)
        return HessianVectorProduct(nn.functional.cross_entropy(model(x[shard]), y[shard]), list(model.parameters()), backend)(v)

    out = run_ranks(3, fn)
    assert torch.allclose(out[0], H @ v, atol=1e-12)
    assert all(torch.equal(o, out[0]) for o in out)


def test_hvp_rejects_a_loss_without_graph():
    model = tiny_net()
    with pytest.raises(ValueError, match="no autograd graph"):
        HessianVectorProduct(torch.tensor(1.0), list(model.parameters()), SingleProcessBackend())


# ------------------------------------------------------------------------- Lanczos
def _lanczos(backend, H: torch.Tensor, steps: int, k: int, l: int, seed: int = 0):  # noqa: E741
    n = H.shape[0]
    split = RowSplit(n, backend.size)

    def hvp(v: torch.Tensor) -> torch.Tensor:
        return H @ v

    result = distributed_lanczos(hvp, split, backend, steps, start_vector(n, seed, H.dtype, H.device))
    values, vectors = extreme_eigenpairs(result, split, backend, k, l)
    return result, values, vectors


def test_lanczos_extreme_eigenpairs_match_eigh_of_the_hessian():
    model, (x, y) = tiny_net(), data()
    H = hessian(model, x, y)
    exact, _Q = torch.linalg.eigh(H)
    _, values, vectors = _lanczos(SingleProcessBackend(), H, H.shape[0], k=3, l=2)
    expected = torch.cat([exact[:2], exact[-3:]])
    assert torch.allclose(values, expected, rtol=0, atol=1e-6)
    for j, (a, v) in enumerate(zip(values, vectors.T)):
        assert torch.allclose(H @ v, a * v, atol=1e-6), j  # eigenvectors, whatever their sign
    assert torch.allclose(vectors.T @ vectors, torch.eye(5), atol=1e-8)


def test_lanczos_with_the_default_steps_finds_the_largest_eigenvalue():
    # A well-separated spectrum: FOSI's m = max(4(k+l), 2 ln n) steps suffice for the top of it.
    n = 200
    Q, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    spectrum = torch.cat([torch.tensor([50.0, 30.0, 20.0]), torch.linspace(-1, 1, n - 3, dtype=torch.float64)])
    H = Q @ torch.diag(spectrum) @ Q.T
    m = default_lanczos_steps(n, 3, 0)
    assert m == max(12, math.ceil(2 * math.log(n)))
    _, values, _ = _lanczos(SingleProcessBackend(), H, m, k=3, l=0)
    assert torch.allclose(values, torch.tensor([20.0, 30.0, 50.0]), rtol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 3])
def test_distributed_lanczos_equals_the_single_process_one_and_is_bitwise_identical_on_every_rank(size):
    model, (x, y) = tiny_net(), data()
    H = hessian(model, x, y)
    n, m = H.shape[0], 20
    ref, ref_values, ref_vectors = _lanczos(SingleProcessBackend(), H, m, k=3, l=1)
    outs = run_ranks(size, lambda b: _lanczos(b, H, m, k=3, l=1))
    for rank, (result, values, vectors) in enumerate(outs):
        assert torch.allclose(result.tridiagonal, ref.tridiagonal, atol=1e-10)
        assert torch.allclose(values, ref_values, atol=1e-10)
        assert torch.allclose(vectors, ref_vectors, atol=1e-9)
        assert torch.equal(values, outs[0][1])
        assert torch.equal(vectors, outs[0][2])
        assert torch.equal(result.tridiagonal, outs[0][0].tridiagonal)
        # Each rank holds only its rows of D: n·m/P values (rounded up).
        assert result.rows.shape == (RowSplit(n, size).counts[rank], m)
        assert result.basis_bytes <= math.ceil(n / size) * m * 8


def test_distributed_lanczos_collectives_follow_algorithm_2():
    H = hessian(tiny_net(), *data())
    group = InProcessGroup(2)
    group.run(lambda b: _lanczos(b, H, 4, k=1, l=0))
    ops = [(op, name.split(".")[2] + "." + name.split(".")[3]) for op, name in group.history]
    # Per step: the all-gather of v_i (one broadcast per block in this engine), the projection and the norm
    # all-reduces (none after the last step); then the decomposition broadcast and the vectors' gather. (The
    # product H v here is local; HessianVectorProduct adds its all-reduce, tested above.)
    step = [("broadcast", "lanczos.v"), ("broadcast", "lanczos.v"), ("allreduce", "lanczos.proj"), ("allreduce", "lanczos.norm")]
    assert ops[:12] == step * 3
    assert ops[12:] == [
        ("broadcast", "lanczos.v"),
        ("broadcast", "lanczos.v"),
        ("broadcast", "eigen.decomposition"),
        ("broadcast", "eigen.vectors"),
        ("broadcast", "eigen.vectors"),
    ]


def test_row_split_is_even_and_covers_every_row():
    split = RowSplit(10, 3)
    assert split.counts == [4, 3, 3]
    assert split.offsets == [0, 4, 7]
    assert [split.rows(r) for r in range(3)] == [slice(0, 4), slice(4, 7), slice(7, 10)]


def test_allgather_fills_every_segment_in_rank_order():
    def fn(backend):
        counts = [3, 0, 2]
        t = torch.zeros(5)
        start = sum(counts[: backend.rank])
        t[start : start + counts[backend.rank]] = backend.rank + 1.0
        backend.allgather_async(t, counts, "g").wait()
        return t

    assert all(t.tolist() == [1, 1, 1, 3, 3] for t in run_ranks(3, fn))
    with pytest.raises(ValueError, match="counts"):
        SingleProcessBackend().allgather_async(torch.zeros(3), [2], "g")


# ---------------------------------------------------------------- the hybrid step
def test_eigenvalue_rule_drops_tiny_pairs_and_uses_absolute_values():
    V = torch.eye(4)[:, :3]
    basis = EigenBasis(torch.tensor([-2.0, 1e-9, 4.0]), V).keep_curvature(1e-6)
    assert basis.values.tolist() == [-2.0, 4.0]
    assert torch.equal(basis.vectors, V[:, [0, 2]])
    g = torch.tensor([1.0, 1.0, 1.0, 1.0])
    delta = hybrid_delta(g, basis, alpha=0.5, shift=0.0, base=lambda u: -0.1 * u)
    # Newton along e0 with |−2| (downhill, not up), along e2 with 4; the dropped e1 and e3 get the base step.
    assert torch.allclose(delta, torch.tensor([-0.25, -0.1, -0.125, -0.1]))
    shifted = hybrid_delta(g, basis, alpha=0.5, shift=1.0, base=lambda u: -0.1 * u)
    assert torch.allclose(shifted[[0, 2]], torch.tensor([-0.5 / 3, -0.1]))


def test_base_output_is_projected_off_the_newton_subspace():
    V = torch.tensor([[1.0], [0.0], [0.0]])
    basis = EigenBasis(torch.tensor([2.0]), V)
    # A base rule that rotates its input back into the subspace: Eq. 4 removes that part.
    delta = hybrid_delta(torch.tensor([1.0, 2.0, 3.0]), basis, 1.0, 0.0, base=lambda u: torch.tensor([5.0, 0.0, 0.0]) - u)
    assert torch.allclose(delta, torch.tensor([-0.5, -2.0, -3.0]))


@pytest.mark.parametrize("rule", ["code", "lagrangian", "proximal"])
def test_admm_state_follows_equation_11_in_each_form(rule):
    sigma = 0.5
    w0 = torch.tensor([1.0, 2.0])
    admm = ADMMState(w0, sigma=sigma, rule=rule)
    g = torch.ones(2)
    wa = torch.tensor([1.5, 1.0])  # end of the first inner loop (started at w¹ = w0)
    expected = g + sigma * (wa - w0) if rule != "code" else g  # π⁰ = 0; σ(w_a - w¹) unless 'code'
    assert torch.allclose(admm.gradient(g, wa), expected)
    start = admm.end_period(wa)
    pi = sigma * (wa - w0)  # line 16
    w2 = wa + pi / sigma  # line 5
    assert torch.allclose(admm.multiplier, pi)
    assert torch.allclose(admm.anchor, w2)
    assert torch.allclose(start, wa if rule == "proximal" else w2)  # line 6, or the parameters left at w_a
    assert torch.allclose(admm.centre(), wa)
    wa2 = torch.tensor([0.0, 0.0])
    expected = g + pi + (sigma * (wa2 - w2) if rule != "code" else 0)
    assert torch.allclose(admm.gradient(g, wa2), expected)
    if rule != "code":  # π + σ(w_a - w) = σ(w_a - w_a^k): the pull towards the last outer end
        assert torch.allclose(admm.gradient(g, wa2), g + sigma * (wa2 - wa))
    start2 = admm.end_period(wa2)
    pi2 = pi + sigma * (wa2 - w2)
    assert torch.allclose(admm.multiplier, pi2)
    assert torch.allclose(admm.multiplier / sigma, wa2 - wa)  # π/σ: the displacement between the last two outer ends
    assert torch.allclose(start2, wa2 if rule == "proximal" else wa2 + pi2 / sigma)


# ------------------------------------------------------------ against a reference
def reference_dho2(
    model,
    x,
    y,
    steps,
    *,
    k,
    l,  # noqa: E741 the paper's name
    T,
    alpha,
    lr,
    wd,
    betas,
    eps,
    admm,
    sigma,
    period,
    floor,
    rule="code",
    base="adamw",
    momentum=0.9,
):
    """Eqs. 2-4 (FOSI) and Eqs. 10, 11, 13 / Algorithm 3 (ADMM) in float64, with exact eigenpairs of the explicit Hessian.

    ``rule``: 'code' (gradient g + π), 'lagrangian' (g + π + σ(w_a - w), Eq. 10's gradient in w_a), 'proximal'
    (the same; the parameters are not moved to w at the outer step)."""
    w = flat(model).clone()
    m1, m2, t, buf = torch.zeros_like(w), torch.zeros_like(w), 0, None
    pi, anchor = torch.zeros_like(w), w.clone()
    V = a = None
    for s in range(steps):
        xs = x + 0.1 * s
        u = w.clone().requires_grad_()
        g = torch.autograd.grad(loss_at(model, u, xs, y), u)[0]
        if s % T == 0:
            evals, evecs = torch.linalg.eigh(hessian(model, xs, y, w))
            idx = sorted(set(range(l)) | set(range(len(evals) - k, len(evals))))
            keep = [i for i in idx if abs(float(evals[i])) > floor]
            a, V = evals[keep], evecs[:, keep]
        gt = g + pi if admm else g
        if admm and rule != "code":
            gt = gt + sigma * (w - anchor)
        shift = sigma if admm else 0.0
        g1 = V @ (V.T @ gt)
        d1 = -alpha * V @ torch.diag(1 / (a.abs() + shift)) @ V.T @ gt
        r = gt - g1
        if base == "adamw":
            t += 1
            m1 = betas[0] * m1 + (1 - betas[0]) * r
            m2 = betas[1] * m2 + (1 - betas[1]) * r * r
            mhat, vhat = m1 / (1 - betas[0] ** t), m2 / (1 - betas[1] ** t)
            o = -lr * mhat / (vhat.sqrt() + eps) - lr * wd * w
        else:
            d = r + wd * w
            buf = d.clone() if buf is None else momentum * buf + d
            o = -lr * buf
        d2 = o - V @ (V.T @ o)
        w = w + d1 + d2
        if admm and (s + 1) % period == 0:
            pi = pi + sigma * (w - anchor)
            anchor = w + pi / sigma
            if rule != "proximal":
                w = anchor.clone()
    return w


def run_dho2(opt: DHO2Optimizer, model: nn.Module, x, y, steps: int, start: int = 0) -> None:
    for s in range(start, start + steps):
        xs = x + 0.1 * s
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs), y).backward()
        opt.step(lambda xs=xs: nn.functional.cross_entropy(model(xs), y))


OPTIONS = dict(k=2, l=1, refresh_every=3, alpha=0.3, admm_period=4, eigenvalue_floor=1e-6)
RULES = ["code", "lagrangian", "proximal"]


def admm_options(rule: str | None) -> dict[str, object]:
    """``admm=False`` (DHO2-WA) for None, else the ADMM outer iteration in form ``rule`` with σ = 0.05."""
    return dict(admm=False) if rule is None else dict(admm=True, admm_rule=rule, sigma=0.05)


@pytest.mark.parametrize(
    "variant",
    [
        *(admm_options(rule) for rule in RULES),
        admm_options(None),
        dict(**admm_options("lagrangian"), base="sgd", momentum=0.8, weight_decay=1e-3, lr=0.05),
    ],
)
def test_optimizer_matches_the_reference_over_refreshes_and_admm_periods(variant):
    x, y = data()
    model = tiny_net()
    n = flat(model).numel()
    options = {**OPTIONS, "lr": 1e-2, "weight_decay": 0.05, **variant}
    opt = DHO2Optimizer(model, lanczos_steps=n, backend="single", **options)  # full Lanczos: the exact extreme eigenpairs
    run_dho2(opt, model, x, y, 9)
    ref = reference_dho2(
        tiny_net(),
        x,
        y,
        9,
        k=2,
        l=1,
        T=3,
        alpha=0.3,
        lr=options["lr"],
        wd=options["weight_decay"],
        betas=(0.9, 0.999),
        eps=1e-8,
        admm=options["admm"],
        sigma=0.05,
        period=4,
        floor=1e-6,
        rule=options.get("admm_rule", "code"),
        base=options.get("base", "adamw"),
        momentum=options.get("momentum", 0.9),
    )
    assert opt.refreshes == 3
    assert torch.allclose(flat(model), ref, rtol=0, atol=1e-9), (flat(model) - ref).abs().max()


# ------------------------------------------------------------- N workers vs one
@pytest.mark.parametrize(("size", "rule"), [(2, "code"), (3, "code"), (2, "lagrangian"), (3, "proximal")])
def test_n_workers_equal_one_worker_on_the_global_batch_with_bitwise_replicas(size, rule):
    x, y = data(24)
    model = tiny_net()
    opt = DHO2Optimizer(model, lr=1e-2, backend="single", **OPTIONS, **admm_options(rule))
    run_dho2(opt, model, x, y, 7)

    models = [tiny_net() for _ in range(size)]  # built here: the ranks' threads share torch's random generator

    def fn(backend):
        local = models[backend.rank]
        o = DHO2Optimizer(local, lr=1e-2, backend=backend, **OPTIONS, **admm_options(rule))
        b = 24 // backend.size
        shard = slice(backend.rank * b, (backend.rank + 1) * b)
        run_dho2(o, local, x[shard], y[shard], 7)
        return flat(local), o.state_dict()["dho2"]

    outs = run_ranks(size, fn)
    assert torch.allclose(outs[0][0], flat(model), rtol=0, atol=1e-9)
    for w, state in outs[1:]:
        assert torch.equal(w, outs[0][0])
        assert torch.equal(state["basis"]["vectors"], outs[0][1]["basis"]["vectors"])
        assert torch.equal(state["admm"]["multiplier"], outs[0][1]["admm"]["multiplier"])
        assert torch.equal(state["base_state"]["exp_avg_sq"], outs[0][1]["base_state"]["exp_avg_sq"])


def test_memory_of_the_lanczos_basis_shrinks_with_the_workers():
    def usage(size: int) -> list[dict[str, int]]:
        x, y = data(24)
        models = [tiny_net() for _ in range(size)]

        def fn(backend):
            local = models[backend.rank]
            o = DHO2Optimizer(local, backend=backend, **OPTIONS)
            b = 24 // backend.size
            run_dho2(o, local, x[backend.rank * b : (backend.rank + 1) * b], y[backend.rank * b : (backend.rank + 1) * b], 1)
            return o.memory_usage()

        return run_ranks(size, fn)

    one, two = usage(1)[0], usage(2)
    n, m = 43, default_lanczos_steps(43, 2, 1)
    assert one["lanczos_basis"] == n * m * 8
    assert [u["lanczos_basis"] for u in two] == [22 * m * 8, 21 * m * 8]
    assert one["eigenvectors"] == two[0]["eigenvectors"] == n * 3 * 8


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("rule", [*RULES, None])
def test_state_dict_resumes_bit_for_bit_across_an_outer_iteration(rule):
    x, y = data()
    model = tiny_net()
    opt = DHO2Optimizer(model, lr=1e-2, backend="single", **OPTIONS, **admm_options(rule))
    run_dho2(opt, model, x, y, 10)  # outer steps after steps 4 and 8

    first = tiny_net()
    o1 = DHO2Optimizer(first, lr=1e-2, backend="single", **OPTIONS, **admm_options(rule))
    run_dho2(o1, first, x, y, 5)  # saved inside the second outer iteration
    saved_model, saved_opt = first.state_dict(), o1.state_dict()
    del first, o1
    resumed = tiny_net(seed=7)  # other weights: everything comes from the checkpoint
    resumed.load_state_dict(saved_model)
    o2 = DHO2Optimizer(resumed, lr=1e-2, backend="single", **OPTIONS, **admm_options(rule))
    o2.load_state_dict(saved_opt)
    run_dho2(o2, resumed, x, y, 5, start=5)
    assert torch.equal(flat(resumed), flat(model))


def test_load_state_dict_refuses_another_model_or_setting():
    opt = DHO2Optimizer(tiny_net(), backend="single", **OPTIONS)
    other = DHO2Optimizer(nn.Linear(3, 2), backend="single", k=1, refresh_every=3)
    with pytest.raises(ValueError, match="parameters"):
        opt.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="admm"):
        opt.load_state_dict(DHO2Optimizer(tiny_net(), backend="single", admm=False, **OPTIONS).state_dict())
    code = DHO2Optimizer(tiny_net(), backend="single", **OPTIONS, **admm_options("code")).state_dict()
    lagrangian = DHO2Optimizer(tiny_net(), backend="single", **OPTIONS, **admm_options("lagrangian"))
    with pytest.raises(ValueError, match=r"admm_rule='code', sigma=0\.05; this optimizer has admm_rule='lagrangian'"):
        lagrangian.load_state_dict(code)
    with pytest.raises(ValueError, match=r"sigma=0\.05; this optimizer has admm_rule='code', sigma=0\.1"):
        DHO2Optimizer(tiny_net(), backend="single", **OPTIONS, admm_rule="code", sigma=0.1).load_state_dict(
            DHO2Optimizer(tiny_net(), backend="single", **OPTIONS, **admm_options("code")).state_dict()
        )
    with pytest.raises(ValueError, match="not a DHO2"):
        opt.load_state_dict(torch.optim.SGD(tiny_net().parameters(), lr=0.1).state_dict())


# ---------------------------------------------------------------- non-finite
def test_nonfinite_gradient_is_skipped_on_every_worker_then_refused():
    x, y = data(24)
    models = [tiny_net() for _ in range(2)]

    def fn(backend):
        local = models[backend.rank]
        o = DHO2Optimizer(local, backend=backend, skip_nonfinite=1, **OPTIONS)
        xs = x[backend.rank * 12 : (backend.rank + 1) * 12].clone()
        run_dho2(o, local, xs, y[backend.rank * 12 : (backend.rank + 1) * 12], 1)
        before = flat(local)
        if backend.rank == 1:
            xs[0, 0] = float("nan")  # one worker's batch: the averaged gradient is NaN everywhere
        run_dho2(o, local, xs - 0.1, y[backend.rank * 12 : (backend.rank + 1) * 12], 1, start=1)  # warns (caught below)
        unchanged = torch.equal(flat(local), before) and o.steps == 1
        with pytest.raises(NonFiniteError, match="gradient"):
            run_dho2(o, local, xs - 0.1, y[backend.rank * 12 : (backend.rank + 1) * 12], 1, start=1)
        return unchanged and torch.equal(flat(local), before)

    with pytest.warns(UserWarning, match="step skipped"):  # warnings filters are process-wide: caught outside the threads
        assert run_ranks(2, fn) == [True, True]


def test_nonfinite_hessian_products_skip_the_refresh_and_keep_the_parameters():
    x, y = data()
    model = tiny_net()
    opt = DHO2Optimizer(model, backend="single", skip_nonfinite=2, **OPTIONS)
    before = flat(model)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    with pytest.warns(UserWarning, match="Hessian"):
        opt.step(lambda: nn.functional.cross_entropy(model(x), y) * float("nan"))
    assert torch.equal(flat(model), before)
    assert opt.steps == 0
    assert opt.basis is None


# ---------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(lr=-1.0), "lr"),
        (dict(k=0, l=0), "k \\+ l"),
        (dict(k=-1), "k must"),
        (dict(refresh_every=0), "refresh_every"),
        (dict(sigma=0.0), "sigma"),
        (dict(sigma=float("inf")), "sigma"),
        (dict(admm_rule="augmented"), "admm_rule must be one of"),
        (dict(admm=False, sigma=0.1), "admm_rule and sigma apply to the ADMM outer iteration only"),
        (dict(admm=False, admm_rule="code"), "pass admm=True"),
        (dict(admm_period=0), "admm_period"),
        (dict(base="lamb"), "base"),
        (dict(momentum=0.9), "momentum applies to base='sgd'"),
        (dict(base="sgd", momentum=1.5), "momentum must"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(lanczos_steps=1, k=2), "lanczos_steps"),
        (dict(k=50), "only 43 parameters"),
        (dict(grad_scaler=object()), "GradScaler"),
        (dict(alpha=float("nan")), "alpha"),
    ],
)
def test_bad_options_are_refused_with_the_option_named(options, match):
    with pytest.raises(ValueError, match=match):
        DHO2Optimizer(tiny_net(), backend="single", **options)


def test_step_needs_the_closure_on_refresh_steps_and_refuses_one_that_calls_backward():
    x, y = data()
    model = tiny_net()
    opt = DHO2Optimizer(model, backend="single", **OPTIONS)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert opt.refresh_due
    with pytest.raises(ValueError, match="closure"):
        opt.step()

    def backward_closure():
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    with pytest.raises(RuntimeError, match="without calling backward"):
        opt.step(backward_closure)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert opt.step(lambda: nn.functional.cross_entropy(model(x), y)) is not None
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    assert not opt.refresh_due
    assert opt.step() is None


def test_make_optimizer_builds_both_configurations():
    dho2 = make_optimizer("dho2", tiny_net(), lr=1e-3, backend="single")
    wa = make_optimizer("dho2-wa", tiny_net(), lr=1e-3, backend="single")
    assert isinstance(dho2, DHO2Optimizer)
    assert dho2.config.admm
    assert dho2.admm is not None
    assert isinstance(wa, DHO2Optimizer)
    assert not wa.config.admm
    assert wa.admm is None
    assert "admm=False" in repr(wa)
    assert "admm_rule=None, sigma=None" in repr(wa)
    assert (dho2.config.admm_rule, dho2.config.sigma) == (DEFAULT_ADMM_RULE, DEFAULT_SIGMA[DEFAULT_ADMM_RULE])
    code = make_optimizer("dho2:admm_rule=code", tiny_net(), lr=1e-3, backend="single")
    assert (code.config.admm_rule, code.config.sigma) == ("code", 5e-9)  # the authors' code's σ
    assert make_optimizer("dho2:admm_rule=lagrangian,sigma=0.5", tiny_net(), backend="single").admm.sigma == 0.5
    with pytest.raises(ValueError, match="fixes"):
        make_optimizer("dho2", tiny_net(), lr=1e-3, admm=False)


# ---------------------------------------------------------------- training job
def test_training_job_options(capsys):
    from spdkfac.train.args import dho2_options, parse_args

    args = parse_args(["--optimizer", "dho2", "--refresh-every", "10", "--admm-epochs", "2"])
    assert (args.lr, args.weight_decay) == (1e-3, 0.05)  # the paper's AdamW defaults
    assert dho2_options(args, steps_per_epoch=30) == dict(
        k=5, l=0, refresh_every=10, alpha=0.1, seed=42, admm_rule=None, sigma=None, admm_period=60
    )
    args = parse_args(["--optimizer", "dho2", "--admm-rule", "code", "--sigma", "5e-4"])
    assert (dho2_options(args, 30)["admm_rule"], dho2_options(args, 30)["sigma"]) == ("code", 5e-4)
    assert "sigma" not in dho2_options(parse_args(["--optimizer", "dho2-wa"]), 30)
    assert parse_args(["--optimizer", "sgd"]).lr == 0.05
    for argv, match in [
        (["--optimizer", "sgd", "--sigma", "0.1"], "--sigma only apply to --optimizer dho2"),
        (["--optimizer", "dho2", "--momentum", "0.5"], "--momentum does not apply"),
        (["--optimizer", "dho2", "--damping", "0.1"], "--damping only apply to the K-FAC optimizers"),
        (["--optimizer", "dho2", "--amp", "fp16"], "fp16"),
        (["--optimizer", "dho2-wa", "--admm-rule", "code"], "--admm-rule and --sigma apply to --optimizer dho2"),
        (["--optimizer", "sgd", "--admm-rule", "code"], "--admm-rule only apply to --optimizer dho2"),
        (["--optimizer", "dho2", "--admm-rule", "printed"], "invalid choice"),
    ]:
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert match  # the message goes to stderr (argparse); the exit is what matters here


@pytest.mark.slow
def test_training_job_runs_and_resumes_dho2(tmp_path, capsys):
    from spdkfac.train.job import main

    torch.set_default_dtype(torch.float32)  # the job's data and models (the module's float64 fixture restores it)
    argv = ["--data", "digits", "--optimizer", "dho2", "--epochs", "2", "--refresh-every", "15", "--quiet", "--backend", "single"]
    full = main([*argv, "--out-dir", str(tmp_path / "full")])
    main([*argv, "--out-dir", str(tmp_path / "half"), "--stop-after", "1"])
    resumed = main([*argv, "--out-dir", str(tmp_path / "half"), "--resume"])
    assert full["test_acc"] > 0.5
    for key in ("train_loss", "test_loss", "test_acc"):
        assert resumed[key] == full[key]


def test_distributed_adamw_is_torch_adamw_on_the_averaged_gradient():
    x, y = data(24)
    ref_model = tiny_net()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.05)
    for s in range(4):
        ref.zero_grad()
        nn.functional.cross_entropy(ref_model(x + 0.1 * s), y).backward()
        ref.step()
    models = [tiny_net() for _ in range(2)]

    def fn(backend):
        model = models[backend.rank]
        opt = make_optimizer("adamw", model, lr=1e-2, backend=backend)
        shard = slice(backend.rank * 12, (backend.rank + 1) * 12)
        for s in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[shard] + 0.1 * s), y[shard]).backward()
            opt.step()
        return flat(model)

    out = run_ranks(2, fn)
    assert torch.equal(out[0], out[1])
    assert torch.allclose(out[0], flat(ref_model), rtol=0, atol=1e-12)


def test_a_learning_rate_schedule_scales_the_newton_step_too():
    x, y = data()
    steps = []
    for lr_now in (1e-2, 5e-3):
        model = tiny_net()
        opt = DHO2Optimizer(model, lr=1e-2, backend="single", admm=False, weight_decay=0.0, **OPTIONS)
        opt.param_groups[0]["lr"] = lr_now
        before = flat(model)
        run_dho2(opt, model, x, y, 1)  # the first AdamW step is ±lr per coordinate: both parts scale with lr
        steps.append(flat(model) - before)
    assert torch.allclose(steps[1], steps[0] / 2, rtol=1e-6, atol=1e-12)


def test_a_nonfinite_update_is_refused_and_leaves_the_parameters(monkeypatch):
    x, y = data()
    model = tiny_net()
    options = {k: v for k, v in OPTIONS.items() if k != "eigenvalue_floor"}
    opt = DHO2Optimizer(model, backend="single", admm=False, eigenvalue_floor=0.0, **options)
    # A curvature so small that α/|a| overflows: the Newton step is infinite.
    monkeypatch.setattr(EigenBasis, "keep_curvature", lambda self, floor: EigenBasis(torch.full_like(self.values, 1e-320), self.vectors))
    before = flat(model)
    with pytest.raises(NonFiniteError, match="non-finite update"):
        run_dho2(opt, model, x, y, 1)
    assert torch.equal(flat(model), before)
    assert opt.steps == 0
