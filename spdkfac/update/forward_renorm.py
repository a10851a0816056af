"""Embeddings that rewrite their own weight in the forward pass (``max_norm``) are refused on several workers.

``nn.Embedding(max_norm=...)`` and ``nn.EmbeddingBag(max_norm=...)``
renormalise, in place and during the forward pass, the rows that the batch
looks up. On several workers each renormalises the rows of its own batch,
so the replicas drift apart from the first step on (measured: 2 workers 1.2
apart from one worker after 3 steps of a small model, and not replicas of
each other). torch's ``DistributedDataParallel`` drifts alike: it averages
gradients, not parameters. One worker is left as it is.
"""

from __future__ import annotations

import torch.nn as nn

__all__ = ["refuse_forward_renorm"]


def refuse_forward_renorm(model: nn.Module, workers: int) -> None:
    """Raise ValueError, on more than one worker, naming the embeddings of ``model`` that have a ``max_norm``."""
    if workers < 2:
        return
    found = [
        f"{name or type(module).__name__!r} (max_norm={module.max_norm:g})"
        for name, module in model.named_modules()
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None
    ]
    if found:
        raise ValueError(
            f"embedding(s) {', '.join(found)} renormalise, in place and in the forward pass, the rows that each "
            f"worker's own batch looks up: on {workers} workers the replicas would drift apart (torch's "
            "DistributedDataParallel alike) and differ from one worker on the whole batch. Build them without "
            "max_norm; to keep the rows' norms bounded, renormalise after each step() on every worker alike, "
            "with torch.no_grad(): embedding.weight.renorm_(2, 0, max_norm)"
        )
