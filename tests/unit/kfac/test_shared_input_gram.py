"""Linear layers that read one input in a row (Llama-style q/k/v, a gated MLP's gate and up) compute its Gram once.

The reference is the same optimizer with the cache switched off (every Gram
computed, the path the float64 reference tests check): the parameters must
be bitwise equal, and the number of Grams computed per factor step must drop
to one per distinct input.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.layer_types import LinearHelper, shared_input
from spdkfac.kfac.layer_types.shared_input import SharedInputGram, compiled_buffers
from spdkfac.step import compiled_hooks

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

N, T, E, H = 4, 5, 8, 2


class LlamaBlock(nn.Module):
    """Pre-norm attention with separate q, k, v projections and a SwiGLU MLP, as Hugging Face's Llama writes them."""

    def __init__(self, k_bias: bool = False) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(E), nn.RMSNorm(E)
        self.q_proj = nn.Linear(E, E, bias=False)
        self.k_proj = nn.Linear(E, E, bias=k_bias)
        self.v_proj = nn.Linear(E, E, bias=False)
        self.o_proj = nn.Linear(E, E, bias=False)
        self.gate_proj = nn.Linear(E, 2 * E, bias=False)
        self.up_proj = nn.Linear(E, 2 * E, bias=False)
        self.down_proj = nn.Linear(2 * E, E, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        q, k, v = (p(h).view(N, T, H, E // H).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        x = x + self.o_proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(N, T, E))
        h = self.norm2(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TinyLlama(nn.Module):
    def __init__(self, k_bias: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, E)
        self.blocks = nn.Sequential(LlamaBlock(k_bias), LlamaBlock(k_bias))
        self.head = nn.Linear(E, 11, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(idx)))


def _train(share: bool, k_bias: bool, monkeypatch: pytest.MonkeyPatch, steps: int = 3) -> tuple[list[torch.Tensor], list[int], bool]:
    """Parameters after ``steps``, the Grams computed (their widths), and whether the cache held anything after a step."""
    computed: list[int] = []
    compute = LinearHelper._input_gram

    def counted(helper: LinearHelper, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        computed.append(x.shape[-1])
        return compute(helper, x, dtype)

    held_after_step = False
    with monkeypatch.context() as patch:
        patch.setattr(LinearHelper, "_input_gram", counted)
        if not share:
            patch.setattr(SharedInputGram, "gram", lambda self, x, dtype, ones, compute: compute())
        model = TinyLlama(k_bias)
        opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, kl_clip=0.01, backend="single")
        g = torch.Generator().manual_seed(1)
        for _ in range(steps):
            idx = torch.randint(0, 11, (N, T + 1), generator=g)
            opt.zero_grad()
            F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten()).backward()
            opt.step()
            shared = opt.layers[-1].helper.shared
            held_after_step |= shared is not None and shared._input is not None
    return [p.detach().clone() for p in model.parameters()], computed, held_after_step


@pytest.mark.parametrize("k_bias", [False, True], ids=["no-bias", "k-with-bias"])
def test_layers_reading_one_input_compute_its_gram_once_and_step_bitwise_alike(k_bias, float64, monkeypatch):
    shared, calls_shared, held = _train(True, k_bias, monkeypatch)
    apart, calls_apart, _ = _train(False, k_bias, monkeypatch)
    for a, b in zip(shared, apart, strict=True):
        assert torch.equal(a, b)
    per_block_apart = 7  # q, k, v, o, gate, up, down
    assert len(calls_apart) == 3 * (2 * per_block_apart + 1)
    # Shared: q/k/v one Gram (and k one with its bias column), o, gate/up one, down.
    per_block_shared = 4 + (1 if k_bias else 0)
    assert len(calls_shared) == 3 * (2 * per_block_shared + 1)
    assert not held  # the step's end lets go of the input


def test_a_shared_gram_is_not_reused_for_other_values():
    shared = SharedInputGram()
    x = torch.randn(4, 3)

    def compute(t: torch.Tensor, ones: float = 0.0):
        return lambda: (t.T @ t + ones, t.shape[0])

    first, _ = shared.gram(x, torch.float32, False, compute(x))
    assert torch.equal(shared.gram(x.detach(), torch.float32, False, compute(x))[0], first)  # the same values: a copy
    # Another dtype or a ones column: computed anew.
    assert torch.equal(shared.gram(x, torch.float64, False, compute(x, 1.0))[0], first + 1.0)
    assert torch.equal(shared.gram(x, torch.float64, True, compute(x, 2.0))[0], first + 2.0)
    x.add_(1.0)  # changed in place: computed anew
    assert torch.equal(shared.gram(x, torch.float64, True, compute(x))[0], x.T @ x)
    y = x[:, :2]  # a view with other values
    assert torch.equal(shared.gram(y, torch.float64, True, compute(y))[0], y.T @ y)
    shared.forget()
    assert torch.equal(shared.gram(y, torch.float64, True, compute(y, 3.0))[0], y.T @ y + 3.0)


def test_a_compiled_graphs_buffers_never_reuse_a_gram():
    """Inside a compiled graph the same address and version may hold new values (inductor reuses buffers)."""
    shared = SharedInputGram()
    x = torch.randn(4, 3)
    first, _ = shared.gram(x, torch.float32, False, lambda: (x.T @ x, 4))
    with compiled_buffers():
        assert torch.equal(shared.gram(x, torch.float32, False, lambda: (first + 1.0, 4))[0], first + 1.0)
    assert torch.equal(shared.gram(x, torch.float32, False, lambda: (first + 1.0, 4))[0], first)  # eager again: reused


def test_a_taps_hook_runs_with_compiled_buffers():
    """The compiled graph's tap calls the factor hook inside :func:`compiled_buffers` (its wiring, without compiling)."""
    seen: list[bool] = []
    compiled_hooks._call_with_grad(lambda module, inputs: seen.append(shared_input._COMPILED.get()), nn.Identity(), [])
    assert seen == [True]
    assert not shared_input._COMPILED.get()
