"""Backward passes that do not compute a layer's weight gradient give it no ``G``: gradient penalties, PINN losses.

WGAN-GP, R1 and physics-informed losses take a derivative of the model's
output with respect to its input (``torch.autograd.grad(..., create_graph=True)``)
and put it in the loss. That pass goes through every layer's output with the
output gradient of another scalar than the loss (``Σ D(x̂)``, unscaled by
the batch), and counted in ``G`` it outweighed the loss's own output
gradients some thousand times. ``G`` now takes the output gradients of the
passes that compute the weight's gradient only; the reference here records
them with hooks of its own during ``loss.backward()`` and sums ``n gᵀg``
per use (:mod:`tests/unit/kfac/layer_reference`'s ``G`` of a Linear layer).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer

N = 16


def _critic() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


def _record_loss_gradients(model: nn.Module, seen: dict[str, list[torch.Tensor]], recording: list[bool]) -> None:
    """Keep every output gradient a Linear layer receives while ``recording[0]`` (the loss's backward pass)."""
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            seen[name] = []

            def forward_hook(m, args, out, name=name):
                out.register_hook(lambda g: seen[name].append(g.detach().clone()) if recording[0] else None)

            module.register_forward_hook(forward_hook)


@pytest.mark.parametrize("penalty_pass", ["autograd.grad", "backward(inputs=)"])
def test_a_gradient_penalty_pass_adds_nothing_to_g(penalty_pass, float64):
    """WGAN-GP's critic step: G is the sum over the critic's uses of the output gradients of ``loss.backward()``."""
    critic = _critic()
    opt = SPDKFACOptimizer(critic, lr=0.01, factor_decay=0.0, kl_clip=None, backend="single")
    seen: dict[str, list[torch.Tensor]] = {}
    recording = [False]
    _record_loss_gradients(critic, seen, recording)
    g = torch.Generator().manual_seed(1)
    real, fake = torch.randn(N, 4, generator=g) + 1, torch.randn(N, 4, generator=g)
    mix = torch.rand(N, 1, generator=g)
    x_hat = (mix * real + (1 - mix) * fake).requires_grad_(True)
    loss = critic(fake).mean() - critic(real).mean()
    if penalty_pass == "autograd.grad":
        (slope,) = torch.autograd.grad(critic(x_hat).sum(), x_hat, create_graph=True)
    else:
        critic(x_hat).sum().backward(inputs=[x_hat], create_graph=True)
        slope = x_hat.grad
    loss = loss + 10 * ((slope.norm(dim=1) - 1) ** 2).mean()
    recording[0] = True
    loss.backward()
    opt.step()
    layers = {layer.name: layer for layer in opt.layers}
    for name, grads in seen.items():
        assert grads, name
        expected = sum(N * gr.reshape(-1, gr.shape[-1]).T @ gr.reshape(-1, gr.shape[-1]) for gr in grads)
        torch.testing.assert_close(layers[name].G, expected, rtol=1e-10, atol=1e-12, msg=lambda m, n=name: f"G of {n}: {m}")
    assert len(seen["4"]) == 2  # the last layer's x̂ use gets no gradient from the penalty: fake and real only
    assert len(seen["0"]) == 3  # the first layer's x̂ use does, through tanh'


def test_autograd_grad_with_respect_to_the_weights_still_counts(float64):
    """``torch.autograd.grad(loss, params)`` computes the weights' gradients (a loop that writes ``p.grad`` itself):
    its G is the loss's, as from ``loss.backward()``."""
    results = []
    x, y = torch.randn(N, 4, generator=torch.Generator().manual_seed(2)), torch.randint(0, 1, (N,))
    for by_hand in (False, True):
        critic = _critic()
        opt = SPDKFACOptimizer(critic, lr=0.1, backend="single")
        for _ in range(2):
            opt.zero_grad()
            loss = ((critic(x).squeeze(1) - y) ** 2).mean()
            if by_hand:
                for p, grad in zip(critic.parameters(), torch.autograd.grad(loss, list(critic.parameters()))):
                    p.grad = grad
            else:
                loss.backward()
            opt.step()
        results.append([p.detach().clone() for p in critic.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))
