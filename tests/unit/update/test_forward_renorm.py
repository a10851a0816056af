"""Embeddings with ``max_norm`` rewrite the rows each worker looks up in its forward pass: refused on several workers.

Measured here first, so the refusal is about a real difference: with the
refusal switched off, 2 in-process workers hold different parameters (no
replicas) after 3 steps. One worker trains as before.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm.inprocess import RankError, run_ranks
from spdkfac.update import forward_renorm

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")

X = torch.randint(0, 20, (8, 3), generator=torch.Generator().manual_seed(1))
Y = torch.randint(0, 5, (8,), generator=torch.Generator().manual_seed(2))


class Bag(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.emb = (
            nn.EmbeddingBag(20, 8, max_norm=1.0) if kind == "bag" else nn.Embedding(20, 8, max_norm=1.0 if kind == "max_norm" else None)
        )
        self.head = nn.Linear(8, 5)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pooled = self.emb(idx) if self.kind == "bag" else self.emb(idx).mean(1)
        return self.head(torch.tanh(pooled))


def _train(model: Bag, backend, rows: slice = slice(None)) -> list[torch.Tensor]:
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, backend=backend)
    for s in range(3):
        opt.zero_grad()
        F.cross_entropy(model((X[rows] + s) % 20), Y[rows]).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _two_workers(kind: str) -> list[list[torch.Tensor]]:
    models = [Bag(kind), Bag(kind)]
    return run_ranks(2, lambda b: _train(models[b.rank], b, slice(4 * b.rank, 4 * b.rank + 4)))


@pytest.mark.parametrize("kind", ["max_norm", "bag"])
def test_max_norm_is_refused_on_two_workers_by_name(kind):
    with pytest.raises(
        RankError, match=r"ValueError: embedding\(s\) 'emb' \(max_norm=1\) renormalise, in place .* on 2 workers the replicas would drift"
    ):
        _two_workers(kind)


def test_the_preconditioner_for_any_optimizer_refuses_it_too():
    models = [Bag("max_norm"), Bag("max_norm")]
    with pytest.raises(RankError, match=r"ValueError: embedding\(s\) 'emb' \(max_norm=1\)"):
        run_ranks(2, lambda b: KFACPreconditioner(models[b.rank], backend=b))


def test_one_worker_trains_and_the_refusal_is_about_a_real_drift(monkeypatch):
    _train(Bag("max_norm"), "single")  # (one worker: accepted)
    monkeypatch.setattr(forward_renorm, "refuse_forward_renorm", lambda model, workers: None)
    monkeypatch.setattr("spdkfac.optimizer.refuse_forward_renorm", lambda model, workers: None)
    ranks = _two_workers("max_norm")
    assert not all(torch.equal(a, b) for a, b in zip(*ranks))  # the replicas drift apart
    plain = _two_workers("plain")
    assert all(torch.equal(a, b) for a, b in zip(*plain))
