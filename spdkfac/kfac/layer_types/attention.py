"""``nn.MultiheadAttention``: its q, k and v projections and ``out_proj`` preconditioned as four Linear layers.

The module computes with ``in_proj_weight`` (or ``q/k/v_proj_weight`` when
``kdim``/``vdim`` differ) and ``out_proj.weight`` inside
``F.multi_head_attention_forward``: no module ``forward()`` runs for them, so
no hook sees their inputs or output gradients. Splitting the module
(:class:`AttentionSplit`) gives it an explicit forward (:class:`ExplicitAttention`)
that runs the same attention through hookable points: each of q, k and v is
an :class:`AttentionProjection` (a module outside the model's tree: no
parameter, no ``state_dict`` entry; it reads rows of its owner's weights), and
``out_proj`` is called as the module it is. q, k and v are then separate K-FAC
blocks, three Linear layers sharing the ``in_proj`` storage, and ``out_proj``
a fourth, with the factors of the same model written with ``nn.Linear``
projections on batch-first tokens (the sample dimension is the batch, whatever
``batch_first`` says).

The explicit forward runs only while K-FAC's hooks are attached and gradients
are enabled (factors may be taken then, whatever the module's own mode: the
optimizer decides from the model's); otherwise, under ``torch.no_grad()``
and after ``remove_hooks()``, the module runs torch's own forward, fast path
included. It covers ``batch_first`` both ways, unbatched input,
``key_padding_mask`` and ``attn_mask`` (bool or float, 2-D or 3-D),
``is_causal``, ``need_weights`` and ``average_attn_weights``, biases or none,
``add_bias_kv`` (``bias_k``/``bias_v`` get the plain update) and
``add_zero_attn``. A subclass is refused (its forward may differ).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from .base import LayerHelper, SplitHelper, bias_grad_view
from .linear import LinearHelper

__all__ = [
    "AttentionProjection",
    "AttentionSplit",
    "ExplicitAttention",
    "ProjectionHelper",
    "explicit_attention",
    "project",
    "projection_rows",
]

#: Layer-name suffixes of the three projections, in ``in_proj_weight``'s row order.
PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class AttentionProjection(nn.Module):
    """One of q, k, v of an ``nn.MultiheadAttention`` as a module K-FAC's hooks see: ``F.linear`` on its rows.

    It holds no parameter: the weight is rows ``index*E:(index+1)*E`` of the
    owner's ``in_proj_weight`` (or all of ``q/k/v_proj_weight``), read at each
    call, so ``load_state_dict`` and ``.to()`` on the model reach it.
    """

    owner: nn.MultiheadAttention

    def __init__(self, owner: nn.MultiheadAttention, index: int) -> None:
        super().__init__()
        object.__setattr__(self, "owner", owner)  # not a submodule: the model's tree and state_dict stay as they were
        self.index = index
        embed = owner.embed_dim
        self.in_features = (embed, owner.kdim, owner.vdim)[index]
        self.out_features = embed
        self.packed = owner._qkv_same_embed_dim
        self.rows = slice(index * embed, (index + 1) * embed)

    @property
    def weight_param(self) -> nn.Parameter:
        """The parameter holding this projection's weight (shared by q, k and v when packed)."""
        owner = self.owner
        param = owner.in_proj_weight if self.packed else (owner.q_proj_weight, owner.k_proj_weight, owner.v_proj_weight)[self.index]
        assert isinstance(param, nn.Parameter)
        return param

    @property
    def bias_param(self) -> nn.Parameter | None:
        """``in_proj_bias`` (this projection's rows of it), or None without biases."""
        bias = self.owner.in_proj_bias
        return bias if isinstance(bias, nn.Parameter) else None

    def forward(
        self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None, *, output: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear`` of ``x`` with this projection's rows, or with ``weight`` and ``bias`` (those rows, given as one
        split of the owner's parameters: :func:`projection_rows`); or ``output``, this projection's part of one
        product computed for several (:func:`project`), so that hooks still see ``x`` and the output's gradient."""
        if output is not None:
            return output
        if weight is None:
            weight = self.weight_param[self.rows] if self.packed else self.weight_param
            bias = None if self.bias_param is None else self.bias_param[self.rows]
        return F.linear(x, weight, bias)

    def extra_repr(self) -> str:
        return f"{PROJECTIONS[self.index]}, in_features={self.in_features}, out_features={self.out_features}"


class ProjectionHelper(LinearHelper):
    """A Linear layer whose weight and bias are rows of parameters it shares with the other projections."""

    module: AttentionProjection  # type: ignore[assignment]  # a Linear layer's maths on a projection module
    kind = "MultiheadAttention q/k/v projection"

    def __init__(self, module: AttentionProjection) -> None:
        self.module = module
        self.weight = module.weight_param
        bias = module.bias_param
        self.bias = bias if bias is not None and bias.requires_grad else None  # (frozen: a constant, as LayerHelper's)
        self.rows = module.rows if module.packed else slice(None)

    def grad(self) -> torch.Tensor | None:
        grad = self.weight.grad
        if grad is None:
            return None
        w = grad[self.rows]
        if self.bias is None:
            return w
        b = self.bias.grad[self.module.rows] if self.bias.grad is not None else w.new_zeros(w.shape[0])
        return torch.cat([w, b.unsqueeze(1)], dim=1)

    def write_grad(self, update: torch.Tensor) -> None:
        grad = self.weight.grad
        assert grad is not None  # the caller preconditioned grad(), which needs it
        if self.bias is None:
            grad[self.rows].copy_(update)
            return
        grad[self.rows].copy_(update[:, :-1])
        bias_grad_view(self.bias)[self.module.rows].copy_(update[:, -1])

    def grad_views(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        grad = self.weight.grad
        if grad is None:
            return None
        return grad[self.rows], None if self.bias is None else bias_grad_view(self.bias)[self.module.rows]


def _float_mask(mask: torch.Tensor | None, name: str, dtype: torch.dtype) -> torch.Tensor | None:
    """A bool mask as an additive float mask (``-inf`` where True), as torch's own forward reads it."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise TypeError(f"nn.MultiheadAttention: only bool and floating {name} are supported, got {mask.dtype}")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def _heads_mask(mask: torch.Tensor, batch: int, heads: int, tgt: int, src: int) -> torch.Tensor:
    """``attn_mask`` of shape ``(L, S)`` or ``(N*H, L, S)`` as ``(1 or N, 1 or H, L, S)``."""
    if mask.dim() == 2 and mask.shape == (tgt, src):
        return mask.view(1, 1, tgt, src)
    if mask.dim() == 3 and mask.shape == (batch * heads, tgt, src):
        return mask.view(batch, heads, tgt, src)
    raise RuntimeError(
        f"nn.MultiheadAttention: attn_mask of shape {tuple(mask.shape)}; expected ({tgt}, {src}) or ({batch * heads}, {tgt}, {src})"
    )


def projection_rows(mha: nn.MultiheadAttention, parts: tuple[int, ...] = (1, 1, 1)) -> list[tuple[torch.Tensor, ...]]:
    """Per part (``parts``: their rows in multiples of ``embed_dim``; q, k and v by default, q and k-with-v as
    ``(1, 2)``), the arguments after its input: its weight and bias as views of one split of each packed
    parameter (none where the weights are separate; the weight alone without a bias).

    Sliced by each projection (``weight[rows]``), a packed parameter's
    gradient would be three zero-filled copies summed in the backward pass
    (six kernels and two sums per parameter on a GPU); split once, it is one
    concatenation. The same views, so the same forward; the gradient the same
    values.
    """
    weight: torch.Tensor | None = mha.in_proj_weight
    bias: torch.Tensor | None = mha.in_proj_bias  # (None without biases; torch annotates it as a tensor)
    if not mha._qkv_same_embed_dim or weight is None:  # (q, k and v with weights of their own)
        return [() for _ in parts]
    sizes = [part * mha.embed_dim for part in parts]
    weights = weight.split_with_sizes(sizes)
    if bias is None:
        return [(w,) for w in weights]
    return [(w, b) for w, b in zip(weights, bias.split_with_sizes(sizes))]


def project(
    mha: nn.MultiheadAttention,
    projections: tuple[AttentionProjection, ...],
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    same_qk: bool,
    same_kv: bool,
) -> tuple[torch.Tensor, ...]:
    """q, k and v of ``inputs`` (query, key, value), each through its projection module, with the products torch's
    own forward computes: one product of the packed weight for projections whose inputs are one tensor
    (``same_qk``/``same_kv``: ``query is key``/``key is value`` as the caller received them), else one each.

    In self-attention that is one matrix product instead of three, forward
    and backward (fewer kernels on a GPU), and the same values as torch's
    forward; the gradient of the input is then one product too, not three
    summed (so it rounds as torch's does, not as three separate products).
    """
    weight, bias = mha.in_proj_weight, mha.in_proj_bias  # (bias None without biases; torch annotates a tensor)
    if not mha._qkv_same_embed_dim or weight is None or not same_kv:  # weights of their own, or three inputs
        return tuple(projection(x, *rows) for projection, x, rows in zip(projections, inputs, projection_rows(mha)))
    if same_qk:
        parts = F.linear(inputs[0], weight, bias).chunk(3, dim=-1)
        return tuple(projection(x, output=part) for projection, x, part in zip(projections, inputs, parts))
    q_rows, kv_rows = projection_rows(mha, (1, 2))  # (q's arguments all tensors, as a compiled forward's taps want)
    k, v = F.linear(inputs[1], *kv_rows).chunk(2, dim=-1)
    return projections[0](inputs[0], *q_rows), projections[1](inputs[1], output=k), projections[2](inputs[2], output=v)


def explicit_attention(
    mha: nn.MultiheadAttention,
    projections: tuple[AttentionProjection, ...],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_padding_mask: torch.Tensor | None = None,
    need_weights: bool = True,
    attn_mask: torch.Tensor | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``mha``'s forward (torch's ``multi_head_attention_forward``) with q, k, v and ``out_proj`` run as modules.

    Works on batch-first tokens: the projections see ``(N, L, E)`` inputs,
    so their factors count samples along the batch dimension.
    """
    same_qk, same_kv = query is key, key is value  # (before the transposes below make new tensors)
    batched = query.dim() == 3
    if not batched:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    elif not mha.batch_first:
        query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
    batch, tgt = query.shape[:2]
    embed, heads = mha.embed_dim, mha.num_heads
    head_dim = embed // heads
    for projection in projections:
        projection.training = mha.training
    q, k, v = project(mha, projections, (query, key, value), same_qk, same_kv)
    if k.shape[:2] != v.shape[:2]:
        raise RuntimeError(f"nn.MultiheadAttention: key {tuple(key.shape)} and value {tuple(value.shape)} differ in batch or length")
    padding = _float_mask(key_padding_mask, "key_padding_mask", q.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("nn.MultiheadAttention: is_causal needs attn_mask (nn.Transformer.generate_square_subsequent_mask)")
    mask: torch.Tensor | None = None
    if not (is_causal and padding is None and not need_weights):
        mask = _float_mask(attn_mask, "attn_mask", q.dtype)
        if mask is not None:
            mask = _heads_mask(mask, batch, heads, tgt, k.shape[1])
        if padding is not None:
            is_causal = False
    if mha.bias_k is not None and mha.bias_v is not None:
        k = torch.cat([k, mha.bias_k.expand(batch, 1, embed)], dim=1)
        v = torch.cat([v, mha.bias_v.expand(batch, 1, embed)], dim=1)
        mask = None if mask is None else F.pad(mask, (0, 1))
        padding = None if padding is None else F.pad(padding, (0, 1))
    qh, kh, vh = (t.reshape(batch, t.shape[1], heads, head_dim).transpose(1, 2) for t in (q, k, v))  # (N, H, len, d)
    if mha.add_zero_attn:
        zeros = kh.new_zeros(batch, heads, 1, head_dim)
        kh, vh = torch.cat([kh, zeros], dim=2), torch.cat([vh, zeros], dim=2)
        mask = None if mask is None else F.pad(mask, (0, 1))
        padding = None if padding is None else F.pad(padding, (0, 1))
    if padding is not None:
        if padding.shape != (batch, kh.shape[2]):
            raise RuntimeError(
                f"nn.MultiheadAttention: key_padding_mask of shape {tuple(padding.shape)}; expected ({batch}, {kh.shape[2]})"
            )
        padding = padding.view(batch, 1, 1, -1)
        mask = padding if mask is None else mask + padding
    dropout = mha.dropout if mha.training else 0.0
    weights: torch.Tensor | None = None
    if need_weights:
        scores = (qh * math.sqrt(1.0 / head_dim)) @ kh.transpose(-2, -1)
        if mask is not None:
            scores = scores + mask
        weights = torch.softmax(scores, dim=-1)
        if dropout > 0.0:
            weights = F.dropout(weights, p=dropout)
        context = weights @ vh
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        context = F.scaled_dot_product_attention(qh, kh, vh, mask, dropout, is_causal)
    out = mha.out_proj(context.transpose(1, 2).reshape(batch, tgt, embed))
    if not batched:
        return out.squeeze(0), None if weights is None else weights.squeeze(0)
    return (out if mha.batch_first else out.transpose(0, 1)), weights


class ExplicitAttention:
    """The forward an ``nn.MultiheadAttention`` gets when split: explicit while K-FAC's hooks could take factors, else torch's.

    Set as the instance's ``forward`` (a plain object, so no submodule is
    registered); it holds the three projection modules K-FAC hooks.
    """

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        self.module = mha
        self.projections = tuple(AttentionProjection(mha, i) for i in range(3))

    def hooked(self) -> bool:
        """Whether a forward (pre-)hook is attached to a projection or to ``out_proj`` (K-FAC's are)."""
        modules = (*self.projections, self.module.out_proj)
        return any(m._forward_pre_hooks or m._forward_hooks for m in modules)

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        mha = self.module
        if torch.is_grad_enabled() and self.hooked():  # (in eval mode too: a part of a training model may be in it)
            return explicit_attention(mha, self.projections, *args, **kwargs)
        return nn.MultiheadAttention.forward(mha, *args, **kwargs)


class AttentionSplit(SplitHelper):
    """Splits an ``nn.MultiheadAttention`` into its q, k and v projections (``out_proj`` is a Linear layer of its own)."""

    @classmethod
    def split(cls, module: nn.Module) -> list[tuple[str, LayerHelper]]:
        assert isinstance(module, nn.MultiheadAttention)
        explicit = module.__dict__.get("forward")
        if not isinstance(explicit, ExplicitAttention):  # once per module: every optimizer hooks the same projections
            explicit = ExplicitAttention(module)
            module.forward = explicit  # type: ignore[method-assign]  # an instance attribute, as torch looks it up
        return [(PROJECTIONS[p.index], ProjectionHelper(p)) for p in explicit.projections if p.weight_param.requires_grad]
