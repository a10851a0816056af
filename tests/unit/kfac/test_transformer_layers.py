"""torch's transformer layers count the batch as their samples, whatever ``batch_first`` says.

With ``batch_first=False`` (torch's default) ``linear1``, ``linear2`` and the
norms of ``nn.TransformerEncoderLayer``/``DecoderLayer`` see ``(L, N, E)``
tensors; counted along the first dimension their ``G = n gᵀg`` took
``n = L``, so a sequence-first model trained otherwise than its batch-first
twin (2e-5 apart in float64 after 4 steps). The reference here is that twin,
and ``G`` recomputed from the output gradients a hook of its own records.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.kfac.layer_types.transformer_layers import sequence_layouts

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

L, N, E, S = 7, 3, 8, 5  # target length, batch, width, memory length


class _Seq2Seq(nn.Module):
    """torch's encoder and decoder (two layers each, final norms), mean-pooled into a Linear head."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        encoder = nn.TransformerEncoderLayer(E, 2, 16, dropout=0.0, batch_first=batch_first)
        decoder = nn.TransformerDecoderLayer(E, 2, 16, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(encoder, 2, norm=nn.LayerNorm(E), enable_nested_tensor=False)
        self.decoder = nn.TransformerDecoder(decoder, 2, norm=nn.LayerNorm(E))
        self.head = nn.Linear(E, 3)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        """``src``/``tgt`` given batch-first ``(N, len, E)`` or unbatched ``(len, E)``, laid out as the layers want;
        the decoder's output pooled over the target positions."""
        first = self.batch_first or src.dim() == 2
        if not first:
            src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
        out = self.decoder(tgt, self.encoder(src))
        return self.head(out.mean(0 if out.dim() == 2 or not first else 1))


def _train(model: _Seq2Seq, batched: bool, norm_layers: str, steps: int = 4) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    shape = (N,) if batched else ()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single", norm_layers=norm_layers)
    for _ in range(steps):
        src, tgt = torch.randn(*shape, S, E, generator=g), torch.randn(*shape, L, E, generator=g)
        y = torch.randint(0, 3, shape, generator=g)
        opt.zero_grad()
        F.cross_entropy(model(src, tgt), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("norm_layers", ["plain", "kfac"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_a_sequence_first_model_trains_as_its_batch_first_twin(norm_layers, batched, float64):
    first, second = (_train(_Seq2Seq(batch_first), batched, norm_layers) for batch_first in (True, False))
    assert not torch.equal(first[0], _Seq2Seq(True).state_dict()["encoder.layers.0.self_attn.in_proj_weight"])  # (it trained)
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_the_feed_forward_layers_g_is_n_times_the_gram_of_their_output_gradients(batch_first, batched, float64):
    """G of ``linear1`` after one step without a running average: ``n gᵀg`` over its output-gradient rows, ``n`` the
    batch (one for an unbatched sequence), from a hook of the test's own."""
    model = _Seq2Seq(batch_first)
    linear1 = model.encoder.layers[0].linear1
    seen: list[torch.Tensor] = []

    def record(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        out.register_hook(lambda grad: seen.append(grad.detach().clone()))

    linear1.register_forward_hook(record)
    opt = SPDKFACOptimizer(model, lr=0.1, factor_decay=0.0, backend="single")
    g = torch.Generator().manual_seed(2)
    shape = (N,) if batched else ()
    src, tgt, y = torch.randn(*shape, S, E, generator=g), torch.randn(*shape, L, E, generator=g), torch.randint(0, 3, shape, generator=g)
    F.cross_entropy(model(src, tgt), y).backward()
    opt.step()
    (grad,) = seen
    rows = grad.reshape(-1, grad.shape[-1])
    n = N if batched else 1
    layer = next(la for la in opt.layers if la.name == "encoder.layers.0.linear1")
    assert layer.local_samples == n
    torch.testing.assert_close(layer.G, n * rows.T @ rows, rtol=1e-12, atol=1e-14)


def test_only_torchs_own_transformer_layers_are_marked():
    """A subclass with a feed-forward block of its own may lay its tensors out otherwise: left to the layers' own
    convention, as is every module outside torch's transformer layers."""

    class OwnBlock(nn.TransformerEncoderLayer):
        def _ff_block(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear2(F.relu(self.linear1(x)))

    torch.manual_seed(0)
    plain = nn.TransformerEncoderLayer(E, 2, 16, batch_first=False)
    own = OwnBlock(E, 2, 16, batch_first=False)
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(E, 2, 16, batch_first=True), 2, norm=nn.LayerNorm(E), enable_nested_tensor=False
    )
    layouts = sequence_layouts(nn.ModuleList([plain, own, encoder, nn.Linear(E, E)]))
    assert {layouts[m] for m in (plain.linear1, plain.linear2, plain.norm1, plain.norm2)} == {"sequence_first"}
    assert not any(m in layouts for m in own.modules())
    assert layouts[encoder.norm] == "batch_first"
    assert {layouts[m] for layer in encoder.layers for m in (layer.linear1, layer.norm2)} == {"batch_first"}
    assert len(layouts) == 4 + 1 + 2 * 4
