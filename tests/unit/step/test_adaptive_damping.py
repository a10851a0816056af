"""``damping='adaptive'``: the Levenberg-Marquardt rule against an independent float64 computation, replicas, resume.

The reference recomputes, from a copy of the model and the optimizer's
running factors: the losses before and after the step (the closure's batch),
the gradient by autograd, the step ``δ`` from the parameters, the quadratic
model ``∇hᵀδ + ½ δᵀ(A ⊗ G + γI)δ`` with ``A ⊗ G`` built by ``torch.kron``
(column-stacked ``vec``), ``ρ``, and the rule's new damping.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.step.adaptive_damping import AdaptiveDamping, levenberg_marquardt, reduction_ratio


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 4))


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.randint(0, 4, (n,), generator=g)


def test_rule_thresholds():
    assert levenberg_marquardt(1.0, 0.9, 0.5, 1e-3, 10.0) == 0.5
    assert levenberg_marquardt(1.0, 0.1, 0.5, 1e-3, 10.0) == 2.0
    assert levenberg_marquardt(1.0, 0.5, 0.5, 1e-3, 10.0) == 1.0
    assert levenberg_marquardt(8.0, -1.0, 0.5, 1e-3, 10.0) == 10.0
    assert reduction_ratio(1.0, 0.5, 0.0) == -math.inf  # no decrease predicted: raise the damping
    assert AdaptiveDamping(interval=5).factor == pytest.approx(0.95**5)


def _kron_quadratic(v: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> float:
    """``vec(V)ᵀ (A ⊗ G) vec(V)`` with an explicit Kronecker product, per block."""
    blocks = v if v.dim() == 3 else v.unsqueeze(0)
    gs = g if g.dim() == 3 else g.expand(blocks.shape[0], *g.shape)
    total = 0.0
    for b in range(blocks.shape[0]):
        a_full = torch.diag(a) if a.dim() == 1 else (a if a.dim() == 2 else a[b])
        vec = blocks[b].T.reshape(-1)  # column-stacked
        total += float(vec @ torch.kron(a_full, gs[b]) @ vec)
    return total


@pytest.mark.parametrize("norm_layers", ["plain", "kfac"])
def test_new_damping_equals_the_float64_reference(norm_layers, float64):
    model = net()
    x, y = data(16)
    rule = AdaptiveDamping(initial=0.05, interval=1, omega=0.5)
    opt = SPDKFACOptimizer(model, lr=0.3, momentum=0.5, damping=rule, kl_clip=None, norm_layers=norm_layers)
    closure = lambda: F.cross_entropy(model(x), y)  # noqa: E731
    moved = 0
    for step in range(4):
        copy_ = copy.deepcopy(model)
        damping = opt.param_groups[0]["damping"]
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step(closure)
        # reference: gradient and losses of the copy at the old parameters, δ from the parameters
        copy_.zero_grad()
        h0 = F.cross_entropy(copy_(x), y)
        h0.backward()
        after = dict(model.named_parameters())
        predicted = 0.0
        square = 0.0
        deltas = {}
        for name, p in copy_.named_parameters():
            d = after[name].detach() - p.detach()
            deltas[name] = d
            predicted += float((p.grad * d).sum())
            square += float((d * d).sum())
        curvature = 0.0
        for layer in opt.layers:
            w, b = f"{layer.name}.weight", f"{layer.name}.bias"
            if isinstance(layer.module, nn.Linear):
                v = torch.cat([deltas[w], deltas[b].unsqueeze(1)], dim=1)
            else:  # scale and shift per channel: (C, 2, 1)
                v = torch.stack([deltas[w], deltas[b]], dim=-1).unsqueeze(-1)
            curvature += _kron_quadratic(v, layer.A, layer.G)
        model_change = predicted + 0.5 * (curvature + damping * square)
        with torch.no_grad():
            h1 = float(F.cross_entropy(model(x), y))
        rho = (h1 - float(h0)) / model_change if model_change < 0 else -math.inf
        expected = damping * 0.5 if rho > 0.75 else damping / 0.5 if rho < 0.25 else damping
        expected = min(max(expected, rule.low), rule.high)
        assert opt.last_reduction_ratio == pytest.approx(rho, rel=1e-9, abs=1e-12), step
        assert opt.param_groups[0]["damping"] == pytest.approx(expected, rel=1e-12), step
        moved += expected != damping
    assert moved  # the rule acted


def test_refuses_without_a_closure_and_with_a_backward_in_it():
    model = net()
    x, y = data(8)
    opt = SPDKFACOptimizer(model, lr=0.1, damping="adaptive")
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(ValueError, match=r"step\(closure\)"):
        opt.step()
    opt = SPDKFACOptimizer(net(), lr=0.1, damping=AdaptiveDamping(interval=1))

    def with_backward():
        loss = F.cross_entropy(opt.model(x), y)
        loss.backward()
        return loss

    F.cross_entropy(opt.model(x), y).backward()
    with pytest.raises(RuntimeError, match="no backward"):
        opt.step(with_backward)
    with pytest.raises(ValueError, match="'adaptive'"):
        SPDKFACOptimizer(net(), lr=0.1, damping="auto")
    with pytest.raises(ValueError, match="update_fusion='none'"):
        SPDKFACOptimizer(net(), lr=0.1, damping="adaptive", update_fusion="forward")
    with pytest.raises(ValueError, match=r"step\(closure\)"):
        KFACPreconditioner(net(), lr=0.1, damping="adaptive")


def _train(backend, model: nn.Module, steps: range, opt_state=None, global_batch: int = 16):
    size = 1 if isinstance(backend, str) else backend.size
    rank = 0 if isinstance(backend, str) else backend.rank
    x, y = data(global_batch)
    local = global_batch // size
    xs, ys = x[rank * local : (rank + 1) * local], y[rank * local : (rank + 1) * local]
    opt = SPDKFACOptimizer(model, backend=backend, lr=0.2, damping=AdaptiveDamping(initial=0.05, interval=2), norm_layers="kfac")
    if opt_state is not None:
        opt.load_state_dict(opt_state)
    dampings = []
    for s in steps:
        opt.zero_grad()
        F.cross_entropy(model(xs + 0.1 * s), ys).backward()
        opt.step(lambda s=s: F.cross_entropy(model(xs + 0.1 * s), ys))
        dampings.append(opt.param_groups[0]["damping"])
    return opt, dampings


def test_two_workers_bitwise_replicas_equal_one(float64):
    _, single = _train("single", net(), range(8))
    models = [net() for _ in range(2)]

    def rank(backend):
        opt, dampings = _train(backend, models[backend.rank], range(8))
        return {k: v.detach().clone() for k, v in opt.model.named_parameters()}, dampings

    ranks = run_ranks(2, rank)
    assert ranks[0][1] == ranks[1][1]  # the same damping on every rank, every step
    assert ranks[0][1] == pytest.approx(single, rel=1e-9)
    assert len(set(single)) > 2  # it moved
    for key, value in ranks[0][0].items():
        assert torch.equal(value, ranks[1][0][key]), key


def test_resume_is_exact():
    straight = net()
    _, dampings = _train("single", straight, range(9))
    first_model = net()
    first, _ = _train("single", first_model, range(5))
    saved, params = copy.deepcopy(first.state_dict()), copy.deepcopy(first_model.state_dict())
    again = net()
    again.load_state_dict(params)
    _, resumed = _train("single", again, range(5, 9), opt_state=saved)
    assert resumed == dampings[5:]
    for key, value in straight.state_dict().items():
        assert torch.equal(value, again.state_dict()[key]), key
