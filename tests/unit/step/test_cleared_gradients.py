"""Backward passes whose gradients the script clears before ``step()`` are dropped, as ``optimizer.zero_grad()`` does.

PyTorch's DCGAN example clears the discriminator's gradients with the
module's ``netD.zero_grad()``, not the optimizer's, after the generator's
step has run a forward and backward pass through the discriminator. That
pass counted as the discriminator's next micro-batch: its real and fake
passes then raised "computed 3 times" (or, with factors every few steps,
"received gradient number 3"). A forward or backward pass that finds every
gradient of the step's earlier passes cleared (None) now drops those passes;
the reference is the same loop with the optimizer's ``zero_grad()``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from nets import assert_bitwise_equal

from spdkfac import SPDKFACOptimizer
from spdkfac.comm.inprocess import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given"), pytest.mark.usefixtures("float64")]


def _gan(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    generator = nn.Sequential(nn.Linear(4, 12), nn.ReLU(), nn.Linear(12, 6))
    discriminator = nn.Sequential(nn.Linear(6, 12), nn.LeakyReLU(0.2), nn.Linear(12, 1))
    return generator, discriminator


def _train(
    clear: str,
    summed: bool,
    freq: int,
    backend: Any = "single",
    rank: int = 0,
    size: int = 1,
    nets: tuple[nn.Module, nn.Module] | None = None,
    late: bool = False,
    in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """The DCGAN example's loop: the discriminator on real and fake batches (two backward passes, or one of the
    summed losses), then the generator through the discriminator; ``clear`` says whose zero_grad() clears them.
    ``nets``: built by the caller for in-process ranks (seeding is process-wide). ``late``: the discriminator's
    gradients are cleared after its summed loss's forward pass, before its backward; ``in_place``: zeroed in place."""
    generator, discriminator = _gan() if nets is None else nets
    kw = dict(lr=0.01, base="adamw", damping=0.01, factor_update_freq=freq, inv_update_freq=freq, backend=backend)
    opt_g = SPDKFACOptimizer(generator, **kw)
    opt_d = SPDKFACOptimizer(discriminator, accumulation_steps=1 if summed else 2, **kw)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        real = (torch.randn(8 * size, 6, generator=g) + 2)[rank * 8 : (rank + 1) * 8]
        z = torch.randn(8 * size, 4, generator=g)[rank * 8 : (rank + 1) * 8]
        clear_d = discriminator.zero_grad if clear == "module" else opt_d.zero_grad
        if not late:
            clear_d(set_to_none=not in_place)
        fake = generator(z)
        ones, zeros = torch.ones(8, 1), torch.zeros(8, 1)
        if summed:
            loss = bce(discriminator(real), ones) + bce(discriminator(fake.detach()), zeros)
            if late:
                clear_d(set_to_none=not in_place)
            loss.backward()
        else:
            (bce(discriminator(real), ones) / 2).backward()
            (bce(discriminator(fake.detach()), zeros) / 2).backward()
        opt_d.step()
        (generator if clear == "module" else opt_g).zero_grad()
        bce(discriminator(fake), ones).backward()  # a pass through the discriminator, for the generator's step
        opt_g.step()
    assert opt_d.steps == opt_g.steps == 5
    return {f"{m}.{k}": v.detach().clone() for m, net in (("g", generator), ("d", discriminator)) for k, v in net.state_dict().items()}


@pytest.mark.parametrize("summed", [False, True], ids=["real-and-fake-passes", "summed-loss"])
@pytest.mark.parametrize("freq", [1, 3])
def test_the_module_zero_grad_drops_the_generators_pass_as_the_optimizers_does(summed, freq):
    assert_bitwise_equal(_train("module", summed, freq), _train("optimizer", summed, freq), "module vs optimizer zero_grad()")


@pytest.mark.parametrize("freq", [1, 3])
def test_on_two_workers_the_pending_gradient_all_reduces_are_completed_first(freq):
    """The generator's pass through the discriminator started its gradient all-reduces; clearing them (either way)
    completes those first on every worker, and the ranks stay bitwise replicas."""
    out: dict[str, list[dict[str, torch.Tensor]]] = {}
    for clear in ("module", "optimizer"):
        nets = [_gan() for _ in range(2)]
        out[clear] = run_ranks(2, lambda b, c=clear, n=nets: _train(c, True, freq, b, b.rank, b.size, n[b.rank]), timeout=120)
        assert_bitwise_equal(out[clear][0], out[clear][1], f"{clear}: rank 1 vs rank 0")
    assert_bitwise_equal(out["module"][0], out["optimizer"][0], "module vs optimizer zero_grad()")


@pytest.mark.parametrize("late", [False, True], ids=["before-the-forward", "after-the-forward"])
@pytest.mark.parametrize("in_place", [False, True], ids=["set-to-none", "zeroed-in-place"])
def test_cleared_after_the_forward_pass_or_zeroed_in_place_on_a_factor_step(late, in_place):
    """With one pass per step, the discriminator's next forward pass, on gradients not (yet) cleared, drops the
    generator's pass provisionally; its backward finds them cleared (None, or zeroed in place: before, in place
    was not noticed and the forward pass raised)."""
    want = _train("optimizer", True, 1)
    assert_bitwise_equal(_train("module", True, 1, late=late, in_place=in_place), want, f"module, late={late}, in_place={in_place}")


def test_a_forward_pass_on_uncleared_gradients_is_still_refused():
    _, discriminator = _gan()
    _opt = SPDKFACOptimizer(discriminator, lr=0.01, backend="single")
    discriminator(torch.randn(4, 6)).sum().backward()
    with pytest.raises(RuntimeError, match="adds to the gradients of 1 backward pass"):
        discriminator(torch.randn(4, 6)).sum().backward()  # (its forward pass is let through: the script may clear them)
