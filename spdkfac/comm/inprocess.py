"""An in-process engine: ``size`` ranks as threads of one process, for unit tests.

:class:`InProcessGroup` holds the shared state of ``size`` ranks and one
:class:`InProcessBackend` per rank; each backend is meant to be driven by its
own thread (:func:`run_ranks` starts them). Collectives follow the strictest
rule of the real engines: torch.distributed matches collectives by issue
order and Horovod by name, so here the ``k``-th collective every rank posts
must be the same operation with the same name (and root, shape and dtype);
anything else raises :class:`CollectiveMismatchError` naming both sides,
which is the bug class this engine exists to catch.

A collective completes when the last rank posts it: that rank computes the
result once (an all-reduce sums the ranks' tensors in rank order, then
divides by ``size``) and copies it into every rank's tensor, so all ranks
hold bitwise identical results, as with the real engines. Posting returns a
handle at once, and a rank may post any number of collectives before
waiting on one. A rank that waits longer than the group's timeout, a rank
that fails, or a rank that finishes while the others still expect a
collective from it stops the whole group with an error that says what each
rank is waiting on, so a test fails instead of hanging.

Example::

    def step(backend: CommBackend) -> torch.Tensor:
        t = torch.full((3,), float(backend.rank))
        backend.allreduce_async(t, "x").wait()
        return t

    assert all(t.tolist() == [0.5] * 3 for t in run_ranks(2, step))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Callable, TypeVar, cast

import torch

from .base import CommBackend, Handle
from .errors import CollectiveError, CollectiveTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "CollectiveAbortedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "InProcessBackend",
    "InProcessGroup",
    "RankError",
    "run_ranks",
]

DEFAULT_TIMEOUT = 60.0  # seconds a rank may wait on one collective, and a whole run_ranks call may take

T = TypeVar("T")


class CollectiveMismatchError(CollectiveError):
    """Ranks posted different collectives at the same position of their sequences (or one rank finished without it)."""


class CollectiveAbortedError(CollectiveError):
    """The group was stopped because of a failure elsewhere (another rank's error, a mismatch, a timeout)."""


class RankError(RuntimeError):
    """An exception raised by one rank's function in :func:`run_ranks`; the original is ``__cause__``."""

    def __init__(self, rank: int, error: BaseException) -> None:
        super().__init__(f"rank {rank} raised {type(error).__name__}: {error}")
        self.rank = rank
        self.error = error


@dataclass
class _Post:
    """One rank's side of a collective."""

    rank: int
    tensor: torch.Tensor


@dataclass
class _Slot:
    """The ``index``-th collective of every rank."""

    index: int
    op: str  # "allreduce", "broadcast" or "barrier"
    name: str
    root: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    first_rank: int
    members: tuple[int, ...] | None = None  # a sub-group broadcast's ranks (the others post it too, and get nothing)
    posts: dict[int, _Post] = field(default_factory=dict)
    done: bool = False

    def describe(self) -> str:
        root = f" root={self.root}" if self.root is not None else ""
        within = f" members={list(self.members)}" if self.members is not None else ""
        return f"#{self.index} {self.op} {self.name!r}{root}{within} shape={self.shape} dtype={self.dtype}"


class _Handle:
    """The handle of one rank's side of a collective."""

    __slots__ = ("_group", "_rank", "_slot")

    def __init__(self, group: InProcessGroup, slot: _Slot, rank: int) -> None:
        self._group = group
        self._slot = slot
        self._rank = rank

    def wait(self) -> None:
        self._group._wait(self._slot, self._rank)

    def done(self) -> bool:
        """True once complete; raises if the group was stopped before it completed."""
        with self._group._cond:
            if not self._slot.done and self._group._failure is not None:
                raise CollectiveAbortedError(f"rank {self._rank}: {self._group._failure}")
            return self._slot.done


class InProcessBackend(CommBackend):
    """One rank of an :class:`InProcessGroup`; use it from one thread only."""

    name = "inprocess"

    def __init__(self, group: InProcessGroup, rank: int) -> None:
        self._group = group
        self._rank = rank

    @property
    def group(self) -> InProcessGroup:
        """The group this rank belongs to."""
        return self._group

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    def allreduce_async(self, tensor: torch.Tensor, name: str) -> Handle:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(f"all-reduce {name!r} averages, so it needs a floating-point tensor, got {tensor.dtype}")
        return self._group._post(self._rank, "allreduce", name, None, tensor)

    def broadcast_async(self, tensor: torch.Tensor, root: int, name: str) -> Handle:
        if not 0 <= root < self._group.size:
            raise ValueError(f"broadcast {name!r}: root {root} does not exist in a group of {self._group.size}")
        return self._group._post(self._rank, "broadcast", name, root, tensor)

    native_subgroups = True

    def broadcast_within_async(self, tensor: torch.Tensor, root: int, members: Sequence[int], name: str) -> Handle:
        members = tuple(members)
        if root not in members or not all(0 <= r < self._group.size for r in members):
            raise ValueError(f"broadcast {name!r}: root {root} and members {list(members)} must be ranks of the group, root a member")
        return self._group._post(self._rank, "broadcast", name, root, tensor, members)

    def barrier(self) -> None:
        self._group._post(self._rank, "barrier", "spdkfac.barrier", None, torch.zeros(0)).wait()


class InProcessGroup:
    """Shared state of ``size`` in-process ranks; :attr:`backends` holds one engine per rank.

    Args:
        size: number of ranks.
        timeout: seconds a rank may block in one ``wait()`` before the group
            is stopped with a :class:`CollectiveTimeoutError`.
    """

    def __init__(self, size: int, timeout: float = DEFAULT_TIMEOUT) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self.timeout = timeout
        self._cond = threading.Condition()
        self._slots: dict[int, _Slot] = {}  # collectives not yet complete, by index
        self._posted = [0] * size  # collectives each rank has posted
        self._waiting: list[_Slot | None] = [None] * size
        self._finished: list[bool] = [False] * size
        self._failure: CollectiveError | None = None
        self._failed_rank: int | None = None
        self._history: list[tuple[str, str]] = []
        self.backends: tuple[InProcessBackend, ...] = tuple(InProcessBackend(self, r) for r in range(size))

    @property
    def history(self) -> list[tuple[str, str]]:
        """``(op, name)`` of every completed collective, in order (barriers included)."""
        with self._cond:
            return list(self._history)

    # -- posting and waiting ---------------------------------------------------------
    def _post(
        self, rank: int, op: str, name: str, root: int | None, tensor: torch.Tensor, members: tuple[int, ...] | None = None
    ) -> _Handle:
        with self._cond:
            self._check_alive(rank)
            index = self._posted[rank]
            self._posted[rank] += 1
            slot = self._slots.get(index)
            # A sub-group broadcast's non-members post an empty tensor: its shape is compared among members only.
            outside = members is not None and rank not in members
            shape = (-1,) if outside else tuple(tensor.shape)
            if slot is not None and slot.shape == (-1,) and not outside:
                slot.shape = shape
            if slot is None:
                slot = _Slot(index, op, name, root, shape, tensor.dtype, rank, members)
                self._slots[index] = slot
                gone = [r for r in range(self.size) if self._finished[r] and self._posted[r] <= index]
                if gone:
                    raise self._fail(
                        rank,
                        CollectiveMismatchError(
                            f"rank {rank} posted collective {slot.describe()}, but rank(s) {gone} already finished "
                            f"after posting {[self._posted[r] for r in gone]} collective(s)\n{self._state()}"
                        ),
                    )
            else:
                mine = _Slot(index, op, name, root, shape, tensor.dtype, rank, members)
                same_shape = outside or mine.shape == slot.shape
                if not same_shape or (op, name, root, members, tensor.dtype) != (slot.op, slot.name, slot.root, slot.members, slot.dtype):
                    raise self._fail(
                        rank,
                        CollectiveMismatchError(
                            f"ranks disagree on collective #{index}: rank {slot.first_rank} posted "
                            f"{slot.describe()}, rank {rank} posted {mine.describe()}"
                        ),
                    )
            slot.posts[rank] = _Post(rank, tensor)
            if len(slot.posts) == self.size:
                self._complete(slot)
            return _Handle(self, slot, rank)

    def _complete(self, slot: _Slot) -> None:
        """Compute the result once and copy it into every rank's tensor (called with the lock held)."""
        tensors = [slot.posts[r].tensor for r in range(self.size)]
        with torch.no_grad():
            if slot.op == "allreduce":
                result = tensors[0].clone()
                for t in tensors[1:]:
                    result.add_(t)
                if self.size > 1:
                    result.div_(self.size)
            elif slot.op == "broadcast":
                assert slot.root is not None
                result = tensors[slot.root].clone()
            else:
                result = tensors[0]
            if slot.op != "barrier":
                for r, t in enumerate(tensors):
                    if slot.members is None or r in slot.members:
                        # (a transport's write, as gloo's: invisible to the tensor's version counter, which tells
                        # changes the script makes while the collective runs: step/grad_sync.py)
                        with torch.autograd.grad_mode._unsafe_preserve_version_counter(t):
                            t.copy_(result)
        slot.done = True
        slot.posts.clear()  # drop the references to the ranks' tensors
        del self._slots[slot.index]
        self._history.append((slot.op, slot.name))
        self._cond.notify_all()

    def _wait(self, slot: _Slot, rank: int) -> None:
        deadline = time.monotonic() + self.timeout
        with self._cond:
            self._waiting[rank] = slot
            try:
                while not slot.done:
                    self._check_alive(rank)
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise self._fail(
                            rank,
                            CollectiveTimeoutError(
                                f"rank {rank} waited {self.timeout:g} s for collective {slot.describe()}\n{self._state()}"
                            ),
                        )
                    self._cond.wait(left)
            finally:
                self._waiting[rank] = None

    # -- failures --------------------------------------------------------------------
    def _check_alive(self, rank: int) -> None:
        if self._failure is not None:
            raise CollectiveAbortedError(f"rank {rank} stopped: {self._failure}")

    def _fail(self, rank: int, error: CollectiveError) -> CollectiveError:
        """Stop the group with ``error`` (first failure wins) and wake every waiting rank; returns ``error``. Lock held."""
        if self._failure is None:
            self._failure = error
            self._failed_rank = rank
        self._cond.notify_all()
        return error

    def abort(self, rank: int, error: BaseException) -> None:
        """Stop the group because ``rank`` failed with ``error``: the other ranks' waits raise."""
        with self._cond:
            if isinstance(error, CollectiveError):
                self._fail(rank, error)
            else:
                self._fail(rank, CollectiveAbortedError(f"rank {rank} raised {type(error).__name__}: {error}"))

    def finish(self, rank: int) -> None:
        """Record that ``rank`` will post no more collectives; fails the group if peers still expect some."""
        with self._cond:
            self._finished[rank] = True
            expected = [s for s in self._slots.values() if rank not in s.posts]
            if expected and self._failure is None:
                self._fail(
                    rank,
                    CollectiveMismatchError(
                        f"rank {rank} finished after posting {self._posted[rank]} collective(s), but its peers "
                        f"posted {', '.join(s.describe() for s in sorted(expected, key=lambda s: s.index))}\n{self._state()}"
                    ),
                )

    @property
    def failure(self) -> CollectiveError | None:
        """The error that stopped the group, if any."""
        return self._failure

    def describe_state(self) -> str:
        """What each rank has posted and is waiting on (for error messages)."""
        with self._cond:
            return self._state()

    def _state(self) -> str:
        lines = []
        for r in range(self.size):
            waiting = self._waiting[r]
            if self._finished[r]:
                what = "finished"
            elif waiting is not None:
                missing = [p for p in range(self.size) if p not in waiting.posts]
                what = f"waiting on {waiting.describe()} (not yet posted by rank(s) {missing})"
            else:
                what = "running"
            pending = sorted((s for s in self._slots.values() if r in s.posts), key=lambda s: s.index)
            outstanding = "; posted, incomplete: " + ", ".join(s.describe() for s in pending) if pending else ""
            lines.append(f"  rank {r}: {what}; {self._posted[r]} collective(s) posted{outstanding}")
        return "state of the ranks:\n" + "\n".join(lines)

    # -- running ---------------------------------------------------------------------
    def run(self, fn: Callable[[InProcessBackend], T], timeout: float | None = None) -> list[T]:
        """Run ``fn(backend)`` for every rank, each in its own thread; return the results in rank order.

        Raises:
            RankError: the first exception a rank raised (a failure's root
                cause is preferred over the errors it caused in other ranks),
                with the rank in its message and the exception as ``__cause__``.
            CollectiveTimeoutError: the ranks did not all return within
                ``timeout`` seconds (default: the group's).
        """
        limit = self.timeout if timeout is None else timeout
        results: list[T | None] = [None] * self.size
        errors: list[tuple[int, BaseException]] = []
        lock = threading.Lock()

        def body(rank: int) -> None:
            try:
                results[rank] = fn(self.backends[rank])
            except BaseException as exc:
                with lock:
                    errors.append((rank, exc))
                self.abort(rank, exc)
            finally:
                self.finish(rank)

        threads = [threading.Thread(target=body, args=(r,), name=f"inprocess-rank-{r}", daemon=True) for r in range(self.size)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads):
            with self._cond:
                state = self._state()
                self._fail(-1, CollectiveTimeoutError(f"the ranks did not finish within {limit:g} s\n{state}"))
            for t in threads:
                t.join(0.1)
            raise CollectiveTimeoutError(f"the ranks did not finish within {limit:g} s\n{state}")
        if errors or self._failure is not None:
            rank, exc = self._root_cause(errors)
            raise RankError(rank, exc) from exc
        return [cast(T, r) for r in results]

    def _root_cause(self, errors: Sequence[tuple[int, BaseException]]) -> tuple[int, BaseException]:
        """The error to report: the one that stopped the group rather than those it caused in other ranks."""
        primary = [(r, e) for r, e in errors if not isinstance(e, CollectiveAbortedError)]
        for r, e in primary:
            if r == self._failed_rank:
                return r, e
        if primary:
            return primary[0]
        if self._failure is not None and self._failed_rank is not None and self._failed_rank >= 0:
            return self._failed_rank, self._failure  # found when a rank returned: nobody raised it
        return errors[0]


def run_ranks(size: int, fn: Callable[[InProcessBackend], T], timeout: float = DEFAULT_TIMEOUT) -> list[T]:
    """Run ``fn(backend)`` on ``size`` fresh in-process ranks (one thread each); results in rank order.

    See :meth:`InProcessGroup.run` for the errors.
    """
    return InProcessGroup(size, timeout=timeout).run(fn)
