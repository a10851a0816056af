"""``kfac.preconditioner``: KAISA's ``KFACPreconditioner`` is this project's, which takes its options."""

from __future__ import annotations

from ..preconditioner import KFACPreconditioner

__all__ = ["KFACPreconditioner"]
