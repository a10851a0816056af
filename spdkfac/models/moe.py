"""A mixture-of-experts SwiGLU MLP (Mixtral's layout), written with ``torch.nn`` only.

A bias-free router scores each token against every expert; the token goes to
its ``top_k`` experts, whose outputs are summed with the router's softmax
weights renormalised over those ``top_k``. Each expert is a SwiGLU MLP of
three bias-free ``nn.Linear`` layers, called once per forward pass on the
tokens routed to it (an empty batch where none were: its parameters stay in
the graph, so ``DistributedDataParallel`` needs no ``find_unused_parameters``).
So every expert takes a data-dependent number of samples on each worker,
which K-FAC weighs as one worker on the whole batch does
(docs/layers.md#routed-layers-a-different-number-of-samples-on-each-worker).
No load-balancing loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MixtureOfExperts", "SwiGLU"]


class SwiGLU(nn.Module):
    """``down_proj(silu(gate_proj(h)) * up_proj(h))``, bias-free (one expert)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return out


class MixtureOfExperts(nn.Module):
    """Each token of ``(..., dim)`` through its ``top_k`` of ``experts`` SwiGLU experts, weighted by the router."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be between 1 and the number of experts ({experts}), got {top_k}")
        self.top_k = top_k
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(dim, hidden) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = self.router(tokens).softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            token, slot = (chosen == e).nonzero(as_tuple=True)
            out = out.index_add(0, token, expert(tokens[token]) * weights[token, slot, None])
        return out.view_as(x)
