"""The ``format_version`` check every versioned file of spdkfac shares (performance models, profiles).

A file written by a newer spdkfac may mean something this code would read
wrongly, so it is refused with the versions named, never half-read.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any

__all__ = ["FormatVersionError", "check_format_version"]


class FormatVersionError(ValueError):
    """A file's ``format_version`` is not one this code reads; the message names the file and both versions."""


def check_format_version(version: Any, supported: int, what: str, source: str, remedy: str) -> int:
    """``version`` as an int if this code reads it (1 to ``supported``), else a :class:`FormatVersionError`.

    ``what`` names the kind of file ("performance model"), ``source`` the
    file, ``remedy`` the command that writes a current one.
    """
    if isinstance(version, bool) or not isinstance(version, Integral) or int(version) < 1:
        raise FormatVersionError(
            f"{what} {source}: format_version must be a positive integer, got {version!r} (this spdkfac writes {supported}; {remedy})"
        )
    if int(version) > supported:
        raise FormatVersionError(
            f"{what} {source} has format_version {version}, newer than this spdkfac reads (up to {supported}): "
            f"a newer spdkfac wrote it; upgrade spdkfac, or {remedy}"
        )
    return int(version)
