"""``ekfac_update='adam'`` (Adam in K-FAC's eigenbasis, SOAP's update) against an independent float64 implementation.

The reference is written from the definition (:mod:`spdkfac.kfac.methods.ekfac`):
factors and running averages as K-FAC's (``test_reference_kfac``), at every
``inv_update_freq``-th step the eigenvectors ``Q_A``, ``Q_G`` of ``A`` and
``G`` by ``torch.linalg.eigh``; for each preconditioned layer, with ``∇W``
its averaged gradient (bias as the last column),

    m <- β1 m + (1 - β1) ∇W                      (the layer's coordinates, from 0)
    v <- β v + (1 - β) (Q_G^T ∇W Q_A)²           (the eigenbasis, from 0, kept across refreshes; β = ekfac_decay)
    u  = Q_G [(Q_G^T m Q_A / (1 - β1^t)) / (√(v / (1 - β^t)) + ε)] Q_A^T

then the KL clip ``ν = min(1, √(kl_clip / (lr² Σ u·∇W)))`` and
``w <- w - lr ν u - lr wd w``; a parameter outside K-FAC gets AdamW's
equations written out (``torch.optim.AdamW``, with ``betas = (β1, β2)``).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net, train
from test_ekfac import step_beside_reference
from test_reference_kfac import ConvLinearNet, ReferenceKFAC

from spdkfac import SPDKFACOptimizer


class ReferenceEigenAdam(ReferenceKFAC):
    """Adam in K-FAC's eigenbasis, dense and unoptimised; ``skip`` modules get plain AdamW."""

    def __init__(
        self, model: nn.Module, betas: tuple[float, float], ekfac_decay: float, eps: float, skip: tuple[nn.Module, ...] = (), **hyper
    ) -> None:
        super().__init__(model, momentum=0.0, **hyper)
        self.beta = ekfac_decay
        self.layers = [m for m in self.layers if m not in skip]
        self.betas, self.eps = betas, eps
        self.basis: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.m: dict[nn.Module, torch.Tensor] = {}
        self.v: dict[nn.Module, torch.Tensor] = {}
        self.adamw: dict[nn.Parameter, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._backward_and_factors(x, y)
        if self.steps % self.iuf == 0:
            for m in self.layers:
                self.basis[m] = (torch.linalg.eigh(self.A[m])[1], torch.linalg.eigh(self.G[m])[1])
        b1, b2 = self.betas
        t = self.steps + 1
        grads, updates = {}, {}
        for m in self.layers:
            grad = m.weight.grad.reshape(m.weight.shape[0], -1)
            if m.bias is not None:
                grad = torch.cat([grad, m.bias.grad[:, None]], 1)
            q_a, q_g = self.basis[m]
            self.m[m] = b1 * self.m.get(m, torch.zeros_like(grad)) + (1 - b1) * grad
            self.v[m] = self.beta * self.v.get(m, torch.zeros_like(grad)) + (1 - self.beta) * (q_g.T @ grad @ q_a) ** 2
            m_hat = q_g.T @ self.m[m] @ q_a / (1 - b1**t)
            v_hat = self.v[m] / (1 - self.beta**t)
            grads[m], updates[m] = grad, q_g @ (m_hat / (v_hat.sqrt() + self.eps)) @ q_a.T
        nu = 1.0
        if self.kl_clip is not None:
            vg = abs(sum(float((updates[m] * grads[m]).sum()) * self.lr**2 for m in self.layers))
            nu = min(1.0, (self.kl_clip / vg) ** 0.5)
        directions: dict[nn.Parameter, torch.Tensor] = {}
        for m in self.layers:
            u = updates[m] * nu
            if m.bias is not None:
                directions[m.bias] = u[:, -1]
                u = u[:, :-1]
            directions[m.weight] = u.reshape(m.weight.shape)
        with torch.no_grad():
            for p in self.model.parameters():
                if p in directions:
                    p.sub_(self.lr * directions[p] + self.lr * self.wd * p)
                    continue
                exp_avg, exp_avg_sq = self.adamw.get(p, (torch.zeros_like(p), torch.zeros_like(p)))
                exp_avg = b1 * exp_avg + (1 - b1) * p.grad
                exp_avg_sq = b2 * exp_avg_sq + (1 - b2) * p.grad**2
                self.adamw[p] = (exp_avg, exp_avg_sq)
                step = (exp_avg / (1 - b1**t)) / ((exp_avg_sq / (1 - b2**t)).sqrt() + self.eps)
                p.sub_(self.lr * step + self.lr * self.wd * p)
        self.steps += 1


@pytest.mark.slow
@pytest.mark.parametrize(("freqs", "kl_clip"), [((1, 3), None), ((2, 2), 1e-4)])
def test_adam_in_the_eigenbasis_takes_the_reference_step(freqs, kl_clip, float64):
    hyper = dict(lr=0.01, weight_decay=0.05, damping=0.003, factor_decay=0.9, kl_clip=kl_clip)
    hyper.update(factor_update_freq=freqs[0], inv_update_freq=freqs[1])
    betas, eps, decay = (0.85, 0.99), 1e-7, 0.9
    torch.manual_seed(0)
    net = ConvLinearNet()
    init = copy.deepcopy(net.state_dict())
    ref_net = copy.deepcopy(net)
    reference = ReferenceEigenAdam(ref_net, betas, decay, eps, skip=(ref_net.fc2,), **hyper)
    opt = SPDKFACOptimizer(
        net,
        backend="single",
        compute_method="ekfac",
        ekfac_update="adam",
        ekfac_decay=decay,
        base="adamw",
        betas=betas,
        eps=eps,
        skip_layers=["fc2"],
        **hyper,
    )
    assert [layer.name for layer in opt.layers] == ["conv1", "conv2", "fc1"]
    step_beside_reference(net, opt, ref_net, reference)  # bases refreshed at 0, 3, 6 (or 0, 2, 4, 6); the second moment kept
    for layer, module in zip(opt.layers, reference.layers):
        assert layer.method_state.step == 7
        torch.testing.assert_close(layer.method_state.exp_avg, reference.m[module], rtol=1e-8, atol=1e-12)
        torch.testing.assert_close(layer.method_state.exp_avg_sq, reference.v[module], rtol=1e-7, atol=1e-14)
    assert not any(p in opt.state and opt.state[p] for layer in opt.layers for p in layer.params())  # no AdamW state of their own
    moved = max(float((net.state_dict()[k] - v).abs().max()) for k, v in init.items())
    assert moved > 1e-3


def test_adam_in_the_eigenbasis_needs_ekfac_and_the_adamw_base():
    with pytest.raises(ValueError, match="needs compute_method='ekfac' and base='adamw'"):
        SPDKFACOptimizer(small_net(), lr=0.1, compute_method="ekfac", ekfac_update="adam", backend="single")
    with pytest.raises(ValueError, match="needs compute_method='ekfac' and base='adamw'"):
        SPDKFACOptimizer(small_net(), lr=0.1, compute_method="eigen", ekfac_update="adam", base="adamw", backend="single")
    with pytest.raises(ValueError, match="ekfac_update must be one of"):
        SPDKFACOptimizer(small_net(), lr=0.1, compute_method="ekfac", ekfac_update="sqrt", backend="single")


def test_adam_in_the_eigenbasis_skips_and_resumes_bitwise(float64):
    """A skipped step keeps the moments; a checkpoint resumes bit for bit; the natural update's checkpoint is refused."""
    x, y = batch(16)
    kw = dict(lr=0.01, weight_decay=0.05, backend="single", compute_method="ekfac", ekfac_update="adam", base="adamw", skip_nonfinite=1)
    net = small_net()
    opt = SPDKFACOptimizer(net, **kw)
    train(net, opt, x, y, 3)
    moments = {layer.name: (layer.method_state.exp_avg.clone(), layer.method_state.exp_avg_sq.clone()) for layer in opt.layers}
    train(net, opt, x, y, 1, poisoned={0: torch.ones(16, dtype=torch.bool)})  # NaN everywhere: skipped
    for layer in opt.layers:
        assert layer.method_state.step == 3
        assert torch.equal(layer.method_state.exp_avg, moments[layer.name][0]), layer.name
        assert torch.equal(layer.method_state.exp_avg_sq, moments[layer.name][1]), layer.name
    saved_model, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    train(net, opt, x, y, 2)
    resumed = small_net()
    resumed.load_state_dict(saved_model)
    opt2 = SPDKFACOptimizer(resumed, **kw)
    opt2.load_state_dict(saved_opt)
    train(resumed, opt2, x, y, 2)
    for (name, p), q in zip(net.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), name
    natural = SPDKFACOptimizer(small_net(), lr=0.01, backend="single", compute_method="ekfac", base="adamw")
    train(natural.model, natural, x, y, 1)
    with pytest.raises(ValueError, match="resume with ekfac_update='natural'"):
        SPDKFACOptimizer(small_net(), **kw).load_state_dict(natural.state_dict())
