"""A Llama-style causal language model, written with ``torch.nn`` only, as Hugging Face's Llama lays out its layers.

Each block is pre-norm (``nn.RMSNorm``): causal self-attention with separate
bias-free ``q_proj``, ``k_proj``, ``v_proj`` and ``o_proj`` Linear layers and
rotary position embeddings (RoPE) on q and k, then a SwiGLU MLP,
``down_proj(silu(gate_proj(h)) * up_proj(h))``. Token embedding and an untied
Linear head. Positions enter only through the rotation (no learned
position embedding), so every parameter is a weight K-FAC sees per sample.
K-FAC preconditions every Linear layer and the embedding; the RMSNorm scales
get the base update (``norm_layers='kfac'`` preconditions them too).
q, k and v read one input, and so do gate and up: their ``A`` factors are
equal, and its Gram is computed once per input
(:mod:`spdkfac.kfac.layer_types.shared_input`).

:func:`char_llama` is the character-level size of :func:`~spdkfac.models.modern.char_gpt`
(``--data pycode``: 97 characters, 64 of context).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .moe import MixtureOfExperts

__all__ = ["CharLlama", "LlamaBlock", "char_llama", "char_moe_llama", "rotate", "tied_llama"]


def rotate(x: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding of ``(N, heads, T, head_dim)`` queries or keys: each pair of halves turned by an
    angle that grows with the position (Su et al. 2021, in the half-split layout Llama uses)."""
    half = x.shape[-1] // 2
    positions = torch.arange(x.shape[-2], device=x.device, dtype=torch.float32)[:, None]
    frequencies = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions * frequencies
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class LlamaBlock(nn.Module):
    """x + o_proj(attention(RoPE(q), RoPE(k), v)) of RMSNorm(x), then x + SwiGLU(RMSNorm(x)); causal, no biases.
    With ``experts``, the SwiGLU is a mixture of that many experts of width ``mlp_dim``, ``top_k`` per token."""

    def __init__(self, dim: int, heads: int, mlp_dim: int, experts: int = 0, top_k: int = 2) -> None:
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"width {dim} must split into {heads} heads of an even size (RoPE turns pairs)")
        self.heads = heads
        self.attention_norm = nn.RMSNorm(dim, eps=1e-6)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-6)
        self.moe = MixtureOfExperts(dim, mlp_dim, experts, top_k) if experts else None
        if self.moe is None:
            self.gate_proj = nn.Linear(dim, mlp_dim, bias=False)
            self.up_proj = nn.Linear(dim, mlp_dim, bias=False)
            self.down_proj = nn.Linear(mlp_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, dim = x.shape
        h = self.attention_norm(x)
        q, k, v = (proj(h).view(n, t, self.heads, dim // self.heads).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        attended = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        x = x + self.o_proj(attended.transpose(1, 2).reshape(n, t, dim))
        h = self.mlp_norm(x)
        mlp: torch.Tensor = self.moe(h) if self.moe is not None else self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x + mlp


class CharLlama(nn.Module):
    """Token embedding, Llama blocks, RMSNorm and a bias-free head, untied or (``tie_embeddings``) holding the
    embedding's weight. Takes ``(N, T)`` ids and returns ``(N, vocab, T)`` logits, the layout ``cross_entropy`` and
    ``argmax(1)`` read per position."""

    def __init__(
        self,
        vocab: int,
        context: int = 64,
        dim: int = 128,
        depth: int = 2,
        heads: int = 4,
        mlp_dim: int = 344,
        tie_embeddings: bool = False,
        experts: int = 0,
        top_k: int = 2,
    ) -> None:
        super().__init__()
        self.context = context
        self.tokens = nn.Embedding(vocab, dim)
        self.blocks = nn.Sequential(*(LlamaBlock(dim, heads, mlp_dim, experts, top_k) for _ in range(depth)))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.head = nn.Linear(dim, vocab, bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
        if tie_embeddings:
            self.head.weight = self.tokens.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.shape[1] > self.context:
            raise ValueError(f"this model was built for up to {self.context} tokens, got {ids.shape[1]}")
        out: torch.Tensor = self.head(self.norm(self.blocks(self.tokens(ids)))).transpose(1, 2)
        return out


def char_llama(num_classes: int = 97) -> nn.Module:
    """A small Llama-style character-level model (``--data pycode``): width 128, 2 blocks of 4 heads, SwiGLU MLP of
    344 (about 8/3 of the width, as Llama sizes it)."""
    return CharLlama(num_classes)


def char_moe_llama(num_classes: int = 97) -> nn.Module:
    """:func:`char_llama` with each MLP a mixture of 4 SwiGLU experts of width 172, 2 per token (Mixtral's
    routing): the dense model's 344 per token, twice its MLP parameters."""
    return CharLlama(num_classes, mlp_dim=172, experts=4, top_k=2)


def tied_llama(num_classes: int = 2048) -> nn.Module:
    """:func:`char_llama`'s model with its head tied to the token embedding, for a vocabulary of words
    (``--data pycode-words``): as GPT-2, Gemma and the small Llama 3.2 models tie them."""
    return CharLlama(num_classes, tie_embeddings=True)
