"""A gradient the script changes between ``backward()`` and ``step()`` (clipping) while its all-reduce runs.

Without DDP the optimizer averages each gradient in an all-reduce started
during ``backward()``. The most common loop, ``backward();
clip_grad_norm_(...); step()``, clipped the local gradients while their
averages were being computed: on 2 torchrun workers the result was silently
another one than the single process's (measured, one-off). The first step now
completes the averages at the end of ``backward()`` and tells from the
gradients' version counters whether the script changed them: a loop that
clips keeps them completed there (as DDP does) and clips the averages, a loop
that does not gets them overlapped with ``step()``'s work from then on, and
one that begins changing them later is refused, naming ``synchronize()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from nets import assert_bitwise_equal

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import SingleProcessBackend
from spdkfac.comm.inprocess import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]

KW = dict(lr=0.1, damping=0.01, factor_update_freq=1, inv_update_freq=1)


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 4))


def _data(rank: int, size: int, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(s)
    x, y = torch.randn(16, 6, generator=g) * 3, torch.randint(0, 4, (16,), generator=g)
    return x.chunk(size)[rank], y.chunk(size)[rank]


def _train(backend: Any, model: nn.Module, synchronize: bool, steps: int = 4, clip_from: int = 0) -> dict[str, torch.Tensor]:
    opt = SPDKFACOptimizer(model, backend=backend, **KW)
    averaged_in_backward = []
    for s in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(_data(backend.rank, backend.size, s)[0]), _data(backend.rank, backend.size, s)[1]).backward()
        averaged_in_backward.append(opt.kfac_step.grads.synchronized)
        if synchronize:
            opt.synchronize()
        if s >= clip_from:
            nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    return {**{k: v.detach().clone() for k, v in model.state_dict().items()}, "averaged_in_backward": torch.tensor(averaged_in_backward)}


def _single(clip_from: int = 0) -> dict[str, torch.Tensor]:
    return _train(SingleProcessBackend(), _net(), synchronize=False, clip_from=clip_from)


def _params(result: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in result.items() if k != "averaged_in_backward"}


@pytest.mark.parametrize("synchronize", [False, True])
def test_clipping_from_the_first_step_is_the_single_process_clipping(synchronize):
    """With or without synchronize(): the loop clips from its first step, so every step's averages are completed at
    the end of backward() and clipped there, as on one process."""
    models = [_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(b, models[b.rank], synchronize=synchronize), timeout=60)
    assert_bitwise_equal(ranks[0], ranks[1], "rank 1 vs rank 0")
    single = _params(_single())
    for key, value in single.items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-12, atol=1e-14)
    assert ranks[0]["averaged_in_backward"].tolist() == [True] * 4
    unclipped = SPDKFACOptimizer(net := _net(), backend=SingleProcessBackend(), **KW)
    for s in range(4):
        unclipped.zero_grad()
        F.cross_entropy(net(_data(0, 1, s)[0]), _data(0, 1, s)[1]).backward()
        unclipped.step()
    assert max(float((net.state_dict()[k] - v).abs().max()) for k, v in single.items()) > 1e-4  # the clip acted


def test_a_loop_that_changes_no_gradient_averages_them_in_step_after_the_first():
    models = [_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(b, models[b.rank], synchronize=False, clip_from=99), timeout=60)
    assert ranks[0]["averaged_in_backward"].tolist() == [True, False, False, False]
    for key, value in _params(_single(clip_from=99)).items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-12, atol=1e-14)


def test_clipping_that_begins_later_is_refused_unless_synchronized():
    models = [_net() for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"changed \(clipped.*first step changed no gradient.*optimizer\.synchronize\(\)"):
        run_ranks(2, lambda b: _train(b, models[b.rank], synchronize=False, clip_from=2), timeout=60)
    models = [_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(b, models[b.rank], synchronize=True, clip_from=2), timeout=60)
    for key, value in _params(_single(clip_from=2)).items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-12, atol=1e-14)


def test_the_preconditioners_loop_is_checked_alike():
    def run(backend: Any, model: nn.Module, synchronize: bool, clip_from: int) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        preconditioner = KFACPreconditioner(model, lr=0.1, backend=backend)
        for s in range(3):
            optimizer.zero_grad()
            x, y = _data(backend.rank, backend.size, s)
            F.cross_entropy(model(x), y).backward()
            if synchronize:
                preconditioner.synchronize()
            if s >= clip_from:
                nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            preconditioner.step()
            optimizer.step()

    for clip_from, synchronize in ((0, False), (1, True)):
        models = [_net() for _ in range(2)]
        run_ranks(2, lambda b, m=models, c=clip_from, s=synchronize: run(b, m[b.rank], s, c), timeout=60)
    models = [_net() for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"preconditioner\.synchronize\(\)"):
        run_ranks(2, lambda b: run(b, models[b.rank], False, 1), timeout=60)


def _counting_transport(backend: Any) -> Any:
    """The engine, counting a write of each average while the script runs on, as gloo writes a CUDA
    tensor's (copy_() on its worker thread): here when the next all-reduce is issued."""
    issue, in_flight = backend.allreduce_async, []

    def allreduce_async(tensor: torch.Tensor, name: str) -> Any:
        for sent in in_flight:
            torch.autograd.graph.increment_version(sent)  # what a counted write does to the counter (values kept)
        in_flight[:] = [tensor]
        return issue(tensor, name)

    backend.allreduce_async = allreduce_async
    return backend


def test_the_transports_own_write_is_not_the_scripts_change():
    """Found on a GPU (2 processes, gloo over CUDA tensors): every step was refused, because gloo's write of the
    average moved the gradient's version counter. The transport writes through an alias with a counter of its own."""
    models = [_net() for _ in range(2)]
    ranks = run_ranks(2, lambda b: _train(_counting_transport(b), models[b.rank], synchronize=True, clip_from=2), timeout=60)
    for key, value in _params(_single(clip_from=2)).items():
        torch.testing.assert_close(ranks[0][key], value, rtol=1e-12, atol=1e-14)
    models = [_net() for _ in range(2)]  # the script's own change is still found
    with pytest.raises(RuntimeError, match=r"changed \(clipped"):
        run_ranks(2, lambda b: _train(_counting_transport(b), models[b.rank], synchronize=False, clip_from=2), timeout=60)
