"""What a step does with NaN or Inf: skip it on every worker at once, or stop, never NaN parameters.

Every value checked here is the same on every worker (averaged gradients,
averaged factors, identical inverses and preconditioned gradients), so every
worker takes the same decision at the same step without communicating.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable

import torch

from ..kfac.layers import FactorKey
from ..kfac.linalg import non_finite_indices

__all__ = ["NonFiniteError", "NonFiniteFactorError", "NonFiniteGuard", "SkipStep", "non_finite"]


class NonFiniteError(FloatingPointError):
    """A step met NaN or Inf (in gradients, factors or preconditioned updates); no parameter was changed."""


class NonFiniteFactorError(NonFiniteError):
    """A Kronecker factor contained NaN or Inf; running averages were left untouched."""

    def __init__(self, layers: list[FactorKey], step: int) -> None:
        self.layers = layers
        names = ", ".join(f"{kind} of {name!r}" for kind, name in layers)
        super().__init__(
            f"non-finite Kronecker factor(s) at step {step}: {names}. The running averages were not "
            "updated and no parameter was changed. Check the inputs/loss of that step (or lower the "
            "learning rate)."
        )


class SkipStep(Exception):  # noqa: N818 a control-flow signal, not an error
    """Raised inside ``step()`` to leave the step with nothing changed (internal)."""


def non_finite(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors holding NaN or Inf (one fused pass per device and dtype, one synchronisation in all)."""
    items = [(name, t) for name, t in named if t is not None]
    return [items[i][0] for i in non_finite_indices([t for _, t in items])]


class NonFiniteGuard:
    """Skips up to ``max_skipped`` consecutive steps that meet NaN/Inf (with a warning), then raises."""

    def __init__(self, max_skipped: int) -> None:
        self.max_skipped = max_skipped  # validated as KFACConfig.skip_nonfinite
        self.consecutive = 0
        self.skipped_total = 0

    def bad_step(self, error: NonFiniteError) -> None:
        """Raise ``error``, or count the step as skipped and raise :class:`SkipStep`."""
        if self.consecutive >= self.max_skipped:
            self.consecutive = 0
            raise error
        self.consecutive += 1
        self.skipped_total += 1
        warnings.warn(f"step skipped ({self.consecutive} in a row, at most {self.max_skipped}): {error}", stacklevel=4)
        raise SkipStep()

    def good_step(self) -> None:
        self.consecutive = 0
