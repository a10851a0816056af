"""The oldest torch the package runs on, checked at ``import spdkfac``: a clear error rather than a missing attribute.

torch 2.4 is the oldest with everything the package calls (``nn.RMSNorm``,
``torch.get_autocast_dtype``, ``torch.amp.GradScaler``, custom ops); before
the check, ``import spdkfac`` on torch 2.1 died with "module 'torch.nn' has
no attribute 'RMSNorm'". ``scripts/check_oldest.sh`` runs the tests on the
oldest Python and torch.
"""

from __future__ import annotations

import re

import torch

__all__ = ["MIN_TORCH", "require_supported_torch", "torch_is_supported"]

#: The oldest torch release the package runs on (pyproject.toml's ``torch>=`` and the README say the same).
MIN_TORCH = (2, 4)


def torch_is_supported(version: str) -> bool:
    """Whether a torch version string (``'2.4.1+cu121'``, ``'2.10.0a0+git…'``) is ``MIN_TORCH`` or newer."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return found is not None and (int(found[1]), int(found[2])) >= MIN_TORCH


def require_supported_torch(version: str | None = None) -> None:
    """Raise ImportError, naming both versions, on a torch older than ``MIN_TORCH``."""
    version = str(torch.__version__) if version is None else version
    if not torch_is_supported(version):
        minimum = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"spdkfac needs torch >= {minimum}, and this is torch {version}: pip install 'torch>={minimum}'")
