"""``--data pycode``: next-character prediction on Python's own library source, and ``char_gpt``, its causal model;
``--data pycode-words``: the same text as words, and ``tied_llama``."""

from __future__ import annotations

import os
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import get_backend
from spdkfac.comm.inprocess import run_ranks
from spdkfac.models import get_model
from spdkfac.models.modern import CharGPT
from spdkfac.train.data import PYCODE_VOCAB, load_pycode, load_pycode_words
from spdkfac.train.loop import EpochTotals, TrainingStep, evaluate

pytestmark = pytest.mark.filterwarnings("ignore:no perf_model given")


def test_windows_are_next_characters_of_the_library_text_split_by_the_seed():
    train, test = load_pycode(context=16, max_bytes=20_000, seed=3)
    assert train.x.shape[1:] == test.y.shape[1:] == (16,)
    assert len(train) + len(test) == 20_000 // 17
    assert len(test) == (20_000 // 17) // 10
    assert train.num_classes == PYCODE_VOCAB
    assert torch.equal(train.x[:, 1:], train.y[:, :-1])  # y is x moved on by one character
    for split in (train, test):
        assert int(split.x.min()) >= 0
        assert int(split.x.max()) < PYCODE_VOCAB
    assert (train.x == 0).any()  # newlines (id 0) are there: the text is source code
    again, _ = load_pycode(context=16, max_bytes=20_000, seed=3)
    assert torch.equal(again.x, train.x)
    other, other_test = load_pycode(context=16, max_bytes=20_000, seed=4)
    assert not torch.equal(other.x, train.x)  # another split of the same windows
    assert sorted(map(tuple, other.x.tolist() + other_test.x.tolist())) == sorted(map(tuple, train.x.tolist() + test.x.tolist()))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="test_fraction"):
        load_pycode(test_fraction=1.0)
    with pytest.raises(ValueError, match="too little text"):
        load_pycode(context=64, max_bytes=100)
    with pytest.raises(ValueError, match="test_fraction"):
        load_pycode_words(test_fraction=0.0)
    with pytest.raises(ValueError, match="vocab must be at least 2"):
        load_pycode_words(vocab=1)
    with pytest.raises(ValueError, match="too little text for windows of 65 tokens"):
        load_pycode_words(max_bytes=100)


def test_words_are_the_most_frequent_tokens_of_the_text_and_the_rest_is_id_0():
    train, test = load_pycode_words(context=16, vocab=50, max_bytes=20_000, seed=3)
    assert train.num_classes == test.num_classes == 50
    assert torch.equal(train.x[:, 1:], train.y[:, :-1])  # y is x moved on by one token
    # From the definition: identifiers, numbers, runs of spaces, newlines, other characters; the 49 most frequent
    # (by count, then text) are ids 1-49, the rest 0; windows of 17.
    text = "".join(p.read_text("latin-1") for p in sorted(Path(os.__file__).parent.glob("*.py")))[:20_000]
    words = re.findall(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+| +|\n|[^A-Za-z0-9_ \n]", text)
    counts = Counter(words)
    index = {w: i + 1 for i, w in enumerate(sorted(counts, key=lambda w: (-counts[w], w))[:49])}
    ids = torch.tensor([index.get(w, 0) for w in words])
    expected = ids[: len(ids) // 17 * 17].view(-1, 17)
    got = torch.cat([torch.cat([train.x, train.y[:, -1:]], 1), torch.cat([test.x, test.y[:, -1:]], 1)])
    assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, expected.tolist()))
    assert (expected == 0).any()
    assert index[" "] < 10  # (source code: a space among the commonest tokens)
    again, _ = load_pycode_words(context=16, vocab=50, max_bytes=20_000, seed=3)
    assert torch.equal(again.x, train.x)


def test_tied_llama_holds_one_weight_for_its_embedding_and_head():
    model = get_model("tied_llama", num_classes=300)
    assert model.head.weight is model.tokens.weight
    opt = SPDKFACOptimizer(model, lr=0.01, backend="single")
    assert opt.layers[0].tied_output is opt.layers[-1]
    ids = torch.randint(0, 300, (2, 10))
    assert model(ids).shape == (2, 300, 10)


def test_char_gpt_is_causal_and_returns_logits_per_position():
    torch.manual_seed(0)
    model = get_model("char_gpt").eval()
    ids = torch.randint(0, PYCODE_VOCAB, (3, 20))
    out = model(ids)
    assert out.shape == (3, PYCODE_VOCAB, 20)
    later = ids.clone()
    later[:, 12:] = (later[:, 12:] + 1) % PYCODE_VOCAB
    changed = model(later)
    torch.testing.assert_close(changed[..., :12], out[..., :12])  # no position sees the ones after it
    assert not torch.allclose(changed[..., 12:], out[..., 12:])
    with pytest.raises(ValueError, match="up to 64 tokens"):
        model(torch.zeros(1, 65, dtype=torch.long))


def test_the_loop_counts_every_position_of_a_sequence():
    """Loss and accuracy per predicted character: count is N x T, as the logits' (N, V, T) layout gives it."""
    torch.manual_seed(0)
    model = CharGPT(PYCODE_VOCAB, context=8, dim=16, depth=1, heads=2, mlp_dim=32)
    x, y = torch.randint(0, PYCODE_VOCAB, (6, 8)), torch.randint(0, PYCODE_VOCAB, (6, 8))
    totals = EpochTotals()
    step = TrainingStep(model, torch.optim.SGD(model.parameters(), lr=0.0), 0.0)
    step(x, y, totals)
    assert totals.count == 48
    expected = nn.functional.cross_entropy(model(x), y, reduction="sum").item()
    assert totals.loss_sum == pytest.approx(expected, rel=1e-5)
    loss, acc = evaluate(model, [(x, y)], get_backend("single"))
    assert loss == pytest.approx(expected / 48, rel=1e-5)
    assert acc == pytest.approx(float((model(x).argmax(1) == y).float().mean()))


@pytest.mark.usefixtures("float64")
def test_two_workers_train_char_gpt_as_one_process():
    """Token and position embeddings, causal self-attention and an untied head: 2 in-process workers equal one
    process on the global batch and stay bitwise replicas."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return CharGPT(PYCODE_VOCAB, context=8, dim=16, depth=2, heads=2, mlp_dim=32)

    x, y = torch.randint(0, PYCODE_VOCAB, (8, 8)), torch.randint(0, PYCODE_VOCAB, (8, 8))

    def train(model: nn.Module, backend, rows: slice) -> list[torch.Tensor]:
        opt = SPDKFACOptimizer(model, lr=0.05, damping=0.01, kl_clip=0.01, base="adamw", backend=backend, profile_steps=1)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    single = train(build(), "single", slice(None))
    models = [build(), build()]
    ranks = run_ranks(2, lambda b: train(models[b.rank], b, slice(4 * b.rank, 4 * b.rank + 4)))
    for a, b, s in zip(ranks[0], ranks[1], single):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, s, rtol=1e-9, atol=1e-11)
