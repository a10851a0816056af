"""The optimizer takes exactly the K-FAC step of the reference (Pauloski et al.'s distributed K-FAC).

The reference below is written from the published equations only, in float64,
with nothing from the library but the optimizer under test:

* factors: ``A = Σ (a/S)(a/S)^T / n`` over im2col rows (bias as a ones
  column, ``S`` output positions per sample, ``S = 1`` for Linear) and
  ``G = Σ (n*S*g)(n*S*g)^T / (n*S)`` over the output-gradient rows of a mean
  loss;
* running averages that start from the identity:
  ``F = decay*I + (1-decay)*F_batch`` at the first factor step;
* damped inverses ``(A+γI)^-1``, ``(G+γI)^-1`` (here by ``torch.linalg.inv``);
* the KL clip ``ν = min(1, sqrt(kl_clip / |Σ lr² v·grad|))``;
* momentum SGD as ``torch.optim.SGD`` (weight decay added to the
  preconditioned gradient, no dampening).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer


class ConvLinearNet(nn.Module):
    """Convolutions with and without bias, stride and padding, then Linear layers with and without bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(2, 3, 3, stride=2, padding=1, bias=True)  # 7x7 -> 4x4
        self.conv2 = nn.Conv2d(3, 4, 2, stride=1, padding=0, bias=False)  # 4x4 -> 3x3
        self.fc1 = nn.Linear(36, 5, bias=True)
        self.fc2 = nn.Linear(5, 3, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(torch.tanh(self.conv2(torch.tanh(self.conv1(x)))).flatten(1))))


def _im2col(x: torch.Tensor, conv: nn.Conv2d) -> torch.Tensor:
    """Rows ``(n*S, C*kh*kw)`` by explicit slicing, channel-major like the weight's flattening."""
    (kh, kw), (sh, sw), (ph, pw) = conv.kernel_size, conv.stride, conv.padding
    xp = nn.functional.pad(x, (pw, pw, ph, ph))
    rows = []
    for b in range(x.shape[0]):
        for i in range(0, xp.shape[2] - kh + 1, sh):
            for j in range(0, xp.shape[3] - kw + 1, sw):
                rows.append(xp[b, :, i : i + kh, j : j + kw].reshape(-1))
    return torch.stack(rows)


class ReferenceKFAC:
    """The reference K-FAC step, dense and unoptimised."""

    def __init__(
        self,
        model: nn.Module,
        lr: float,
        momentum: float,
        weight_decay: float,
        damping: float,
        factor_decay: float,
        kl_clip: float | None,
        factor_update_freq: int,
        inv_update_freq: int,
    ) -> None:
        self.model, self.lr, self.momentum, self.wd = model, lr, momentum, weight_decay
        self.damping, self.decay, self.kl_clip = damping, factor_decay, kl_clip
        self.fuf, self.iuf = factor_update_freq, inv_update_freq
        self.layers = [m for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
        self.A: dict[nn.Module, torch.Tensor] = {}
        self.G: dict[nn.Module, torch.Tensor] = {}
        self.A_inv: dict[nn.Module, torch.Tensor] = {}
        self.G_inv: dict[nn.Module, torch.Tensor] = {}
        self.momentum_buffers: dict[nn.Parameter, torch.Tensor] = {}
        self.steps = 0

    def _inputs_and_outputs(self, x: torch.Tensor):
        seen: dict[nn.Module, list[torch.Tensor]] = {}

        def keep(module, inputs, output):
            output.retain_grad()
            seen[module] = [inputs[0].detach(), output]

        handles = [m.register_forward_hook(keep) for m in self.layers]
        out = self.model(x)
        for h in handles:
            h.remove()
        return out, seen

    def _batch_factors(self, m: nn.Module, inp: torch.Tensor, out: torch.Tensor):
        n = inp.shape[0]
        if isinstance(m, nn.Conv2d):
            a = _im2col(inp, m)
            g = out.grad.permute(0, 2, 3, 1).reshape(-1, out.shape[1])
        else:
            a, g = inp, out.grad
        s = a.shape[0] // n
        if m.bias is not None:
            a = torch.cat([a, torch.ones(a.shape[0], 1, dtype=a.dtype)], 1)
        a = a / s
        A = a.T @ a / n
        gs = g * (n * s)
        G = gs.T @ gs / (n * s)
        return A, G

    def _running(self, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        start = torch.eye(new.shape[0], dtype=new.dtype) if old is None else old
        return self.decay * start + (1 - self.decay) * new

    def _backward_and_factors(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """The batch loss's gradients, and on factor steps the running factors (every reference's start)."""
        for p in self.model.parameters():
            p.grad = None
        out, seen = self._inputs_and_outputs(x)
        nn.functional.cross_entropy(out, y).backward()
        if self.steps % self.fuf == 0:
            for m in self.layers:
                A, G = self._batch_factors(m, *seen[m])
                self.A[m], self.G[m] = self._running(self.A.get(m), A), self._running(self.G.get(m), G)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self._backward_and_factors(x, y)
        if self.steps % self.iuf == 0:
            for m in self.layers:
                self.A_inv[m] = torch.linalg.inv(self.A[m] + self.damping * torch.eye(self.A[m].shape[0], dtype=x.dtype))
                self.G_inv[m] = torch.linalg.inv(self.G[m] + self.damping * torch.eye(self.G[m].shape[0], dtype=x.dtype))
        grads, updates = {}, {}
        for m in self.layers:
            grad = m.weight.grad.reshape(m.weight.shape[0], -1)
            if m.bias is not None:
                grad = torch.cat([grad, m.bias.grad[:, None]], 1)
            grads[m], updates[m] = grad, self.G_inv[m] @ grad @ self.A_inv[m]
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
                if self.momentum:
                    buf = self.momentum_buffers.get(p)
                    buf = d_p.clone() if buf is None else buf.mul_(self.momentum).add_(d_p)
                    self.momentum_buffers[p] = buf
                    d_p = buf
                p.sub_(self.lr * d_p)
        self.steps += 1


def step_beside_reference(
    net: nn.Module,
    opt: Any,
    ref_net: nn.Module,
    reference: ReferenceKFAC,
    steps: int,
    batch: int,
    rtol: float,
    atol: float,
    label: str = "",
) -> None:
    """``steps`` steps of ``opt`` and of the float64 ``reference`` on the same batches, the parameters equal after each."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(batch, 2, 7, 7, generator=gen)
        y = torch.randint(0, 3, (batch,), generator=gen)
        reference.step(x, y)
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
        for (pname, p), p_ref in zip(net.named_parameters(), ref_net.parameters()):
            torch.testing.assert_close(
                p, p_ref, rtol=rtol, atol=atol, msg=lambda m, pname=pname: f"{label}{pname} at step {opt.steps}: {m}"
            )


CONFIGS = {
    "every-step": dict(factor_update_freq=1, inv_update_freq=1, kl_clip=1e-3),
    "amortised": dict(factor_update_freq=2, inv_update_freq=4, kl_clip=1e-3),
    "no-clip": dict(factor_update_freq=1, inv_update_freq=2, kl_clip=None),
    "clip-binding": dict(factor_update_freq=1, inv_update_freq=1, kl_clip=1e-7),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_optimizer_takes_the_reference_step(name, float64):
    cfg = CONFIGS[name]
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=1e-3, damping=0.003, factor_decay=0.95, **cfg)
    torch.manual_seed(0)
    net = ConvLinearNet()
    init = copy.deepcopy(net.state_dict())
    ref_net = copy.deepcopy(net)
    reference = ReferenceKFAC(ref_net, **hyper)
    opt = SPDKFACOptimizer(net, backend="single", **hyper)
    step_beside_reference(net, opt, ref_net, reference, steps=6, batch=5, rtol=1e-9, atol=1e-12, label=f"{name}/")
    for layer, module in zip(opt.layers, reference.layers):
        torch.testing.assert_close(layer.A, reference.A[module], rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(layer.G, reference.G[module], rtol=1e-9, atol=1e-12)
    moved = max(float((net.state_dict()[k] - v).abs().max()) for k, v in init.items())
    assert moved > 1e-4  # the comparison is not of parameters that never moved


def test_first_factor_step_starts_from_the_identity(float64):
    """A single batch's rank-deficient factor is mixed with the identity, not taken as it is."""
    torch.manual_seed(0)
    net = nn.Linear(6, 4)
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single", factor_decay=0.9)
    x = torch.randn(2, 6)  # 2 samples: A_batch has rank 2 of 7
    nn.functional.mse_loss(net(x), torch.zeros(2, 4)).backward()
    opt.step()
    a = torch.cat([x, torch.ones(2, 1)], 1)
    torch.testing.assert_close(opt.layers[0].A, 0.9 * torch.eye(7) + 0.1 * a.T @ a / 2)
    assert torch.linalg.matrix_rank(opt.layers[0].A) == 7
