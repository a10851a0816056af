"""compute_method='ekfac' against an independent float64 implementation, and N workers = one worker with the eigenbasis options.

The reference is written from the definition (George et al. 2018, with the
scaling estimated from the batch gradient, :mod:`spdkfac.kfac.methods.ekfac`):
factors and running averages as K-FAC's (``test_reference_kfac``), at every
``inv_update_freq``-th step ``A = Q_A diag(d_A) Q_A^T`` and ``G = Q_G
diag(d_G) Q_G^T`` by ``torch.linalg.eigh`` (eigenvalues below 1e-10 set to
0), the scaling ``s`` started at ``d_G d_A^T`` and updated every step as
``s <- β s + (1-β) B (Q_G^T ∇W Q_A)²`` (``B`` the batch), the update
``Q_G [(Q_G^T ∇W Q_A) / (s + γ)] Q_A^T``, then the KL clip and momentum SGD.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn
from launch import ROOT, assert_params_match, require_horovod, run_single, run_workers
from nets import assert_bitwise_equal, batch, mixed_net, small_net, train
from test_reference_kfac import ConvLinearNet, ReferenceKFAC
from test_reference_kfac import step_beside_reference as beside_reference

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.perfmodels import PerfModel


class ReferenceEKFAC(ReferenceKFAC):
    """EKFAC's step, dense and unoptimised, in the reference K-FAC's frame."""

    def __init__(self, model: nn.Module, ekfac_decay: float, **hyper) -> None:
        super().__init__(model, **hyper)
        self.beta = ekfac_decay
        self.basis: dict[nn.Module, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.scale: dict[nn.Module, torch.Tensor] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._backward_and_factors(x, y)
        if self.steps % self.iuf == 0:
            for m in self.layers:
                d_a, q_a = torch.linalg.eigh(self.A[m])
                d_g, q_g = torch.linalg.eigh(self.G[m])
                self.basis[m] = (q_a, d_a.masked_fill(d_a < 1e-10, 0.0), q_g, d_g.masked_fill(d_g < 1e-10, 0.0))
        grads, updates = {}, {}
        for m in self.layers:
            grad = m.weight.grad.reshape(m.weight.shape[0], -1)
            if m.bias is not None:
                grad = torch.cat([grad, m.bias.grad[:, None]], 1)
            q_a, d_a, q_g, d_g = self.basis[m]
            v = q_g.T @ grad @ q_a
            s = self.scale.get(m, torch.outer(d_g, d_a))
            s = self.beta * s + (1 - self.beta) * x.shape[0] * v**2
            self.scale[m] = s
            grads[m], updates[m] = grad, q_g @ (v / (s + self.damping)) @ q_a.T
        nu = 1.0
        if self.kl_clip is not None:
            vg = abs(sum(float((updates[m] * grads[m]).sum()) * self.lr**2 for m in self.layers))
            nu = min(1.0, (self.kl_clip / vg) ** 0.5)
        for m in self.layers:
            v = updates[m] * nu
            if m.bias is not None:
                m.bias.grad = v[:, -1].clone()
                v = v[:, :-1]
            m.weight.grad = v.reshape(m.weight.shape).clone()
        with torch.no_grad():
            for p in self.model.parameters():
                d_p = p.grad + self.wd * p
                buf = self.momentum_buffers.get(p)
                buf = d_p.clone() if buf is None else buf.mul_(self.momentum).add_(d_p)
                self.momentum_buffers[p] = buf
                p.sub_(self.lr * buf)
        self.steps += 1


def step_beside_reference(net: nn.Module, opt: SPDKFACOptimizer, ref_net: nn.Module, reference: ReferenceKFAC, steps: int = 7) -> None:
    """``steps`` steps beside the float64 reference, the parameters equal after each (:func:`test_reference_kfac.step_beside_reference`).

    48 samples a batch: full-rank factors with distinct eigenvalues, so the two eigenbases agree.
    """
    beside_reference(net, opt, ref_net, reference, steps=steps, batch=48, rtol=1e-8, atol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("freqs", [(1, 3), (2, 2)])
def test_ekfac_takes_the_reference_step(freqs, float64):
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.003, factor_decay=0.9, kl_clip=1e-2)
    hyper.update(factor_update_freq=freqs[0], inv_update_freq=freqs[1])
    torch.manual_seed(0)
    net = ConvLinearNet()
    init = copy.deepcopy(net.state_dict())
    ref_net = copy.deepcopy(net)
    reference = ReferenceEKFAC(ref_net, ekfac_decay=0.8, **hyper)
    opt = SPDKFACOptimizer(net, backend="single", compute_method="ekfac", ekfac_decay=0.8, **hyper)
    step_beside_reference(net, opt, ref_net, reference)  # bases refreshed at steps 0, 3, 6 (or 0, 2, 4, 6)
    for layer, module in zip(opt.layers, reference.layers):
        torch.testing.assert_close(layer.method_state.scale, reference.scale[module], rtol=1e-7, atol=1e-12)
    moved = max(float((net.state_dict()[k] - v).abs().max()) for k, v in init.items())
    assert moved > 1e-4


@pytest.mark.slow
def test_ekfac_differs_from_the_eigen_method_and_a_skipped_step_keeps_its_scaling(float64):
    x, y = batch(8)
    kw = dict(lr=0.05, damping=0.01, backend="single", skip_nonfinite=1)
    eigen, ekfac = small_net(), small_net()
    train(eigen, SPDKFACOptimizer(eigen, compute_method="eigen", **kw), x, y, 3)
    opt = SPDKFACOptimizer(ekfac, compute_method="ekfac", **kw)
    train(ekfac, opt, x, y, 3)
    assert any(not torch.allclose(a, b) for a, b in zip(eigen.parameters(), ekfac.parameters()))
    scales = {layer.name: layer.method_state.scale.clone() for layer in opt.layers}
    assert {layer.method_state.samples for layer in opt.layers} == {8}
    assert opt.memory_usage()["method_state"] == 8 * sum(p.numel() for p in ekfac.parameters())  # a float64 scale per weight and bias
    train(ekfac, opt, x, y, 1, poisoned={0: torch.ones(8, dtype=torch.bool)})  # NaN everywhere: skipped
    for layer in opt.layers:
        assert torch.equal(layer.method_state.scale, scales[layer.name]), layer.name


SPLIT = {
    "ekfac-one-per-layer": dict(distribute_preconditioning=True),
    "ekfac-warm-half": dict(grad_worker_fraction=0.5, eigen_refresh="warm", eigen_full_every=3, inv_update_freq=2),
    "ekfac-adam-one-per-layer": dict(distribute_preconditioning=True, lr=0.01, eps=1e-4, ekfac_update="adam", base="adamw", momentum=None),
}


@pytest.mark.parametrize("name", list(SPLIT))
def test_ekfac_with_layers_split_over_the_workers_equals_one_process(name, float64):
    """Each layer preconditioned (and its scaling kept) on some of the 2 workers only: the parameters of one process
    on the global batch, bitwise the same on both ranks; the scaling of a layer bitwise the same wherever kept, and
    none where it is not."""
    config = {**CONFIGS["ekfac-lbp"], **SPLIT[name]}
    config = {k: v for k, v in config.items() if v is not None}
    rtol, atol = TOLERANCE.get("ekfac-adam-lbp" if "adam" in name else name, (1e-9, 1e-11))
    ref = _train("single", config, GLOBAL_BATCH, mixed_net())
    models = [mixed_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(b, config, GLOBAL_BATCH, models[b.rank]))
    for key, value in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][key], value, rtol=rtol, atol=atol)
        assert torch.equal(ranks[0]["params"][key], ranks[1]["params"][key]), key
    kept = [{k for k, v in r["scales"].items() if v is not None} for r in ranks]
    assert kept[0]
    assert kept[1]
    assert kept[0] != kept[1]
    assert kept[0] | kept[1] == set(ref["scales"])
    for key in kept[0] & kept[1]:
        assert torch.equal(ranks[0]["scales"][key], ranks[1]["scales"][key]), key


@pytest.mark.parametrize("update", ["natural", "adam"])
def test_only_a_method_running_adam_in_its_basis_is_handed_adams_hyperparameters(update):
    net = small_net()
    opt = SPDKFACOptimizer(net, lr=0.01, base="adamw", compute_method="ekfac", ekfac_update=update, kl_clip=None, backend="single")
    x, y = batch(8)
    train(net, opt, x, y, steps=1)
    handed = [
        (getattr(layer.method_state, "betas", None) is not None, getattr(layer.method_state, "eps", None) is not None)
        for layer in opt.layers
    ]
    assert handed == [(update == "adam", update == "adam")] * len(opt.layers)


STEPS = 6
#: More samples than any factor's dimension: full-rank factors with distinct eigenvalues. Where eigenvalues repeat
#: (a rank-deficient factor's null space), eigh's basis within that eigenspace depends on rounding, and a warm
#: refresh or EKFAC's per-coordinate scaling started from it follows it (each rank still holds the broadcast one).
GLOBAL_BATCH = 48
BASE = dict(lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, factor_decay=0.9, kl_clip=0.01, profile_steps=2)
#: Each option on, with decompositions owned and broadcast (lbp, seq) or local, and steps that keep the bases.
CONFIGS = {
    "eigen-warm-lbp": dict(BASE, compute_method="eigen", eigen_refresh="warm", eigen_full_every=3, placement="lbp"),
    "eigen-warm-seq-freq": dict(
        BASE,
        compute_method="eigen",
        eigen_refresh="warm",
        eigen_full_every=3,
        placement="seq",
        factor_update_freq=1,
        inv_update_freq=2,
    ),
    "ekfac-lbp": dict(BASE, compute_method="ekfac", placement="lbp"),
    "ekfac-warm-seq-freq": dict(
        BASE, compute_method="ekfac", eigen_refresh="warm", eigen_full_every=3, placement="seq", factor_update_freq=1, inv_update_freq=2
    ),
    "ekfac-warm-local": dict(BASE, compute_method="ekfac", eigen_refresh="warm", eigen_full_every=4, placement="local"),
    # Adam in the eigenbasis (SOAP's update with K-FAC's basis), on the AdamW base: no momentum, betas instead. Adam
    # makes each projected coordinate's step independent of its size, so a coordinate at rounding level (a direction
    # the gradient has almost none of) steps by its rounding, which N workers' summation order changes: with eps=1e-8
    # the parameters agree to ~1e-5 relative only. An eps above that level keeps the comparison to ~1e-8 (TOLERANCE).
    "ekfac-adam-lbp": dict(
        {k: v for k, v in BASE.items() if k != "momentum"},
        lr=0.01,
        eps=1e-4,
        compute_method="ekfac",
        ekfac_update="adam",
        base="adamw",
        placement="lbp",
        factor_update_freq=1,
        inv_update_freq=2,
    ),
}

#: (rtol, atol) where not 1e-9 and 1e-11. Adam in the eigenbasis depends on the basis itself, and a strided
#: transposed convolution's A has close eigenvalue pairs (its kernel offsets read the input shifted by one, nearly
#: the same Gram): N workers' summation order turns the basis there by rounding/gap, ~1e-7 of the parameters.
TOLERANCE = {"ekfac-adam-lbp": (1e-6, 1e-10)}


def _perf() -> PerfModel:
    """Decompositions dear next to broadcasts: the larger factors are owned and broadcast, the small ones local."""
    data = PerfModel.default().to_dict()
    for curve in ("inverse", "eigen", "eigen_warm"):
        data[curve] = {"kind": "cubic", "coeffs": [1e-6, 0.0, 0.0, 1e-5], "floor": 1e-6}
    data["broadcast"] = {"alpha": 1e-2, "beta": 1e-6}
    return PerfModel.from_dict(data, "eigenbasis-test")


def _train(backend, config: dict, global_batch: int, model: nn.Module) -> dict:
    x, y = batch(global_batch)
    size = 1 if isinstance(backend, str) else backend.size
    rank = 0 if isinstance(backend, str) else backend.rank
    local = global_batch // size
    opt = SPDKFACOptimizer(model, backend=backend, perf_model=_perf(), **config)
    train(model, opt, x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local], STEPS)
    state = {
        f"{layer.name}/{kind}": (layer.decomposition(kind).Q, layer.decomposition(kind).age)
        for layer in opt.layers
        for kind in "AG"
        if layer.decomposition(kind) is not None and layer.decomposition(kind).Q is not None  # (held here)
    }
    scales = {layer.name: getattr(layer.method_state, "scale", getattr(layer.method_state, "exp_avg_sq", None)) for layer in opt.layers}
    owners = {"/".join(a.key): a.owner for a in opt.work_plan.inversion.assignments}
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()}, "bases": state, "scales": scales, "owners": owners}


@pytest.mark.slow
@pytest.mark.parametrize("workers", [2, 3])
def test_eigenbasis_options_n_workers_equal_one_in_process(workers, float64):
    """Every rank ends with the parameters of one worker, and bitwise the same parameters, bases, ages and scalings."""
    init = mixed_net().state_dict()
    for name, config in CONFIGS.items():
        ref = _train("single", config, GLOBAL_BATCH, mixed_net())
        models = [mixed_net() for _ in range(workers)]
        ranks = run_ranks(workers, lambda b, config=config, models=models: _train(b, config, GLOBAL_BATCH, models[b.rank]))
        for key, value in ref["params"].items():
            for r, result in enumerate(ranks):
                rtol, atol = TOLERANCE.get(name, (1e-9, 1e-11))
                torch.testing.assert_close(result["params"][key], value, rtol=rtol, atol=atol, msg=lambda m, k=key, n=name: f"{n}/{k}: {m}")
                assert torch.equal(result["params"][key], ranks[0]["params"][key]), f"{name}/{key} differs on rank {r}"
        for r, result in enumerate(ranks[1:], 1):
            for key, (q, age) in result["bases"].items():
                assert torch.equal(q, ranks[0]["bases"][key][0]), f"{name}: basis {key} differs on rank {r}"
                assert age is None or torch.equal(age, ranks[0]["bases"][key][1]), f"{name}: age of {key} differs on rank {r}"
            for key, scale in result["scales"].items():
                assert (scale is None) == (ranks[0]["scales"][key] is None)
                assert scale is None or torch.equal(scale, ranks[0]["scales"][key]), f"{name}: scaling of {key} differs on rank {r}"
        if "warm" in name:  # the warm path ran: some factor was refreshed from its previous basis
            assert any(age is not None and int(age) > 0 for _, age in ranks[0]["bases"].values()), name
        if "-lbp" in name:
            assert any(o >= 0 for o in ranks[0]["owners"].values()), (name, ranks[0]["owners"])
        assert any(not torch.equal(ref["params"][k], init[k]) for k in init), name


WORKER = str(ROOT / "tests" / "workers" / "train_configs.py")
MP_CONFIGS = {
    name: dict(CONFIGS[name], model="mixed", perf_model="expensive-eigen")
    for name in ("eigen-warm-lbp", "ekfac-lbp", "ekfac-warm-seq-freq", "eigen-warm-seq-freq", "ekfac-adam-lbp")
}


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_eigenbasis_options_multiprocess_equal_one_and_replicas_are_bitwise(engine, tmp_path):
    """Real processes: float64 parameters equal one process's; float32 parameters, bases, ages, scalings bitwise on every rank."""
    if engine == "horovod":
        require_horovod()
    common = ["--configs", json.dumps(MP_CONFIGS), "--global-batch", str(GLOBAL_BATCH), "--steps", str(STEPS)]
    ref_out, dist_out, f32_out = tmp_path / "ref.pt", tmp_path / "dist.pt", tmp_path / "f32.pt"
    run_single(WORKER, [*common, "--out", str(ref_out), "--no-accumulation"])
    run_workers(engine, 2, [WORKER, "--backend", engine, *common, "--out", str(dist_out)])
    ref, dist = torch.load(ref_out, weights_only=False), torch.load(dist_out, weights_only=False)
    for name in MP_CONFIGS:
        assert_params_match(ref, dist, [name], *TOLERANCE.get(name, (1e-9, 1e-11)))
    run_workers(engine, 2, [WORKER, "--backend", engine, *common, "--dtype", "float32", "--every-rank", "--out", str(f32_out)])
    ranks = [torch.load(f"{f32_out}.rank{r}", weights_only=False) for r in range(2)]
    for name in MP_CONFIGS:
        for part in ("params", "optimizer_state"):
            assert_bitwise_equal(ranks[0][name][part], ranks[1][name][part], f"{name}/{part}")
        layers = ranks[0][name]["optimizer_state"]["kfac"]["layers"]
        if name.startswith("ekfac"):
            key = "exp_avg_sq" if "adam" in name else "scale"
            assert all(entry["method_state"][key] is not None for entry in layers.values()), name
        assert any(o >= 0 for o in ranks[0][name]["owners"].values()), name
