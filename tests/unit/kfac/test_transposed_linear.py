"""Hugging Face's ``Conv1D`` (GPT-2's layers): a Linear layer with its weight stored ``(in, out)``.

Factors and update against the float64 reference of :mod:`layer_reference`
(a Linear layer on a sequence: ``A`` the mean of the input rows' outer
products with a ones column, ``G = n Σ g gᵀ``, the dense Kronecker solve),
with the gradient matrix read from the ``(in, out)`` weight by hand. The
class is looked up by its import path, so the tests put a stand-in
``transformers.pytorch_utils`` module (a ``Conv1D`` written from its
definition, ``y = x @ W + b``) in ``sys.modules`` where transformers is not
installed, and run on the real class as well where it is.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn as nn
from layer_reference import factors, update
from one_step import kfac_step

import spdkfac.kfac.layer_types as layer_types
from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks
from spdkfac.kfac.layer_types import TransposedLinearHelper, make_helper
from spdkfac.step.gradient_views import GradientWrites, StackedGradients

DAMPING, DECAY = 0.05, 0.5


class Conv1D(nn.Module):
    """``y = x @ weight + bias`` on the last dimension, ``weight`` of shape ``(nx, nf)`` (GPT-2's layer, by definition)."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.3)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.reshape(-1, x.shape[-1]) @ self.weight + self.bias).reshape(*x.shape[:-1], self.nf)


@pytest.fixture(params=["stand-in", "transformers"])
def conv1d(request, monkeypatch) -> type[nn.Module]:
    """The ``Conv1D`` class under test, its library loaded (a stand-in module, or transformers itself)."""
    monkeypatch.setattr(layer_types, "HELPERS", dict(layer_types.HELPERS))  # the registration ends with the test
    if request.param == "transformers":
        return pytest.importorskip("transformers.pytorch_utils").Conv1D
    Conv1D.__module__ = "transformers.pytorch_utils"
    fake = types.ModuleType("transformers.pytorch_utils")
    fake.Conv1D = Conv1D  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "transformers.pytorch_utils", fake)
    return Conv1D


@pytest.mark.parametrize("method", ["inverse", "eigen"])
@pytest.mark.parametrize("shape", [(3, 5, 4), (6, 4)], ids=["sequence", "flat"])
def test_factors_and_update_match_the_reference(conv1d, shape, method, float64):
    torch.manual_seed(0)
    module = conv1d(3, 4).double()  # nf=3 outputs, nx=4 inputs
    with torch.no_grad():
        module.bias.normal_()  # GPT-2's starts at zero
    x = torch.randn(shape)
    grad_out, grads, change, opt = kfac_step(module, x, method, DAMPING, DECAY)
    (layer,) = opt.layers
    assert isinstance(layer.helper, TransposedLinearHelper)
    n = x.shape[0]
    a_rows, g_rows = x.reshape(-1, 4), grad_out.reshape(-1, 3)
    grad = torch.cat([grads["weight"].T, grads["bias"].unsqueeze(1)], dim=1)  # (out, in + 1), read by hand
    torch.testing.assert_close(g_rows.T @ torch.cat([a_rows, torch.ones(len(a_rows), 1)], 1), grad)  # the rows are the layer's
    A, G = factors(a_rows, g_rows, n, bias=True, shared=False)
    A = DECAY * torch.eye(5) + (1 - DECAY) * A
    G = DECAY * torch.eye(3) + (1 - DECAY) * G
    torch.testing.assert_close(layer.A, A, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(layer.G, G, rtol=1e-10, atol=1e-12)
    expected = update(A, G, grad, DAMPING, method)
    torch.testing.assert_close(change["weight"], expected[:, :-1].T, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(change["bias"], expected[:, -1], rtol=1e-8, atol=1e-10)


def _gpt_block(conv1d: type[nn.Module]) -> nn.Module:
    """An embedding, GPT-2's four Conv1D layers of a block (attention's fused q/k/v and output, the MLP) and a head."""
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte = nn.Embedding(11, 8)
            self.c_attn, self.c_proj = conv1d(24, 8), conv1d(8, 8)
            self.c_fc, self.mlp_proj = conv1d(16, 8), conv1d(8, 16)
            self.head = nn.Linear(8, 11)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            h = self.wte(tokens)
            q, k, v = self.c_attn(h).split(8, dim=-1)
            scores = (q @ k.transpose(-2, -1) / 8**0.5).softmax(-1)
            h = h + self.c_proj(scores @ v)
            h = h + self.mlp_proj(torch.tanh(self.c_fc(h)))
            return self.head(h)

    return Block()


def _train(model: nn.Module, backend, tokens: torch.Tensor, **options) -> list[torch.Tensor]:
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, backend=backend, **options)
    for _ in range(3):
        opt.zero_grad()
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.reshape(-1, 11), tokens[:, 1:].reshape(-1)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_a_gpt_block_is_preconditioned_and_two_workers_equal_one(conv1d, float64):
    """Every Conv1D is a K-FAC layer; 2 in-process ranks on halves of the batch equal one process, bitwise replicas."""
    tokens = torch.randint(0, 11, (4, 6), generator=torch.Generator().manual_seed(1))
    model = _gpt_block(conv1d)
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    assert [layer.name for layer in opt.layers] == ["wte", "c_attn", "c_proj", "c_fc", "mlp_proj", "head"]
    assert "4 x Conv1D (a Linear layer with its weight stored transposed)" in opt.kfac_summary()
    del opt
    init = [p.detach().clone() for p in _gpt_block(conv1d).parameters()]
    single = _train(_gpt_block(conv1d), "single", tokens)
    assert all(not torch.equal(a, b) for a, b in zip(single, init))
    for options in ({"placement": "lbp"}, {"distribute_preconditioning": True}):
        models = [_gpt_block(conv1d) for _ in range(2)]
        ranks = run_ranks(2, lambda b, o=options, m=models: _train(m[b.rank], b, tokens[2 * b.rank : 2 * b.rank + 2], **o))
        for got, want in zip(ranks[0], single):
            torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)
        assert all(torch.equal(a, b) for a, b in zip(*ranks))


def test_without_the_library_loaded_nothing_is_registered(monkeypatch):
    """The class is found by its import path only once its module is loaded: spdkfac never imports transformers."""
    monkeypatch.setattr(layer_types, "HELPERS", dict(layer_types.HELPERS))
    monkeypatch.delitem(sys.modules, "transformers.pytorch_utils", raising=False)
    Conv1D.__module__ = "transformers.pytorch_utils"
    assert make_helper(Conv1D(3, 4)) is None
    assert "transformers.pytorch_utils" not in sys.modules


def test_a_subclass_with_its_own_forward_and_a_malformed_layer_are_left_out(conv1d):
    class Scaled(conv1d):  # type: ignore[misc, valid-type]
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(2 * x)

    class Same(conv1d):  # type: ignore[misc, valid-type]
        pass

    assert make_helper(Scaled(3, 4)) is None
    assert isinstance(make_helper(Same(3, 4)), TransposedLinearHelper)
    odd = conv1d(3, 4)
    odd.bias = nn.Parameter(torch.zeros(4))
    assert make_helper(odd) is None
    assert layer_types.unsupported_reason(odd) == "a bias that is not one value per output feature (3)"


def test_gradient_views_are_the_transposed_weight_and_the_bias(conv1d):
    """Same-shape Conv1D layers are read and written as one stack (views of their gradients): what each layer's
    own grad_matrix() reads and write_grad() leaves, bitwise."""
    torch.manual_seed(0)
    parts = nn.ModuleList(conv1d(3, 4) for _ in range(2))
    opt = SPDKFACOptimizer(parts, backend="single", lr=0.1, damping=DAMPING)
    x = torch.randn(5, 4)
    sum(part(x).pow(2).sum() for part in parts).backward()
    gradients = StackedGradients.of(opt.layers)
    assert gradients is not None
    assert torch.equal(gradients.read(), torch.stack([layer.grad_matrix() for layer in opt.layers]))
    updates = torch.randn(2, 3, 5)
    writes = GradientWrites()
    writes.add_stack(gradients, updates)
    writes.write()
    for part, written in zip(parts, updates):
        assert torch.equal(part.weight.grad, written[:, :-1].T)
        assert torch.equal(part.bias.grad, written[:, -1])
