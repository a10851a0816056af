"""One issue order for a step's all-reduces on every rank, whichever layers ran where (docs/shared-layers.md).

torch.distributed (and the in-process engine) pair collectives by the order
they are issued in, and the hooks start a step's factor and gradient
all-reduces as their layers run. When a layer runs on some ranks only (an
auxiliary head fed by one rank's data), those orders would differ and
all-reduces of equal size could pair silently. So the hooks' all-reduces go
through one :class:`CollectiveOrder` per step:

* an all-reduce is issued once every one *expected* before it has been: the
  expected order is the last step's that held the same set of possible
  all-reduces, agreed on every rank, so in the common case each is issued
  the moment its hook asks (nothing changes), and a rank that misses one
  holds back those after it until ``step()``. A set of all-reduces not met
  before (the first step, the first plain step, a new fusion plan) is
  expected in the order of the last agreed one (a fused group where its last
  member was), else in a fixed guess: the factors ``A`` in parameter order,
  then each layer's ``G`` and the gradients in reverse parameter order;
* at ``step()`` (:meth:`settle`) each part sends what it kept back, the
  expected all-reduces this rank did not start are started with zeros, and
  one small all-reduce, the *agreement*, tells every rank which all-reduces
  each rank had data for, each part's counts (which layers ran where, their
  calls and samples) and a hash of each rank's arrival order;
* all-reduces no rank expected (the first step, a layer back after a step in
  which it ran nowhere) are then issued in a fixed order, with zeros where a
  rank has no data. The next step expects the order every rank agreed on:
  the ranks' common arrival order when their hashes agree, else this step's
  issue order.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from ..comm.base import CommBackend, Handle

__all__ = ["AGREEMENT", "CollectiveOrder", "DeferredHandle", "OrderParticipant", "Slot"]

#: The name of the agreement all-reduce.
AGREEMENT = "spdkfac.step.agreement"
_HASH_BITS = 20  # two 20-bit hashes: their squares summed over ≤ 1024 ranks stay exact in float64


class DeferredHandle:
    """The handle of an all-reduce that may not be issued yet: not done until issued; waited for after :meth:`CollectiveOrder.settle`."""

    __slots__ = ("handle", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.handle: Handle | None = None

    def wait(self) -> None:
        if self.handle is None:
            raise RuntimeError(f"all-reduce {self.name!r} waited for before it was issued (settle the step's order first)")
        self.handle.wait()

    def done(self) -> bool:
        return self.handle is not None and self.handle.done()


class Slot(NamedTuple):
    """One all-reduce a part may start in a step: its name, its place in the fixed guess, the names whose
    place it takes in an order learned before it existed (a fused group: its members sent alone), and whether
    the forward pass starts it (the factors ``A``: a blocking all-reduce between the passes comes after it)."""

    name: str
    guess: float
    anchors: tuple[str, ...] = ()
    forward: bool = False


class OrderParticipant(Protocol):
    """A part of the step that starts all-reduces through the order (the factor hooks, the gradient averaging)."""

    def universe(self) -> list[Slot]:
        """Every all-reduce this part may start in this step, in a fixed order (the same on every rank)."""
        ...

    def send_held(self) -> None:
        """Start what this part kept back until ``step()`` (before the agreement)."""
        ...

    def fill(self, name: str) -> None:
        """Start the all-reduce ``name`` (of the universe) with zeros where this rank has no data for it."""
        ...

    def report(self) -> list[float]:
        """This part's entries in the agreement (summed over the ranks)."""
        ...

    def agreed(self, present: dict[str, int], summed: list[int], workers: int) -> None:
        """The agreement: per all-reduce of the universe, the ranks that had data for it, and this part's summed
        entries. All-reduces started here are issued at once, in call order (the same on every rank)."""
        ...


@dataclass
class _Held:
    tensor: torch.Tensor
    handle: DeferredHandle


class CollectiveOrder:
    """Issues a step's hook all-reduces in an order every rank agrees on, and settles the rest at ``step()``."""

    def __init__(self, backend: CommBackend, params: Sequence[torch.Tensor] = ()) -> None:
        self.backend = backend
        #: Each parameter's place, for the fixed guess (the model's parameters come in forward order, mostly).
        self.position = {p: i for i, p in enumerate(params)}
        self.participants: list[OrderParticipant] = []
        #: The agreed issue order, per set of possible all-reduces (a factor step and a plain step differ).
        self._learned: dict[tuple[str, ...], list[str]] = {}
        self._last: list[str] = []  # the order learned last (the guess for a set not met before)
        self.agreements = 0  # agreement all-reduces issued (one per step with several workers)
        self.agreement_entries = 0  # float64 values in the last agreement (its size)
        self.begin()

    def add(self, participant: OrderParticipant) -> None:
        """Register a part that starts all-reduces through this order."""
        self.participants.append(participant)

    def begin(self) -> None:
        """Start a step: nothing issued, nothing held."""
        self._universe: tuple[str, ...] | None = None
        self._owner: dict[str, OrderParticipant] = {}
        self._forward: set[str] = set()  # the all-reduces of this step's universe that the forward pass starts
        self._expected: list[str] = []
        self._pos = 0
        self._held: dict[str, _Held] = {}
        self._real: list[str] = []  # names this rank had data for, in arrival order
        self._filling = False
        self.settled = False

    def _start_universe(self) -> None:
        """Fix this step's possible all-reduces and the order expected (on the first all-reduce or at settle)."""
        slots: list[Slot] = []
        for part in self.participants:
            for slot in part.universe():
                self._owner[slot.name] = part
                if slot.forward:
                    self._forward.add(slot.name)
                slots.append(slot)
        self._universe = tuple(slot.name for slot in slots)
        learned = self._learned.get(self._universe)
        if learned is not None:  # (those not in it ran nowhere then: issued after the agreement if they run)
            self._expected = list(learned)
            return
        index = {name: i for i, name in enumerate(self._last)}

        def place(slot: Slot) -> tuple[int, float]:
            if slot.name in index:
                return 0, float(index[slot.name])
            hits = [index[a] for a in slot.anchors if a in index]
            return (0, max(hits) + 0.5) if hits else (1, slot.guess)

        self._expected = [slot.name for slot in sorted(slots, key=place)]

    def allreduce(self, tensor: torch.Tensor, name: str) -> DeferredHandle:
        """Average ``tensor`` in place across the workers, issued in the agreed order (see the module docstring)."""
        if self._universe is None:
            self._start_universe()
        handle = DeferredHandle(name)
        if not self._filling:
            self._real.append(name)
        if self.settled:  # after the agreement: every rank starts the same all-reduces in the same order
            handle.handle = self.backend.allreduce_async(tensor, name)
            return handle
        self._held[name] = _Held(tensor, handle)
        self._advance()
        return handle

    def _advance(self) -> None:
        while self._pos < len(self._expected) and self._expected[self._pos] in self._held:
            self._issue(self._expected[self._pos])
            self._pos += 1

    def _issue(self, name: str) -> None:
        held = self._held.pop(name)
        held.handle.handle = self.backend.allreduce_async(held.tensor, name)

    def _fill(self, name: str) -> None:
        self._filling = True
        try:
            self._owner[name].fill(name)
        finally:
            self._filling = False

    def _issue_expected(self, until: int) -> None:
        """Issue the expected all-reduces before index ``until``, started with zeros where this rank has no data."""
        while self._pos < until:
            name = self._expected[self._pos]
            if name not in self._held:
                self._fill(name)
                if name not in self._held and self._pos < until and self._expected[self._pos] == name:  # not started
                    raise RuntimeError(f"internal: the part that owns all-reduce {name!r} did not start it when asked to")
            self._advance()

    def sync_allreduce(self, tensor: torch.Tensor, name: str) -> None:
        """A blocking all-reduce between the passes (``finite_everywhere``, after a forward pass): the expected ones
        before it (the forward pass's factors) are issued first, with zeros where this rank has none."""
        if self._universe is None:
            self._start_universe()
        if not self.settled:
            if name in self._expected:
                until = self._expected.index(name)
            else:  # not called in the step this order was learned from: the forward pass's ones expected next
                until = self._pos
                while until < len(self._expected) and self._expected[until] in self._forward:
                    until += 1
            self._issue_expected(until)
            if name in self._expected and self._expected.index(name) == self._pos:
                self._pos += 1
        self._real.append(name)
        self.backend.allreduce_async(tensor, name).wait()

    def settle(self) -> None:
        """Issue every all-reduce of the step in the agreed order, and tell the parts what the ranks did (idempotent).

        Call where every rank arrives once per step, before waiting on any of the step's all-reduces.
        """
        if self.settled:
            return
        if self._universe is None:
            self._start_universe()
        assert self._universe is not None
        workers = self.backend.size
        for part in self.participants:
            part.send_held()
        if workers > 1:  # (one worker: the parts keep their data, nothing to order)
            self._issue_expected(len(self._expected))
        local = set(self._real)
        present = [1.0 if name in local else 0.0 for name in self._universe]
        reports = [part.report() for part in self.participants]
        h1, h2 = _hashes(self._real)
        values = present + [float(h1), float(h1 * h1), float(h2), float(h2 * h2)] + [v for r in reports for v in r]
        mask = torch.tensor(values, dtype=torch.float64)
        self.agreement_entries = len(values)
        if workers > 1:
            self.backend.allreduce_async(mask, AGREEMENT).wait()
            self.agreements += 1
        summed = [round(v) for v in mask.mul_(workers).tolist()]  # exact: integers well below 2**52
        counts = dict(zip(self._universe, summed))
        s1, q1, s2, q2 = summed[len(self._universe) : len(self._universe) + 4]
        same_arrival = workers * q1 == s1 * s1 and workers * q2 == s2 * s2
        self.settled = True
        offset = len(self._universe) + 4
        for part, report in zip(self.participants, reports):
            part.agreed(counts, summed[offset : offset + len(report)], workers)
            offset += len(report)
        if workers == 1:
            return
        expected = set(self._expected)
        issued = [n for n in self._expected if counts[n] > 0]
        for name in self._universe:  # no rank expected them: in the universe's order, zeros where no data
            if counts[name] > 0 and name not in expected:
                if name not in self._held:
                    self._fill(name)  # issued at once (settled)
                else:
                    self._issue(name)
                issued.append(name)
        real = [n for n in self._real if n in counts and counts[n] > 0]
        self._last = self._learned[self._universe] = real if same_arrival and len(real) == len(issued) else issued


def _hashes(names: list[str]) -> tuple[int, int]:
    """Two 20-bit hashes of an arrival order (equal orders give equal hashes on every rank)."""
    data = "\x00".join(names).encode()
    mask = (1 << _HASH_BITS) - 1
    return zlib.crc32(data) & mask, zlib.adler32(data) & mask
