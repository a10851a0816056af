"""``kfac.scheduler``: KAISA's ``LambdaParamScheduler``, with its rule."""

from __future__ import annotations

from ..schedules import LambdaParamScheduler

__all__ = ["LambdaParamScheduler"]
