"""What a layer type owns: how its inputs and output gradients become factor Gram matrices, and its gradient layout.

One :class:`LayerHelper` subclass per module type (registered in
:mod:`spdkfac.kfac.layer_types`); the K-FAC maths around it (scaling, running
averages, decompositions, preconditioning) is the same for every type and
lives in :class:`~spdkfac.kfac.layers.KFACLayer`.

Conventions: ``A`` is the Gram of the layer-input rows (with a trailing ones
column when the layer has a bias), ``G`` that of the output-gradient rows;
the gradient is a ``g x a`` matrix (bias as the last column), or a
``blocks x g x a`` stack when the factors are block-diagonal (a grouped
convolution: one block per group).
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn as nn

from ..factor_shape import FactorShape

__all__ = ["LayerHelper", "SequenceLayout", "SplitHelper", "bias_grad_view", "split_bias_column", "with_bias_column"]

#: Where a sequence model's layer has its samples: ``(N, L, E)`` or ``(L, N, E)``.
SequenceLayout = Literal["batch_first", "sequence_first"]


class LayerHelper(abc.ABC):
    """Reads and writes one module's K-FAC quantities (a small helper per layer type)."""

    #: What the start-up summary calls these layers (None: the module's class name).
    kind: str | None = None
    #: Whether ``input_gram`` and ``output_gram`` take bf16/fp16 rows on a GPU (``dtype``, the output gradient's
    #: dtype) and return their float32 Gram (:mod:`spdkfac.kfac.tensor_cores`): types whose Grams multiply the
    #: values as they came, rearranged but never computed on, by :func:`~spdkfac.kfac.linalg.symmetric_gram`.
    half_rows: bool = False
    #: The registered class's methods that compute the layer's output: a subclass that overrides none of them
    #: computes what the registered class does, and gets its helper; one that overrides any is left out unless
    #: registered itself (:func:`~spdkfac.kfac.layer_types.register_layer_type`).
    computes_with: tuple[str, ...] = ("forward",)
    #: Set on a layer of a sequence model whose layout is known (torch's transformer layers:
    #: :mod:`.transformer_layers`): ``'batch_first'`` ``(N, L, E)`` or ``'sequence_first'`` ``(L, N, E)``, a 2-D tensor
    #: being one sequence. None: the layer's own convention (the samples along the first dimension).
    sequence: SequenceLayout | None = None

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        self.weight: torch.Tensor = weight
        bias = getattr(module, "bias", None)
        # A frozen bias is a constant of the layer, as if it had none: no ones column in A (the weight's factors are
        # those of the weight alone), and nothing written to its gradient.
        self.bias: torch.Tensor | None = bias if isinstance(bias, torch.Tensor) and bias.requires_grad else None

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        """Why this module cannot be preconditioned by this helper (None: it can)."""
        return None

    @property
    def has_bias(self) -> bool:
        return self.bias is not None

    @property
    @abc.abstractmethod
    def a_shape(self) -> FactorShape:
        """Shape of the ``A`` factor (bias column included)."""

    @property
    @abc.abstractmethod
    def g_shape(self) -> FactorShape:
        """Shape of the ``G`` factor."""

    def params(self) -> list[torch.Tensor]:
        """The parameters the factors precondition."""
        return [self.weight] if self.bias is None else [self.weight, self.bias]

    @abc.abstractmethod
    def input_gram(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """``rows^T rows`` of the input rows (``a_shape``'s full form, ones column included) and the row count."""

    @abc.abstractmethod
    def output_gram(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``rows^T rows`` of the output-gradient rows (``g_shape``'s full form) and the row count."""

    def input_diagonal(self, x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        """The diagonal of :meth:`input_gram` and the row count, for an ``A`` kept diagonal (``max_factor_dim``).

        This default takes the whole Gram's diagonal; types whose rows are at
        hand (Linear) sum their squares instead, without the ``d x d`` Gram.
        """
        gram, count = self.input_gram(x, dtype)
        return gram.diagonal().clone(), count

    def output_diagonal(self, g: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The diagonal of :meth:`output_gram` and the row count, for a ``G`` kept diagonal (as :meth:`input_diagonal`)."""
        gram, rows = self.output_gram(g)
        return gram.diagonal().clone(), rows

    def forget(self) -> None:  # noqa: B027  (optional: most types keep nothing)
        """Drop what the hooks kept between a forward and a backward pass (a new step starts; most types keep nothing)."""

    def positions(self, rows: int, batch: int) -> int:
        """Output positions per sample that share the weight (``S``; 1 unless a convolution)."""
        return 1

    def samples_first(self, t: torch.Tensor) -> torch.Tensor:
        """A sequence-first ``(L, N, ...)`` tensor as the Grams read it: ``(N, L, ...)`` (a view). Types whose Grams
        do not depend on the rows' order (a Linear layer's) return it as it is, and save the copy a view's reshape
        would make."""
        return t.movedim(1, 0)

    def unbatched(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (an input or output gradient) is one sample without its batch dimension, as torch's layer
        accepts it (a Linear's 1-D input, a Conv2d's ``(C, H, W)``): the factors then count one sample, not
        ``t.shape[0]``. False where the layer has no unbatched form."""
        return False

    @property
    def grad_shape(self) -> tuple[int, ...]:
        """Shape of :meth:`grad`: ``(g, a)`` or ``(blocks, g, a)``."""
        a, g = self.a_shape, self.g_shape
        blocks = max(a.blocks, g.blocks)
        return (g.dim, a.dim) if blocks == 1 else (blocks, g.dim, a.dim)

    @abc.abstractmethod
    def grad(self) -> torch.Tensor | None:
        """The gradient in :attr:`grad_shape` (None before a backward pass)."""

    @abc.abstractmethod
    def write_grad(self, update: torch.Tensor) -> None:
        """Copy an update in :attr:`grad_shape` back into the parameters' gradients."""

    def grad_views(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The gradient's weight part (``g x a_w``) and bias column (``g``; None without a bias) as views of the
        parameters' gradients: what :meth:`grad` joins and :meth:`write_grad` copies into, so that same-shape
        layers can be read as one stack and updates written together (:mod:`spdkfac.step.gradient_views`). A missing bias
        gradient is created as zeros (what :meth:`write_grad` does). None (the default) where the gradient is not
        such a pair of views: no gradient yet, block-diagonal factors, a layout a view cannot express.
        """
        return None

    def describe(self) -> dict[str, Any]:
        """What the start-up summary shows of this layer."""
        return {"A": self.a_shape.describe(), "G": self.g_shape.describe()}


class SplitHelper(abc.ABC):
    """A module that computes with several K-FAC blocks' weights itself, with no submodule ``forward()`` for them.

    :meth:`split` gives one helper per block whose module runs in the split
    module's forward (so K-FAC's hooks see it); the module's children that it
    then calls as modules (``nn.MultiheadAttention.out_proj``) are layers of
    their own.
    """

    #: As :attr:`LayerHelper.computes_with`.
    computes_with: tuple[str, ...] = ("forward",)

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        """Why this module cannot be split (None: it can)."""
        return None

    @classmethod
    @abc.abstractmethod
    def split(cls, module: nn.Module) -> list[tuple[str, LayerHelper]]:
        """``(name suffix, helper)`` per block with a trainable weight; makes the blocks visible to hooks."""


def with_bias_column(weight_part: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``weight_part`` (``(..., g, a)``) with the bias gradient (zeros if none yet) as a last column."""
    if bias is None:
        return weight_part
    bias_grad = bias.grad if bias.grad is not None else torch.zeros_like(bias)
    return torch.cat([weight_part, bias_grad.reshape(*weight_part.shape[:-1], 1)], dim=-1)


def bias_grad_view(bias: torch.Tensor) -> torch.Tensor:
    """``bias.grad``, created as zeros where it has none yet (what :func:`split_bias_column` writes into)."""
    if bias.grad is None:
        bias.grad = torch.zeros_like(bias)
    return bias.grad


def split_bias_column(
    update: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    as_weight: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Write ``update`` (``(..., g, a)``, bias as the last column if ``bias``) into the gradients.

    ``as_weight`` puts the weight part into the weight's layout where a
    reshape does not (a transposed convolution's swapped channels).
    """
    if bias is not None:
        w_part, b_part = update[..., :-1], update[..., -1]
        bias_grad_view(bias).copy_(b_part.reshape(bias.shape))
    else:
        w_part = update
    assert weight.grad is not None  # the caller preconditioned grad(), which needs it
    weight.grad.copy_(w_part.reshape(weight.shape) if as_weight is None else as_weight(w_part))
