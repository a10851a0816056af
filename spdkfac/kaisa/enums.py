"""KAISA's enums, by member name: the preconditioner reads a member's name (``ComputeMethod.INVERSE`` is ``'inverse'``)."""

from __future__ import annotations

import enum

__all__ = ["AssignmentStrategy", "ComputeMethod", "DistributedStrategy"]


class ComputeMethod(enum.Enum):
    """``compute_method``: ``'eigen'`` or ``'inverse'``."""

    EIGEN = 1
    INVERSE = 2


class DistributedStrategy(enum.Enum):
    """``grad_worker_fraction``: every worker a gradient worker (1), half of them (0.5), one per layer (``1/P``)."""

    COMM_OPT = 1
    MEM_OPT = 2
    HYBRID_OPT = 3


class AssignmentStrategy(enum.Enum):
    """``assignment_strategy``: taken, without effect (``placement`` decides from measured costs)."""

    COMPUTE = 1
    MEMORY = 2
