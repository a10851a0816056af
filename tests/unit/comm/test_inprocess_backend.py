"""The in-process engine (N ranks as threads): results, matching rules, failures."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from spdkfac.comm import CommBackend, get_backend
from spdkfac.comm.inprocess import (
    CollectiveAbortedError,
    CollectiveMismatchError,
    CollectiveTimeoutError,
    InProcessBackend,
    InProcessGroup,
    RankError,
    run_ranks,
)


def _local(rank: int, shape: tuple[int, ...] = (7, 5), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(shape, generator=g, dtype=dtype)


def _mismatch(fn, size: int = 2) -> RankError:
    with pytest.raises(RankError) as info:
        run_ranks(size, fn, timeout=10)
    assert isinstance(info.value.__cause__, CollectiveMismatchError), repr(info.value)
    return info.value


# -- results -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_allreduce_averages_and_every_rank_holds_the_same_bits(dtype):
    size = 3

    def fn(b: CommBackend) -> torch.Tensor:
        t = _local(b.rank, dtype=dtype)
        b.allreduce_async(t, "x").wait()
        return t

    out = run_ranks(size, fn)
    expected = _local(0, dtype=dtype).clone()
    for r in range(1, size):
        expected.add_(_local(r, dtype=dtype))
    expected.div_(size)
    for t in out:
        assert torch.equal(t, out[0])  # bitwise, like the real engines
        assert torch.equal(t, expected)  # summed in rank order, divided once
    mean = torch.stack([_local(r, dtype=dtype) for r in range(size)]).mean(0)
    assert torch.allclose(out[0], mean, rtol=1e-5, atol=1e-6)  # (torch.testing costs seconds to import)
    assert not torch.equal(out[0], _local(0, dtype=dtype))


def test_broadcast_copies_the_roots_tensor_into_every_rank():
    def fn(b: CommBackend) -> torch.Tensor:
        t = _local(b.rank)
        b.broadcast_async(t, 1, "w").wait()
        return t

    out = run_ranks(3, fn)
    for t in out:
        assert torch.equal(t, _local(1))


def test_non_contiguous_tensors_are_written_in_place():
    def fn(b: CommBackend) -> torch.Tensor:
        base = torch.zeros(4, 6)
        view = base[:, ::2]
        view.fill_(float(b.rank))
        b.allreduce_async(view, "strided").wait()
        return base

    for base in run_ranks(2, fn):
        assert torch.equal(base[:, ::2], torch.full((4, 3), 0.5))
        assert torch.equal(base[:, 1::2], torch.zeros(4, 3))


def test_many_outstanding_handles_waited_in_any_order():
    n = 20

    def fn(b: CommBackend) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        reduced = [torch.full((i + 1,), float(b.rank * 10 + i)) for i in range(n)]
        sent = [torch.full((2,), float(b.rank * 100 + i)) for i in range(n)]
        handles = []
        for i in range(n):  # interleaved: every rank posts all of them before waiting on any
            handles.append(b.allreduce_async(reduced[i], f"ar.{i}"))
            handles.append(b.broadcast_async(sent[i], i % b.size, f"bc.{i}"))
        for h in reversed(handles):
            h.wait()
            h.wait()  # idempotent
            assert h.done()
        return reduced, sent

    size = 3
    for reduced, sent in run_ranks(size, fn):
        for i in range(n):
            assert torch.equal(reduced[i], torch.full((i + 1,), sum(r * 10 + i for r in range(size)) / size))
            assert torch.equal(sent[i], torch.full((2,), float((i % size) * 100 + i)))


def test_a_collective_completes_when_the_last_rank_posts_it():
    posted = threading.Event()
    seen: list[bool] = []

    def fn(b: CommBackend) -> None:
        t = torch.ones(3)
        if b.rank == 0:
            h = b.allreduce_async(t, "x")
            seen.append(h.done())  # rank 1 has not posted yet
            posted.set()
            h.wait()
            seen.append(h.done())
        else:
            assert posted.wait(10)
            b.allreduce_async(t, "x").wait()

    run_ranks(2, fn)
    assert seen == [False, True]


def test_barrier_history_name_and_single_rank():
    group = InProcessGroup(2)

    def fn(b: InProcessBackend) -> str:
        b.allreduce_async(torch.zeros(1), "a").wait()
        b.barrier()
        b.broadcast_async(torch.zeros(1), 0, "b").wait()
        return repr(b)

    assert group.run(fn) == ["InProcessBackend(rank=0, size=2)", "InProcessBackend(rank=1, size=2)"]
    assert group.history == [("allreduce", "a"), ("barrier", "spdkfac.barrier"), ("broadcast", "b")]
    b0 = group.backends[0]
    assert b0.name == "inprocess"
    assert get_backend(b0) is b0
    assert b0.group is group

    def alone(b: CommBackend) -> torch.Tensor:
        t = torch.tensor([3.0])
        b.allreduce_async(t, "x").wait()
        b.barrier()
        return t

    assert run_ranks(1, alone)[0].item() == 3.0


def test_invalid_arguments():
    with pytest.raises(ValueError, match="size must be >= 1"):
        InProcessGroup(0)

    def integer(b: CommBackend) -> None:
        b.allreduce_async(torch.ones(2, dtype=torch.int64), "counts")

    with pytest.raises(RankError) as info:
        run_ranks(2, integer)
    assert isinstance(info.value.__cause__, TypeError)
    assert "floating-point" in str(info.value)

    def bad_root(b: CommBackend) -> None:
        b.broadcast_async(torch.ones(2), 2, "w")

    with pytest.raises(RankError, match="root 2 does not exist"):
        run_ranks(2, bad_root)


# -- matching rules ------------------------------------------------------------------------
def test_different_names_at_the_same_position_raise_naming_both():
    def fn(b: CommBackend) -> None:
        b.allreduce_async(torch.zeros(2), "common").wait()
        b.allreduce_async(torch.zeros(2), f"layer{b.rank}").wait()

    msg = str(_mismatch(fn))
    assert "collective #1" in msg
    assert "'layer0'" in msg
    assert "'layer1'" in msg
    assert "rank 0" in msg
    assert "rank 1" in msg


def test_different_issue_order_raises_even_with_matching_names():
    """torch.distributed matches by issue order: same set of names in another order is a bug."""

    def fn(b: CommBackend) -> None:
        names = ["a", "b"] if b.rank == 0 else ["b", "a"]
        handles = [b.allreduce_async(torch.zeros(2), n) for n in names]
        for h in handles:
            h.wait()

    msg = str(_mismatch(fn))
    assert "collective #0" in msg
    assert "'a'" in msg
    assert "'b'" in msg


@pytest.mark.parametrize(
    ("what", "post"),
    [
        ("shape", lambda b: b.allreduce_async(torch.zeros(2 + b.rank), "x")),
        ("dtype", lambda b: b.allreduce_async(torch.zeros(2, dtype=torch.float32 if b.rank else torch.float64), "x")),
        ("root", lambda b: b.broadcast_async(torch.zeros(2), b.rank, "x")),
        ("op", lambda b: b.broadcast_async(torch.zeros(2), 0, "x") if b.rank else b.allreduce_async(torch.zeros(2), "x")),
    ],
)
def test_shape_dtype_root_or_operation_mismatch_raises(what, post):
    def fn(b: CommBackend) -> None:
        post(b).wait()

    msg = str(_mismatch(fn))
    expected = {"shape": "shape=(3,)", "dtype": "torch.float32", "root": "root=1", "op": "broadcast"}[what]
    assert expected in msg
    assert "'x'" in msg


def test_a_rank_that_finishes_without_a_collective_its_peers_posted():
    def fn(b: CommBackend) -> None:
        b.allreduce_async(torch.zeros(1), "a").wait()
        if b.rank != 1:
            b.allreduce_async(torch.zeros(1), "extra").wait()

    start = time.monotonic()
    msg = str(_mismatch(fn, size=3))
    assert time.monotonic() - start < 5  # detected, not timed out
    assert "'extra'" in msg
    assert "rank(s) [1] already finished" in msg or "rank 1 finished" in msg


# -- failures --------------------------------------------------------------------------------
def test_an_exception_in_one_rank_surfaces_with_its_rank_and_does_not_hang():
    def fn(b: CommBackend) -> None:
        b.allreduce_async(torch.zeros(1), "a").wait()
        if b.rank == 2:
            raise ValueError("boom on purpose")
        b.allreduce_async(torch.zeros(1), "b").wait()  # the others block here until rank 2's failure stops them

    start = time.monotonic()
    with pytest.raises(RankError, match="rank 2 raised ValueError: boom on purpose") as info:
        run_ranks(3, fn, timeout=20)
    assert time.monotonic() - start < 5
    assert info.value.rank == 2
    assert isinstance(info.value.__cause__, ValueError)


def test_a_wait_that_times_out_names_what_each_rank_is_waiting_on():
    group = InProcessGroup(2, timeout=0.3)

    def fn(b: InProcessBackend) -> None:
        if b.rank == 0:
            b.allreduce_async(torch.zeros(1), "posted-by-0").wait()
        else:
            while b.group.failure is None:  # busy elsewhere, never posts; returns once the group is stopped
                time.sleep(0.01)

    with pytest.raises(RankError) as info:
        group.run(fn, timeout=10)
    assert isinstance(info.value.__cause__, CollectiveTimeoutError)
    msg = str(info.value)
    assert info.value.rank == 0
    assert "'posted-by-0'" in msg
    assert "not yet posted by rank(s) [1]" in msg


def test_run_times_out_when_ranks_never_return():
    release = threading.Event()
    group = InProcessGroup(2)

    def fn(b: InProcessBackend) -> None:
        if b.rank == 0:
            b.allreduce_async(torch.zeros(1), "stuck").wait()
        else:
            release.wait(10)

    try:
        with pytest.raises(CollectiveTimeoutError, match=r"did not finish within 0\.3 s") as info:
            group.run(fn, timeout=0.3)
        msg = str(info.value)
        assert "rank 0: waiting on #0 allreduce 'stuck'" in msg
        assert "rank 1: running" in msg
    finally:
        release.set()


def test_a_stopped_group_refuses_new_collectives():
    group = InProcessGroup(2)
    b0 = group.backends[0]
    group.abort(1, ValueError("gone"))
    with pytest.raises(CollectiveAbortedError, match="rank 1 raised ValueError: gone"):
        b0.allreduce_async(torch.zeros(1), "x")
