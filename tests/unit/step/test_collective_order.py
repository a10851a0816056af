"""The step's all-reduce order with parts that are not the optimizer's (in-process ranks): a blocking all-reduce
between the passes comes after the all-reduces the parts mark as the forward pass's, whatever their names."""

from __future__ import annotations

import pytest
import torch

from spdkfac.comm import CommBackend
from spdkfac.comm.inprocess import CollectiveMismatchError, InProcessGroup, RankError
from spdkfac.step.collective_order import AGREEMENT, CollectiveOrder, DeferredHandle, Slot

# Two all-reduces the forward pass starts, one the backward pass starts; none named like the optimizer's.
SLOTS = [Slot("embed.stats", 0.0, forward=True), Slot("aux.stats", 1.0, forward=True), Slot("trunk.grad", 2.0)]


class _Part:
    """An order participant holding one tensor per all-reduce this rank has data for."""

    def __init__(self, order: CollectiveOrder, slots: list[Slot]) -> None:
        self.order, self.slots = order, slots
        self.tensors: dict[str, torch.Tensor] = {}
        self.handles: dict[str, DeferredHandle] = {}

    def start(self, name: str, value: float) -> None:
        self.tensors[name] = torch.full((3,), value, dtype=torch.float64)
        self.handles[name] = self.order.allreduce(self.tensors[name], name)

    def universe(self) -> list[Slot]:
        return list(self.slots)

    def send_held(self) -> None:
        pass

    def fill(self, name: str) -> None:
        self.start(name, 0.0)

    def report(self) -> list[float]:
        return []

    def agreed(self, present: dict[str, int], summed: list[int], workers: int) -> None:
        pass


def _steps(backend: CommBackend, slots: list[Slot], steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """Steps in which the forward pass's second all-reduce has data on rank 0 only (a layer run there only)."""
    order = CollectiveOrder(backend)
    part = _Part(order, slots)
    order.add(part)
    out = []
    for _ in range(steps):
        order.begin()
        part.tensors, part.handles = {}, {}
        part.start(slots[0].name, 1.0 + backend.rank)
        if backend.rank == 0:
            part.start(slots[1].name, 4.0)
        flag = torch.ones(1, dtype=torch.float64)
        order.sync_allreduce(flag, "between.passes")  # as finite_everywhere after the forward pass
        part.start(slots[2].name, 2.0 * backend.rank)
        order.settle()
        for handle in part.handles.values():
            handle.wait()
        out.append(dict(part.tensors))
    return out


def test_a_blocking_allreduce_between_the_passes_comes_after_the_forward_passs_ones_whatever_their_names():
    group = InProcessGroup(2, timeout=20)
    ranks = group.run(lambda b: _steps(b, SLOTS))
    one_step = ["embed.stats", "aux.stats", "between.passes", "trunk.grad", AGREEMENT]
    assert [name for _, name in group.history] == one_step * 2  # the backward pass's all-reduce after it
    for steps in ranks:
        for tensors in steps:
            assert torch.equal(tensors["embed.stats"], torch.full((3,), 1.5, dtype=torch.float64))
            assert torch.equal(tensors["aux.stats"], torch.full((3,), 2.0, dtype=torch.float64))  # zeros on rank 1
            assert torch.equal(tensors["trunk.grad"], torch.full((3,), 1.0, dtype=torch.float64))


def test_without_the_forward_mark_the_ranks_would_pair_different_allreduces():
    """The mark, not the name, decides: unmarked, rank 1 issues the blocking all-reduce where rank 0 issues
    its second forward all-reduce, and the engine refuses the pairing (the case the mark exists for)."""
    unmarked = [slot._replace(forward=False) for slot in SLOTS]
    with pytest.raises(RankError) as info:
        InProcessGroup(2, timeout=20).run(lambda b: _steps(b, unmarked, steps=1))
    assert isinstance(info.value.__cause__, CollectiveMismatchError)
