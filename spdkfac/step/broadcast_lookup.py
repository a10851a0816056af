"""Position embeddings looked up once and broadcast over the batch: found from the lookups' shapes, said once.

GPT-style code (nanoGPT, and most tutorials) adds the positions as
``wte(idx) + wpe(torch.arange(T))``: ``wpe`` runs once on a 1-D input and
its ``(T, E)`` output is broadcast over the batch. K-FAC then sees one
gradient there, the batch's sum, so ``G`` mixes the samples' gradients, and
N workers (each summing its own share) differ from one worker. The hooks
cannot see a broadcast, but this pattern has a signature: in one forward
pass an embedding takes exactly ``torch.arange(T)`` while the batch is ``N >=
2`` sequences of ``T``, ``N != T``, as another embedding's ``(N, T)`` token
ids or a Linear layer's ``(N, T, E)`` input show (the token embedding itself
may be no K-FAC layer: nanoGPT ties it to the head). Looking the positions up per sample,
``wpe(torch.arange(T).expand(N, T))``, gives the same output and the
per-sample gradients.

The check reads shapes only, except once per layer whether a 1-D lookup of a
matching length is ``arange`` (one comparison of ``T`` ids; the answer is
kept). It runs on factor steps, in the factor hooks.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["BroadcastLookups"]


class BroadcastLookups:
    """Watches the layers' inputs of each step; warns once per embedding that looks positions up for the whole batch."""

    def __init__(self) -> None:
        self._batched: dict[int, tuple[str, int]] = {}  # T -> (layer, N) of the first (N, T) sequences seen this step
        self._lone: dict[int, list[str]] = {}  # T -> layers that looked arange(T) up this step, awaiting an (N, T) one
        self._is_arange: dict[str, bool] = {}  # per layer: whether its 1-D lookup is arange (read once)
        self._said: set[str] = set()

    def reset(self) -> None:
        """A new step: the lookups seen so far belong to the last one."""
        self._batched.clear()
        self._lone.clear()

    def batch(self, name: str, batch: int, length: int) -> None:
        """Layer ``name`` took ``batch`` sequences of ``length`` in this step's forward pass (token ids ``(N, T)``,
        or a Linear layer's ``(N, T, E)``)."""
        if batch < 2 or batch == length or length in self._batched:
            return
        self._batched[length] = (name, batch)
        for lone in self._lone.pop(length, []):
            self._warn(lone, name, batch, length)

    def lookup(self, name: str, ids: torch.Tensor) -> None:
        """Embedding ``name`` looked up 1-D ``ids`` in this step's forward pass."""
        if ids.shape[0] < 2 or name in self._said or not self._arange(name, ids):
            return
        length = ids.shape[0]
        if length in self._batched:
            other, batch = self._batched[length]
            self._warn(name, other, batch, length)
        else:
            self._lone.setdefault(length, []).append(name)

    def _arange(self, name: str, ids: torch.Tensor) -> bool:
        known = self._is_arange.get(name)
        if known is None:
            known = self._is_arange[name] = bool(torch.equal(ids, torch.arange(ids.shape[0], device=ids.device, dtype=ids.dtype)))
        return known

    def _warn(self, name: str, tokens: str, batch: int, length: int) -> None:
        if name in self._said:
            return
        self._said.add(name)
        warnings.warn(
            f"embedding {name!r} looked up torch.arange({length}) once, in a forward pass where {tokens!r} took a batch "
            f"of {batch} sequences of {length}: its output is presumably broadcast over the batch (position embeddings). "
            f"K-FAC then sees the batch's summed gradient there as one sample: its G mixes the samples, and N workers "
            f"differ from one. Look the positions up per sample, {name}(torch.arange({length}).expand({batch}, {length})) "
            "with the batch's size (the same output); docs/layers.md. This is said once",
            stacklevel=2,
        )
