"""Position embeddings looked up once, ``wpe(torch.arange(T))``, and broadcast over the batch: said once, by name.

GPT-style code (nanoGPT) adds them so; K-FAC then sees the batch's summed
gradient as one sample there, and 2 workers differ from one (measured here,
so the warning is about a real difference). Looked up per sample the same
model trains alike on 2 workers and one, and nothing is said; nor for an
unbatched model, labels looked up per sample, or positions at an offset.
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

V, T, E, N = 13, 6, 8, 4
SAID = r"embedding 'wpe' looked up torch.arange\(6\) once, in a forward pass where '(wte|mlp)' took a batch of 4 sequences of 6"


class TinyGPT(nn.Module):
    """Token and position embeddings, one Linear layer, a head; ``positions`` says how the positions are looked up."""

    def __init__(self, positions: str, tied: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.positions = positions
        self.wte = nn.Embedding(V, E)
        self.wpe = nn.Embedding(T + 2, E)
        self.mlp = nn.Linear(E, E)
        self.head = nn.Linear(E, V, bias=not tied)
        if tied:  # nanoGPT's: one K-FAC layer of two uses (docs/shared-layers.md)
            self.wte.weight = self.head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[-1]
        if self.positions == "broadcast":  # nanoGPT's
            h = self.wte(idx) + self.wpe(torch.arange(t))
        elif self.positions == "positions-first":  # the same, the positions looked up before the tokens
            p = self.wpe(torch.arange(t))
            h = self.wte(idx) + p
        elif self.positions == "per-sample":
            h = self.wte(idx) + self.wpe(torch.arange(t).expand(*idx.shape[:-1], t))
        else:  # "offset": positions 2..t+1 (not arange(t): not this pattern)
            h = self.wte(idx) + self.wpe(torch.arange(2, t + 2))
        return self.head(torch.tanh(self.mlp(h)))


def _data(steps: int = 3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (N, T + 1), generator=g) for _ in range(steps)]


def _train(model: TinyGPT, backend, rows: slice = slice(None), unbatched: bool = False, skip=()) -> list[torch.Tensor]:
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, kl_clip=0.01, backend=backend, skip_layers=skip)
    for ids in _data():
        ids = ids[0] if unbatched else ids[rows]
        opt.zero_grad()
        F.cross_entropy(model(ids[..., :-1]).reshape(-1, V), ids[..., 1:].reshape(-1)).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _said(positions: str, unbatched: bool = False, tied: bool = False, skip=()) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(TinyGPT(positions, tied), "single", unbatched=unbatched, skip=skip)
    return [str(w.message) for w in caught if "looked up torch.arange" in str(w.message)]


@pytest.mark.parametrize(
    ("positions", "tied", "skip", "batch_seen_by"),
    [
        ("broadcast", False, (), "wte"),
        ("positions-first", False, (), "wte"),
        ("broadcast", True, (), "wte"),
        ("broadcast", True, ("wte", "head"), "mlp"),  # (the token embedding no K-FAC layer: a Linear layer shows the batch)
    ],
)
def test_positions_looked_up_once_for_the_batch_are_said_once(positions, tied, skip, batch_seen_by):
    said = _said(positions, tied=tied, skip=skip)
    assert len(said) == 1  # three factor steps: once
    found = re.search(SAID, said[0])
    assert found, said[0]
    assert found.group(1) == batch_seen_by
    assert "wpe(torch.arange(6).expand(4, 6))" in said[0]


@pytest.mark.parametrize(("positions", "unbatched"), [("per-sample", False), ("offset", False), ("broadcast", True)])
def test_per_sample_offset_and_unbatched_lookups_are_not_said(positions, unbatched):
    assert _said(positions, unbatched) == []


def test_labels_looked_up_per_sample_are_not_said():
    """A 1-D lookup of one id per sample (class labels, a diffusion timestep) is no broadcast, whatever its length."""

    class Conditioned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.wte = nn.Embedding(V, E)
            self.label = nn.Embedding(T, E)
            self.head = nn.Linear(E, V)

        def forward(self, idx: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.head(self.wte(idx) + self.label(labels)[:, None, :])

    model = Conditioned()
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    ids = torch.randint(0, V, (T, T), generator=torch.Generator().manual_seed(2))  # T samples of T tokens: lengths alike
    labels = torch.tensor([5, 3, 0, 1, 2, 4])  # one label per sample, not in order
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", "no perf_model given")
        F.cross_entropy(model(ids, labels).reshape(-1, V), ids.reshape(-1)).backward()
        opt.step()


def test_what_is_said_is_so_two_workers_differ_from_one_with_the_broadcast_not_per_sample(float64):
    for positions, alike in (("broadcast", False), ("per-sample", True)):
        single = _train(TinyGPT(positions), "single")
        models = [TinyGPT(positions) for _ in range(2)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ranks = run_ranks(2, lambda b, models=models: _train(models[b.rank], b, slice(2 * b.rank, 2 * b.rank + 2)))
        apart = max(float((a - s).abs().max()) for a, s in zip(ranks[0], single))
        assert (apart < 1e-10) == alike, (positions, apart)
