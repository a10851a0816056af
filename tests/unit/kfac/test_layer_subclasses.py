"""Subclasses of the preconditioned layer types, and lazy modules.

A subclass that overrides none of its registered class's computation (one
that only changes the initialisation, adds attributes or methods) computes
what that class computes: it is preconditioned, and its steps are the base
class's bitwise. Before, every subclass of a convolution, an embedding, a norm
or ``nn.MultiheadAttention`` got the plain update.

A subclass with a ``forward()`` of its own may compute something else from the
input K-FAC's hooks see: it is left out unless registered with
:func:`spdkfac.register_layer_type`. Before, a ``Linear`` subclass that
scaled its input was preconditioned with the factors of the unscaled input (a
silently wrong step).

A lazy module not initialised yet is refused with the remedy (a dry run);
before, torch's error came from deep inside the planning.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import spdkfac
from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.kfac.layer_types import HELPERS, NORM_HELPERS, SPLITTERS, make_helper

Subclass = Callable[[type[nn.Module]], type[nn.Module]]


def _same(cls: type[nn.Module]) -> type[nn.Module]:
    return cls


def _plain_subclass(cls: type[nn.Module]) -> type[nn.Module]:
    """A subclass with its own initialisation only (the usual reason to subclass a layer)."""

    def reset_parameters(self: nn.Module) -> None:
        cls.reset_parameters(self)  # type: ignore[attr-defined]
        self.initialised_by_subclass = True

    return type(f"My{cls.__name__}", (cls,), {"reset_parameters": reset_parameters} if hasattr(cls, "reset_parameters") else {})


class SelfAttention(nn.Module):
    def __init__(self, sub: Subclass) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.attn = sub(nn.MultiheadAttention)(4, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        out: torch.Tensor = self.attn(h, h, h, need_weights=False)[0]
        return out


class Tokens(nn.Module):
    def __init__(self, sub: Subclass) -> None:
        super().__init__()
        self.embed = sub(nn.Embedding)(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.embed(x))
        return out


CASES: dict[str, tuple[Callable[[Subclass], nn.Module], Callable[[torch.Generator], torch.Tensor]]] = {
    "linear": (lambda s: nn.Sequential(s(nn.Linear)(3, 4), nn.Tanh(), s(nn.Linear)(4, 2)), lambda g: torch.randn(5, 3, generator=g)),
    "conv1d": (
        lambda s: nn.Sequential(s(nn.Conv1d)(2, 3, 3), nn.Tanh(), s(nn.Conv1d)(3, 2, 3)),
        lambda g: torch.randn(4, 2, 9, generator=g),
    ),
    "conv2d": (
        lambda s: nn.Sequential(s(nn.Conv2d)(2, 3, 3), nn.Tanh(), s(nn.Conv2d)(3, 2, 3, stride=2)),
        lambda g: torch.randn(4, 2, 9, 9, generator=g),
    ),
    "conv3d": (
        lambda s: nn.Sequential(s(nn.Conv3d)(2, 3, 2), nn.Tanh(), s(nn.Conv3d)(3, 2, 2)),
        lambda g: torch.randn(3, 2, 4, 4, 4, generator=g),
    ),
    "conv-transpose2d": (
        lambda s: nn.Sequential(s(nn.ConvTranspose2d)(2, 3, 3, stride=2), nn.Tanh(), nn.Conv2d(3, 2, 3)),
        lambda g: torch.randn(4, 2, 4, 4, generator=g),
    ),
    "embedding": (Tokens, lambda g: torch.randint(0, 10, (5, 3), generator=g)),
    "attention": (SelfAttention, lambda g: torch.randn(3, 5, 3, generator=g)),
    "norms": (
        lambda s: nn.Sequential(
            nn.Conv2d(2, 3, 3), s(nn.BatchNorm2d)(3), nn.Tanh(), nn.Flatten(), nn.Linear(3 * 49, 4), s(nn.LayerNorm)(4)
        ),
        lambda g: torch.randn(4, 2, 9, 9, generator=g),
    ),
}


def _train(
    model: nn.Module, inputs: Callable[[torch.Generator], torch.Tensor], **options: object
) -> tuple[list[torch.Tensor], SPDKFACOptimizer]:
    model = model.double()
    opt = SPDKFACOptimizer(model, lr=0.1, damping=0.01, backend="single", norm_layers="kfac", **options)  # type: ignore[arg-type]
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = inputs(g)
        opt.zero_grad()
        model(x if not x.is_floating_point() else x.double()).sin().sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt


@pytest.fixture
def registries() -> Iterator[None]:
    """Restores the layer-type registries after a test that registers a type."""
    saved = dict(HELPERS), dict(NORM_HELPERS), dict(SPLITTERS)
    yield
    for registry, before in zip((HELPERS, NORM_HELPERS, SPLITTERS), saved, strict=True):
        registry.clear()
        registry.update(before)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(CASES))
def test_a_subclass_that_keeps_the_computation_is_preconditioned_as_its_base_class(case: str) -> None:
    make, inputs = CASES[case]
    torch.manual_seed(0)
    mine = make(_plain_subclass)
    torch.manual_seed(0)
    theirs = make(_same)
    assert any(type(m).__name__.startswith("My") for m in mine.modules())
    got, opt = _train(mine, inputs)
    want, ref = _train(theirs, inputs)
    assert [layer.name for layer in opt.layers] == [layer.name for layer in ref.layers]
    assert "not supported" not in opt.kfac_summary()
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


class ScaledLinear(nn.Linear):
    """Computes from twice its input: the hooks see the input, so its factors would describe another layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(2 * x)


class CastingLinear(nn.Linear):
    """Its own forward computes what nn.Linear's does (a weight cast to the input's dtype, as some libraries write it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class PaddingConv(nn.Conv2d):
    """Pads its input itself ('same' padding computed per input, as TensorFlow ports do)."""

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.conv2d(F.pad(x, (1, 1, 1, 1)), weight, bias, self.stride, 0, self.dilation, self.groups)


def _two_layers(cls: type[nn.Module]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), cls(4, 2))


def _inputs(g: torch.Generator) -> torch.Tensor:
    return torch.randn(5, 3, generator=g)


@pytest.mark.parametrize("module", [ScaledLinear(3, 4), PaddingConv(2, 2, 3)], ids=["forward", "_conv_forward"])
def test_a_subclass_with_its_own_computation_is_left_out_and_says_how_to_register_it(module: nn.Module) -> None:
    assert make_helper(module) is None
    opt = SPDKFACOptimizer(nn.Sequential(nn.Linear(2, 2), module), lr=0.1, backend="single")
    name = type(module).__name__
    base = "Linear" if isinstance(module, nn.Linear) else "Conv2d"
    assert f"a subclass of {base} with its own" in opt.kfac_summary()
    assert f"spdkfac.register_layer_type({name}, nn.{base})" in opt.kfac_summary()
    assert [layer.name for layer in opt.layers] == ["0"]


def test_a_left_out_subclass_gets_the_update_of_a_skipped_layer() -> None:
    got, _ = _train(_two_layers(ScaledLinear), _inputs)
    want, _ = _train(_two_layers(ScaledLinear), _inputs, skip_layers=["2"])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("registries")
def test_a_registered_subclass_is_preconditioned_as_the_class_it_computes_like() -> None:
    spdkfac.register_layer_type(CastingLinear, nn.Linear)
    got, opt = _train(_two_layers(CastingLinear), _inputs)
    want, _ = _train(_two_layers(nn.Linear), _inputs)
    assert [layer.name for layer in opt.layers] == ["0", "2"]
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.usefixtures("registries")
def test_register_layer_type_refuses_what_it_cannot_mean() -> None:
    with pytest.raises(TypeError, match="not a subclass of Conv2d"):
        spdkfac.register_layer_type(CastingLinear, nn.Conv2d)
    with pytest.raises(ValueError, match="GELU is not a layer type K-FAC preconditions"):
        spdkfac.register_layer_type(type("MyGELU", (nn.GELU,), {}), nn.GELU)
    assert CastingLinear not in HELPERS


@pytest.mark.parametrize(
    "build", [lambda m: SPDKFACOptimizer(m, lr=0.1, backend="single"), lambda m: KFACPreconditioner(m, backend="single")]
)
def test_a_lazy_module_is_refused_until_its_dry_run(build: Callable[[nn.Module], object]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(4), nn.Tanh(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"uninitialised lazy parameters \(0.weight, 0.bias\).*dry run"):
        build(model)
    model(torch.randn(2, 3))
    built = build(model)
    assert [layer.name for layer in built.layers] == ["0", "2"]  # type: ignore[attr-defined]
