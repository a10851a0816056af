"""Checking an output path before the work that fills it, so a typo fails in a second, not after an hour.

Used by every command line that takes ``--out`` / ``--json`` / ``--plot``
(as an argparse ``type``: the error then names the option).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Callable

__all__ = ["output_file", "unwritable_reason"]


def _nearest_existing(path: Path) -> Path:
    for parent in path.parents:
        if parent.exists():
            return parent
    return Path(".")


def unwritable_reason(path: str | Path, make_parents: bool = False) -> str | None:
    """Why a file at ``path`` could not be written, or None if it can.

    ``make_parents``: the writer creates missing folders (``mkdir -p``), so
    only the nearest existing ancestor must be a writable folder.
    """
    p = Path(path)
    if p.is_dir():
        return "it is a directory"
    parent = p.parent
    if not parent.exists():
        if not make_parents:
            return f"its directory {parent} does not exist"
        parent = _nearest_existing(p)
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        return "no permission to write there"
    return None


def output_file(make_parents: bool = False) -> Callable[[str], str]:
    """An argparse ``type=`` that refuses an unwritable file path at parse time (``error: argument --out: ...``)."""

    def check(value: str) -> str:
        problem = unwritable_reason(value, make_parents)
        if problem:
            raise argparse.ArgumentTypeError(f"cannot write {value}: {problem}")
        return value

    check.__name__ = "output file"  # argparse names the type in some messages
    return check
