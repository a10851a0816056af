"""The base of every enumerated option: a string enum that takes the strings users pass.

Each option type (:class:`~spdkfac.kfac.methods.ComputeMethod`,
:class:`~spdkfac.plan.placement.Placement`, ...) is declared once, beside
the code that chooses among its values, as a subclass of :class:`Option`;
:mod:`spdkfac.config` gathers them. A member *is* its string
(``Placement.LBP == 'lbp'``, same hash, ``str()``, ``repr()`` and JSON), so
options read from a command line, a JSON file or an old checkpoint compare
and look up as before; :meth:`Option.parse` turns a user's value into the
member, or raises the ValueError that names the choices. Written as
``(str, Enum)`` rather than ``enum.StrEnum`` (Python 3.11) so the package
keeps running on 3.9.
"""

from __future__ import annotations

from enum import Enum
from typing import Any, TypeVar

__all__ = ["Option"]

_O = TypeVar("_O", bound="Option")


class Option(str, Enum):
    """A choice among fixed strings; ``str``, ``repr`` and ``format`` show the bare value (``'lbp'``).

    The bare ``repr`` keeps a config's ``repr`` what a user would type, and
    ``state_dict`` stores the plain strings (:meth:`plain`), which
    ``torch.load(weights_only=True)`` reads.
    """

    def __str__(self) -> str:
        return str(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def choices(cls) -> tuple[str, ...]:
        """The values, in declaration order (as error messages and ``argparse`` choices list them)."""
        return tuple(str(member.value) for member in cls)

    @classmethod
    def parse(cls: type[_O], name: str, value: Any) -> _O:
        """The member equal to ``value`` (a member or its string), else a ValueError naming option ``name``'s choices."""
        if isinstance(value, str):
            for member in cls:
                if member.value == value:
                    return member
        raise ValueError(f"{name} must be one of {cls.choices()}, got {value!r}")

    def plain(self) -> str:
        """The value as a plain ``str`` (for ``state_dict`` and files read back without this class)."""
        return str(self.value)
