"""LoRA adapters made by PEFT (``peft.get_peft_model``): K-FAC preconditions the adapters' ``lora_A`` and ``lora_B``
Linear layers as any Linear, and leaves the frozen base layers alone.

The check: the PEFT model trains to the same parameters, bit for bit, as the same adapters written by hand as two
``nn.Linear`` beside a frozen one (``base(x) + B(A(drop(x))) * scaling``, LoRA's definition), so PEFT's wrapper
hides no use of the adapters from K-FAC's hooks; and the K-FAC summary counts what it should. DoRA
(``use_dora=True``) calls its adapters once more on an identity matrix, for a weight norm it then detaches: K-FAC
says so, as for any forward pass no backward pass reaches. Runs where peft is installed (an optional dependency).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer

peft = pytest.importorskip("peft")

R, ALPHA = 2, 4
OPTS = dict(lr=0.1, damping=0.01, kl_clip=0.01, factor_update_freq=1, inv_update_freq=2, backend="single")


class HandLoRA(nn.Module):
    """A frozen Linear with a LoRA adapter written from its definition: ``base(x) + B(A(x)) * alpha / r``."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_A = nn.Linear(base.in_features, R, bias=False)
        self.lora_B = nn.Linear(R, base.out_features, bias=False)
        self.scaling = ALPHA / R

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scaling


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _peft_model(init: bool | str, **config: object) -> nn.Module:
    lora = peft.LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["0", "2"], init_lora_weights=init, **config)
    return peft.get_peft_model(_net(), lora)


def _by_hand(model: nn.Module) -> nn.Sequential:
    """The PEFT model's weights in :class:`HandLoRA` layers."""
    net = _net()
    hand = nn.Sequential(HandLoRA(net[0]), nn.Tanh(), HandLoRA(net[2]))
    for index in (0, 2):
        wrapped = model.base_model.model[index]
        hand[index].lora_A.weight.data.copy_(wrapped.lora_A["default"].weight)
        hand[index].lora_B.weight.data.copy_(wrapped.lora_B["default"].weight)
        assert torch.equal(hand[index].base.weight, wrapped.base_layer.weight)
    return hand


def _train(model: nn.Module, steps: int = 4) -> None:
    opt = SPDKFACOptimizer(model, **OPTS)
    torch.manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 6), torch.randint(0, 3, (16,))
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _peft_parameters(model: nn.Module) -> list[torch.Tensor]:
    layers = [model.base_model.model[i] for i in (0, 2)]
    return [t for m in layers for t in (m.base_layer.weight, m.base_layer.bias, m.lora_A["default"].weight, m.lora_B["default"].weight)]


def _hand_parameters(hand: nn.Sequential) -> list[torch.Tensor]:
    return [t for m in (hand[0], hand[2]) for t in (m.base.weight, m.base.bias, m.lora_A.weight, m.lora_B.weight)]


@pytest.mark.parametrize("init", [True, False], ids=["B-zero", "B-random"])
def test_peft_lora_trains_as_the_same_adapters_written_by_hand(init):
    """Default PEFT init (B = 0: the first step moves B only) and random B: every parameter, frozen ones included,
    equals the hand-written model's after four K-FAC steps (decompositions every other step)."""
    model = _peft_model(init)
    hand = _by_hand(model)
    start = [t.detach().clone() for t in _peft_parameters(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no use of an adapter the hooks would have to warn about
        _train(model)
        _train(hand)
    for got, want in zip(_peft_parameters(model), _hand_parameters(hand)):
        assert torch.equal(got, want)
    moved = [not torch.equal(now, then) for now, then in zip(_peft_parameters(model), start)]
    assert moved == [False, False, True, True] * 2  # the adapters trained, the base stayed


def test_peft_lora_summary_counts_the_adapters_and_not_the_frozen_base():
    model = _peft_model(False, lora_dropout=0.1)
    opt = SPDKFACOptimizer(model, **OPTS)
    names = sorted(layer.name for layer in opt.layers)
    assert names == [f"base_model.model.{i}.lora_{ab}.default" for i in (0, 2) for ab in "AB"]
    summary = opt.kfac_summary()
    assert "K-FAC preconditions 4 layers: 50 of 50 trainable parameters (100.0%)" in summary
    before = copy.deepcopy(model.state_dict())
    _train(model, steps=2)  # with dropout on the adapters' input (A sees the dropped input)
    assert torch.equal(model.state_dict()["base_model.model.2.base_layer.weight"], before["base_model.model.2.base_layer.weight"])


def test_dora_adapters_run_once_more_on_an_identity_matrix_and_k_fac_says_so():
    """DoRA's weight norm calls ``lora_A`` and ``lora_B`` on an identity matrix with gradients enabled and detaches
    the result: a forward use no backward pass reaches, which K-FAC's A would average in: it warns, naming the layer."""
    model = _peft_model(False, use_dora=True)
    with pytest.warns(UserWarning, match=r"lora_A\.default' ran 2 time\(s\) .* reached the output of 1"):
        _train(model, steps=1)
