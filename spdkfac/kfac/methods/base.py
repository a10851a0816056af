"""What a compute method owns: how a factor is decomposed, sent, kept, saved, costed and preconditioned with.

A method is chosen once, from ``KFACConfig.compute_method``
(:func:`spdkfac.kfac.methods.get_method`); nothing else in the optimizer asks
which one it is. Every operation takes the factor's
:class:`~spdkfac.kfac.factor_shape.FactorShape`, so a block-diagonal factor (a
grouped convolution) is decomposed in one batched call and sent as one
buffer, and a diagonal one (an embedding's ``A``) elementwise.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch

from ...perfmodels.models import BatchedModel, PerfModel
from ..factor_shape import FactorShape

__all__ = ["DecompositionFallbackWarning", "DecompositionMethod", "LinAlgError", "MethodState"]

#: torch's error for a failed factorization (torch's stubs do not re-export it from torch.linalg).
LinAlgError: type[RuntimeError] = torch.linalg.LinAlgError  # type: ignore[attr-defined]


class DecompositionFallbackWarning(RuntimeWarning):
    """A factor's decomposition failed and the method's slower fallback was used (each factor is named once).

    ``warnings.simplefilter("error", DecompositionFallbackWarning)`` turns it
    into an error on the rank that decomposed the factor.
    """


@dataclass
class MethodState:
    """A layer's own state under a compute method (``KFACLayer.method_state``): empty but for the methods that
    learn from every gradient, which subclass it (EKFAC's scaling, :mod:`spdkfac.kfac.methods.ekfac_updates`)."""

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (for :meth:`~spdkfac.SPDKFACOptimizer.memory_usage`)."""
        return []


class DecompositionMethod(abc.ABC):
    """One way of turning the running factors into what the gradient is preconditioned with.

    ``kept`` values (what a layer holds per factor) are method-specific; the
    flat ``payload`` is what an owner broadcasts.
    """

    #: The ``compute_method`` option value.
    name: ClassVar[str]
    #: What the kept values are called in messages ("inverses").
    label: ClassVar[str]
    #: Suffix of the checkpoint and memory-report keys (``A_inv``).
    suffix: ClassVar[str]

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # -- the decomposition stage ------------------------------------------------------
    @abc.abstractmethod
    def payload_size(self, shape: FactorShape) -> int:
        """Elements broadcast for one factor of this shape."""

    def kept_size(self, shape: FactorShape) -> int:
        """Elements a holder keeps of one factor's decomposition (what :meth:`tensors` of it add up to)."""
        return self.payload_size(shape)

    @classmethod
    def from_options(cls, options: Any = None) -> DecompositionMethod:
        """The method configured by the optimizer's options (a :class:`~spdkfac.config.KFACConfig`; None: defaults)."""
        return cls()

    @abc.abstractmethod
    def owned(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> tuple[Any, torch.Tensor]:
        """(kept value, flat payload) of a full factor, on the rank that decomposes and broadcasts it.

        ``previous`` is the kept value of the last decomposition of this
        factor (None before the first); every rank holds it bitwise alike, so
        a method may start from it (a warm-started eigenbasis). The kept value
        must equal bitwise what :meth:`received` rebuilds from the payload.
        """

    def local(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> Any:
        """The kept value of a factor every rank decomposes itself (nothing sent)."""
        return self.owned(shape, factor, damping, previous)[0]

    #: What :meth:`fallback` does, for the warning when it is used ("" where there is none).
    fallback_label: ClassVar[str] = ""

    def fallback(self, shape: FactorShape, factor: torch.Tensor, damping: float, previous: Any = None) -> tuple[Any, torch.Tensor] | None:
        """(kept value, flat payload) by a slower decomposition that cannot fail, for a factor whose :meth:`owned`
        or :meth:`local` raised a ``LinAlgError``; None: there is none, and the error stands.

        Called only where the plain decomposition failed, so results elsewhere
        are untouched. It must be a deterministic function of the factor (a
        factor placed on every rank is decomposed by each, from bitwise-equal
        factors, and each must take the same decision and get the same bits).
        """
        return None

    @abc.abstractmethod
    def received(self, payload: torch.Tensor, shape: FactorShape) -> Any:
        """The kept value rebuilt from a received payload."""

    def payload(self, kept: Any, shape: FactorShape) -> torch.Tensor:
        """The flat payload that :meth:`received` rebuilds ``kept`` from, bitwise: what a holder sends a rank that
        holds no copy (a checkpoint gathered on one rank). This default joins :meth:`tensors`, right for a method
        that keeps what it sends, as views into the payload; one that keeps another form overrides it."""
        flat = torch.cat([t.reshape(-1) for t in self.tensors(kept)])
        if flat.numel() != self.payload_size(shape):
            raise NotImplementedError(
                f"{type(self).__name__} keeps {flat.numel()} elements of a {shape.describe()} factor but sends "
                f"{self.payload_size(shape)}: it must define payload()"
            )
        return flat

    @abc.abstractmethod
    def failure(self, what: str, shape: FactorShape, factor: torch.Tensor, damping: float, step: int, exc: Exception) -> str:
        """The message of a failed decomposition of ``what`` ("factor A of layer 'x'")."""

    # -- preconditioning ---------------------------------------------------------------
    @abc.abstractmethod
    def precondition(self, grad: torch.Tensor, a: Any, g: Any, damping: float, state: MethodState | None = None) -> torch.Tensor:
        """The update of a ``g x a`` gradient (``blocks x g x a`` for block-diagonal factors).

        ``state`` is the layer's own method state (:meth:`commit`), which a
        method that learns from every gradient (EKFAC's scaling) reads and
        stages its next value in; the others ignore it.
        """

    #: Whether :meth:`precondition` of single-tensor decompositions also takes a stack of same-shape layers
    #: (gradients ``(n, g, a)``, decompositions ``(n, d, d)``) and gives their updates stacked, as products that
    #: broadcast over the leading dimension do (:mod:`spdkfac.step.stacked_preconditioning`).
    stackable: ClassVar[bool] = False

    #: Products of the ``g x a`` gradient with each factor's kept ``d x d`` matrix in :meth:`precondition`
    #: (an inverse: one on each side; an eigenbasis: into it and back), for the modelled preconditioning seconds.
    precondition_products: ClassVar[int] = 1

    @property
    def starts_from_previous(self) -> bool:
        """Whether a decomposition starts from the factor's previous one (a warm-started eigenbasis).

        Whichever rank decomposes a factor must then hold its previous
        decomposition, and a checkpoint every one: every rank keeps every
        decomposition, even where only some precondition a layer
        (:class:`~spdkfac.plan.work_plan.WorkPlan`).
        """
        return False

    def refresh_record(self, kept: Any) -> tuple[int, float] | None:
        """``(age, residual)`` of a decomposition started from the previous one, for
        :class:`~spdkfac.kfac.methods.warm.RefreshStatistics` (age 0: made from scratch; residual -1: not
        measured); None where the method always decomposes from scratch."""
        return None

    # -- per-layer state (empty but for methods that learn from every gradient) -------
    #: Whether a layer's state changes on every preconditioning (then only every rank preconditioning every layer
    #: keeps it identical everywhere: distributed preconditioning is refused).
    stateful: ClassVar[bool] = False

    @property
    def gives_direction(self) -> bool:
        """Whether :meth:`precondition` returns the step's whole direction (already normalised, with its own moments).

        The AdamW base then steps along it as it is, ``w <- w - lr * update
        - lr * wd * w``, instead of running Adam on it again
        (EKFAC's ``ekfac_update='adam'``).
        """
        return False

    def new_state(self) -> MethodState:
        """A layer's fresh state (the stateless methods' is empty)."""
        return MethodState()

    def begin_step(self, state: MethodState, samples: int | None, group: dict[str, Any]) -> None:
        """Hand a layer's state what the step knows before preconditioning: ``samples``, the global batch the
        factor hooks just saw (None on a step that does not update the factors), and the optimizer's first
        ``param_group`` (the base's hyperparameters in force)."""
        return  # the stateless methods need none of it

    def commit(self, state: MethodState) -> None:
        """Make the state staged by this step's :meth:`precondition` current (a skipped step never commits)."""
        return  # the stateless methods stage nothing

    def save_state(self, state: MethodState) -> dict[str, Any] | None:
        """Plain tensors / values of a layer's state for a checkpoint (None: nothing to save)."""
        return None

    def load_state(self, saved: dict[str, Any] | None, device: torch.device) -> MethodState:
        """A layer's state from what :meth:`save_state` wrote (None: a fresh state)."""
        return self.new_state()

    @abc.abstractmethod
    def tensors(self, kept: Any) -> list[torch.Tensor]:
        """The tensors of a kept value (memory, finiteness, dtype)."""

    # -- checkpoints --------------------------------------------------------------------
    @abc.abstractmethod
    def save(self, kept: Any) -> Any:
        """Plain tensors / dicts of a kept value (``torch.load(weights_only=True)`` reads them)."""

    @abc.abstractmethod
    def load(self, saved: Any, shape: FactorShape, device: torch.device) -> Any:
        """A kept value from what :meth:`save` wrote (also older checkpoints' form)."""

    # -- cost model ---------------------------------------------------------------------
    @abc.abstractmethod
    def curve(self, perf: PerfModel) -> Callable[[float], float]:
        """The fitted seconds of decomposing one dense ``d x d`` factor."""

    def cost(self, perf: PerfModel, shape: FactorShape) -> float:
        """Modelled seconds to decompose a factor of ``shape``.

        Dense: the fitted curve at ``d``. ``b`` blocks in one batched call:
        the curve at ``d`` once (one call's fixed cost and one block's work),
        plus ``b - 1`` times the work above the fixed cost, ``t(d) - t(1)``
        (the batched LAPACK/cuSOLVER call pays its start-up once, every
        block's arithmetic); where the performance model has batched
        measurements, their fit instead (:class:`~spdkfac.perfmodels.models.BatchedModel`).
        Diagonal: elementwise, the fixed cost ``t(1)``.
        """
        t = self.curve(perf)
        if shape.diagonal:
            return t(1)
        if shape.blocks == 1:
            return t(shape.dim)
        batched = perf.batched.get(self.name)
        return BatchedModel.rule(t, shape.blocks, shape.dim) if batched is None else batched(shape.blocks, shape.dim)

    def broadcast_cost(self, perf: PerfModel, shape: FactorShape) -> float:
        """Modelled seconds to broadcast one factor's payload."""
        return perf.broadcast.payload(self.payload_size(shape))
