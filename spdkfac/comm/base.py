"""The one small interface every communication engine implements.

The optimizer only ever needs: who am I (``rank``), how many of us
(``size``), an in-place asynchronous all-reduce that averages, and an
in-place asynchronous broadcast. Each returns a :class:`Handle` whose
``wait()`` blocks until the tensor holds the result. Collective names must be
identical on every rank (Horovod matches operations by name; torch.distributed
matches them by issue order, so callers must also issue them in the same order).
"""

from __future__ import annotations

import abc
from typing import Protocol

import torch

__all__ = ["CommBackend", "CompletedHandle", "Handle", "SingleProcessBackend"]


class Handle(Protocol):
    """A pending collective. ``wait()`` is idempotent."""

    def wait(self) -> None:  # pragma: no cover - protocol
        ...

    def done(self) -> bool:  # pragma: no cover - protocol
        """True once the result is available (non-blocking)."""
        ...


class CompletedHandle:
    """A handle for an operation that finished when it was issued."""

    __slots__ = ()

    def wait(self) -> None:
        return None

    def done(self) -> bool:
        return True


class CommBackend(abc.ABC):
    """Asynchronous collectives over a fixed group of workers."""

    name: str = "abstract"

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This worker's index in ``[0, size)``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of workers."""

    @abc.abstractmethod
    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        """Start averaging ``tensor`` in place across all workers."""

    @abc.abstractmethod
    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        """Start overwriting ``tensor`` in place with ``root``'s copy."""

    def barrier(self) -> None:
        """Block until every worker reaches this point."""
        self.allreduce_async(torch.zeros(1), "spdkfac.barrier").wait()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class SingleProcessBackend(CommBackend):
    """No communication: one worker holds every result already."""

    name = "single"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        return CompletedHandle()

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        if root != 0:
            raise ValueError(f"broadcast root {root} does not exist in a single-process run")
        return CompletedHandle()

    def barrier(self) -> None:
        return None
