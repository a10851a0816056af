"""The one small interface every communication engine implements.

The optimizer only ever needs: who am I (``rank``), how many of us
(``size``), an in-place asynchronous all-reduce that averages, and an
in-place asynchronous broadcast. Each returns a :class:`Handle` whose
``wait()`` blocks until the tensor holds the result. DHO2's distributed
Lanczos also gathers row blocks (``allgather_async``); engines without a
native all-gather get one built from broadcasts. Collective names must be
identical on every rank (Horovod matches operations by name; torch.distributed
matches them by issue order, so callers must also issue them in the same order).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["CommBackend", "CompletedHandle", "Handle", "HandleGroup", "SingleProcessBackend", "check_gather_counts"]


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


class HandleGroup:
    """Several pending collectives completed as one: ``wait()`` waits for each in order."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Sequence[Handle]) -> None:
        self._handles = list(handles)

    def wait(self) -> None:
        for handle in self._handles:
            handle.wait()

    def done(self) -> bool:
        return all(handle.done() for handle in self._handles)


def check_gather_counts(tensor: torch.Tensor, counts: Sequence[int], size: int, name: str) -> list[int]:
    """The start offset of every rank's segment; raises unless ``counts`` tile the 1-D contiguous ``tensor``."""
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"all-gather {name!r} fills a contiguous 1-D tensor, got shape {tuple(tensor.shape)}")
    if len(counts) != size or any(c < 0 for c in counts) or sum(counts) != tensor.numel():
        raise ValueError(f"all-gather {name!r}: counts {list(counts)} must give {size} non-negative sizes summing to {tensor.numel()}")
    offsets = [0] * size
    for r in range(1, size):
        offsets[r] = offsets[r - 1] + counts[r - 1]
    return offsets


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

    #: Whether :meth:`broadcast_within_async` sends only to its members (else to every rank).
    native_subgroups: bool = False

    def broadcast_within_async(self, tensor: torch.Tensor, root: int, members: Sequence[int], name: str) -> Handle:
        """Start overwriting ``tensor`` with ``root``'s copy on the ranks ``members`` (root among them).

        Every rank calls it, in the same order. With :attr:`native_subgroups`
        only the members communicate and a non-member's ``tensor`` (pass an
        empty one) is left alone; this default, for engines without
        sub-group collectives, broadcasts to every rank, so a non-member must
        pass a buffer of the members' size, which it then discards.
        """
        if root not in members:
            raise ValueError(f"broadcast {name!r}: root {root} is not among its members {list(members)}")
        return self.broadcast_async(tensor, root, name)

    def allgather_async(self, tensor: torch.Tensor, counts: Sequence[int], name: str) -> Handle:
        """Start filling the 1-D ``tensor`` with every worker's segment, in rank order.

        Rank ``r`` owns the ``counts[r]`` entries after ``sum(counts[:r])``
        and has written them already; the others are overwritten with their
        owners' copies (bitwise). ``counts`` is the same on every rank. This
        default issues one broadcast per non-empty segment (named
        ``f"{name}.{r}"``); engines with a native all-gather override it.
        """
        offsets = check_gather_counts(tensor, counts, self.size, name)
        handles = [
            self.broadcast_async(tensor[offsets[r] : offsets[r] + counts[r]], r, f"{name}.{r}") for r in range(self.size) if counts[r] > 0
        ]
        return HandleGroup(handles)

    def gather_values(self, values: Sequence[float], name: str) -> list[list[float]]:
        """Every worker's ``values`` (as many on each), in rank order, exactly as each sent them (blocking)."""
        k = len(values)
        buf = torch.zeros(self.size * k, dtype=torch.float64)
        buf[self.rank * k : (self.rank + 1) * k] = torch.tensor(list(values), dtype=torch.float64)
        self.allgather_async(buf, [k] * self.size, name).wait()
        return buf.view(self.size, k).tolist()

    def barrier(self) -> None:
        """Block until every worker reaches this point."""
        self.allreduce_async(torch.zeros(1), "spdkfac.barrier").wait()

    def apart_from_default_group(self) -> None:  # noqa: B027  (a default that does nothing, not an abstract method)
        """Issue this engine's collectives on a process group of their own, apart from those others issue on the
        default ``torch.distributed`` group (``DistributedDataParallel``'s). Every rank calls it, at the same point.
        This default does nothing: an engine that is not torch.distributed's never shares its group."""

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

    def allgather_async(self, tensor: torch.Tensor, counts: Sequence[int], name: str) -> Handle:
        check_gather_counts(tensor, counts, 1, name)
        return CompletedHandle()

    def barrier(self) -> None:
        return None
