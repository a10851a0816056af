"""KAISA's import paths for a KAISA script: ``import spdkfac.kaisa as kfac`` in place of ``import kfac``.

A script written for KAISA's ``kfac`` package (``kfac.preconditioner.KFACPreconditioner``,
``kfac.enums.ComputeMethod``, ``kfac.enums.DistributedStrategy``,
``kfac.scheduler.LambdaParamScheduler``) then runs on this project's
preconditioner with that one line changed (``docs/preconditioner.md``).
"""

from __future__ import annotations

from . import enums, preconditioner, scheduler
from .enums import AssignmentStrategy, ComputeMethod, DistributedStrategy
from .preconditioner import KFACPreconditioner
from .scheduler import LambdaParamScheduler

__all__ = [
    "AssignmentStrategy",
    "ComputeMethod",
    "DistributedStrategy",
    "KFACPreconditioner",
    "LambdaParamScheduler",
    "enums",
    "preconditioner",
    "scheduler",
]
