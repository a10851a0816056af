"""An embedding whose weight also serves outside its forward (a tied head written ``x @ emb.weight.T``) is said once.

Its factors describe only the lookups: the rows no token looked up have
``A = 0`` and their gradient from the head is multiplied by ``1/damping``. A
tied head written as a module is found at construction (the base update,
tests/unit/kfac/test_layer_selection.py); written as a product it can only be
seen in the gradient, at the first factor step.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

V, D, T = 40, 8, 6
OPTS = dict(lr=0.05, damping=0.01, kl_clip=0.01, profile_steps=1)
OUTSIDE = r"'wte' \(Embedding\) has gradient in rows of tokens it never looked up"


class TinyLM(nn.Module):
    def __init__(self, head: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.wte = nn.Embedding(V, D, padding_idx=0 if head == "padding" else None)
        self.mlp = nn.Linear(D, D)
        self.head_kind = head
        if head in ("linear", "padding"):
            self.head = nn.Linear(D, V)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mlp(self.wte(idx)))
        return h @ self.wte.weight.T if self.head_kind == "product" else self.head(h)


def _tokens(seed: int, n: int = 8) -> torch.Tensor:
    return torch.randint(1, V // 2, (n, T + 1), generator=torch.Generator().manual_seed(seed))  # half the rows unseen


def _steps(model: nn.Module, opt: SPDKFACOptimizer, data: torch.Tensor, steps: int = 3) -> None:
    for s in range(steps):
        opt.zero_grad()
        batch = (data + s) % V
        F.cross_entropy(model(batch[:, :-1]).reshape(-1, V), batch[:, 1:].reshape(-1)).backward()
        opt.step()


@pytest.mark.parametrize("method", ["inverse", "eigen"])
def test_a_head_written_as_a_product_is_said_once_at_the_first_factor_step(method):
    model = TinyLM("product")
    opt = SPDKFACOptimizer(model, backend="single", compute_method=method, factor_update_freq=2, inv_update_freq=2, **OPTS)
    with pytest.warns(UserWarning, match=OUTSIDE) as record:
        _steps(model, opt, _tokens(1))
    assert sum("never looked up" in str(w.message) for w in record) == 1
    assert "skip_layers=['wte']" in str(next(w for w in record if "never looked up" in str(w.message)).message)
    assert next(w for w in record if "never looked up" in str(w.message)).filename == __file__  # the step() call


@pytest.mark.parametrize("head", ["linear", "padding"])
def test_an_embedding_used_only_by_its_lookups_says_nothing(head):
    """Half the vocabulary never looked up, and a padding row: their gradient is zero, nothing to say."""
    model = TinyLM(head)
    opt = SPDKFACOptimizer(model, backend="single", **OPTS)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*never looked up.*")
        _steps(model, opt, _tokens(1))


def test_two_workers_count_each_others_lookups():
    """Each worker's tokens are rows the other never looked up: the union of the lookups decides, nothing is said."""
    models = [TinyLM("linear") for _ in range(2)]
    shards = [torch.randint(1, V // 2, (4, T + 1)), torch.randint(V // 2, V, (4, T + 1))]

    def rank(backend):
        model = models[backend.rank]
        opt = SPDKFACOptimizer(model, backend=backend, **OPTS)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            _steps(model, opt, shards[backend.rank], steps=1)
        return [str(w.message) for w in record if "never looked up" in str(w.message)]

    assert run_ranks(2, rank) == [[], []]
