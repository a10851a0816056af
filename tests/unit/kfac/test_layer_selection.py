"""Which layers K-FAC preconditions: skip_layers, layers used without forward(), tied weights (one process)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune
from nets import batch, small_net, small_transformer

from spdkfac import SPDKFACOptimizer


def _train(model, opt, steps=4):
    x, y = batch(8)
    for s in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x + 0.1 * s), y).backward()
        opt.step()


def test_transformer_encoder_preconditions_its_attention():
    model = small_transformer()
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single")
    attn = "encoder.layers.0.self_attn"
    names = [layer.name for layer in opt.layers]
    assert names == [
        f"{attn}.q_proj",
        f"{attn}.k_proj",
        f"{attn}.v_proj",
        f"{attn}.out_proj",
        "encoder.layers.0.linear1",
        "encoder.layers.0.linear2",
        "head",
    ]
    _train(model, opt)
    assert opt.steps == 4
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skipped_attention_leaves_out_proj_to_plain_sgd_with_a_notice():
    model = small_transformer()
    with pytest.warns(UserWarning, match=r"plain momentum-SGD update.*encoder.layers.0.self_attn.out_proj"):
        opt = SPDKFACOptimizer(model, lr=0.05, backend="single", skip_layers=["MultiheadAttention"])
    names = [layer.name for layer in opt.layers]
    assert names == ["encoder.layers.0.linear1", "encoder.layers.0.linear2", "head"]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _train(model, opt)
    out_proj = "encoder.layers.0.self_attn.out_proj.weight"
    assert not torch.equal(model.state_dict()[out_proj], before[out_proj])  # updated, by plain SGD
    assert opt.steps == 4
    assert "weight used without the module's forward()" in opt.kfac_summary()


@pytest.mark.parametrize(("skip", "left"), [(["4"], ["0", "2", "6"]), (["Conv2d"], ["4", "6"]), ([nn.Linear], ["0", "2"])])
def test_skip_layers_by_name_class_name_or_class(skip, left):
    model = small_net()
    opt = SPDKFACOptimizer(model, lr=0.05, backend="single", skip_layers=skip)
    assert [layer.name for layer in opt.layers] == left
    ref = small_net()
    _train(model, opt)
    assert not torch.equal(model[4].weight, ref[4].weight)  # skipped layers still train


def test_skip_layers_rejects_names_that_match_nothing():
    with pytest.raises(ValueError, match=r"skip_layers entries \['fc9'\] match no module"):
        SPDKFACOptimizer(small_net(), lr=0.05, backend="single", skip_layers=["fc9"])
    with pytest.raises(TypeError, match="module names, class names or classes"):
        SPDKFACOptimizer(small_net(), lr=0.05, backend="single", skip_layers=[3])


def test_tied_weights_that_cannot_be_one_layer_are_left_out_as_if_skipped():
    """Two Linear layers sharing a weight but not a bias: both get the base update, with a notice, and train
    exactly as when skip_layers names them (before, the optimizer refused the model)."""
    results = []
    for skip in ([], ["0", "2"]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
        model[2].weight = model[0].weight  # tied
        if skip:
            opt = SPDKFACOptimizer(model, lr=0.05, backend="single", skip_layers=skip)
        else:
            with pytest.warns(UserWarning, match=r"'0': its weight is shared by \['0.weight', '2.weight'\] \(tied weights\)"):
                opt = SPDKFACOptimizer(model, lr=0.05, backend="single")
            assert "'2' has its own bias" in opt.kfac_summary()
        assert [layer.name for layer in opt.layers] == ["4"]
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), torch.zeros(5, dtype=torch.long)).backward()
            opt.step()
        results.append([p.detach().clone() for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def _mixed_convs() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(2, 8, 1),  # 0: plain
        nn.Conv2d(8, 8, 3, padding=1, groups=8),  # 1: depthwise
        nn.Conv2d(8, 8, 3, padding=1, groups=2),  # 2: grouped
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 3),  # 4
    )


@pytest.mark.parametrize(
    ("skip", "left"),
    [(["kind:depthwise"], ["0", "2", "4"]), (["kind:grouped"], ["0", "4"]), (["[12]"], ["0", "4"]), (["*"], None)],
)
def test_skip_layers_by_kind_or_wildcard(skip, left):
    if left is None:  # everything skipped: nothing left to precondition
        with pytest.raises(ValueError, match="no layer SPDKFACOptimizer can precondition"):
            SPDKFACOptimizer(_mixed_convs(), lr=0.05, backend="single", skip_layers=skip)
        return
    opt = SPDKFACOptimizer(_mixed_convs(), lr=0.05, backend="single", skip_layers=skip)
    assert [layer.name for layer in opt.layers] == left


def test_skip_layers_unknown_kind_is_refused():
    with pytest.raises(ValueError, match=r"unknown layer kind.*kind:depthwise"):
        SPDKFACOptimizer(_mixed_convs(), lr=0.05, backend="single", skip_layers=["kind:pointwise"])


def test_parametrized_weights_get_the_base_update_and_say_why():
    """weight_norm / spectral_norm compute the weight from other parameters: those get plain SGD, as SGD would move them."""
    from torch.nn.utils.parametrizations import spectral_norm, weight_norm

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            weight_norm(nn.Conv2d(2, 3, 3)), nn.Tanh(), nn.Flatten(), spectral_norm(nn.Linear(48, 6)), nn.Tanh(), nn.Linear(6, 5)
        )

    model, plain = net(), net()
    opt = SPDKFACOptimizer(model, lr=0.1, momentum=0.0, backend="single")
    for (name, ours), theirs in zip(model.named_buffers(), plain.buffers()):  # no weight was read: no power step ran
        assert torch.equal(ours, theirs), name
    assert [layer.name for layer in opt.layers] == ["5"]
    summary = opt.kfac_summary()
    assert "1 x ParametrizedConv2d: not supported: its weight is parametrized (_WeightNorm)" in summary
    assert "1 x ParametrizedLinear: not supported: its weight is parametrized (_SpectralNorm)" in summary
    assert "ParametrizationList: the parameters of a parametrized weight" in summary
    sgd = torch.optim.SGD([p for name, p in plain.named_parameters() if not name.startswith("5.")], lr=0.1)
    x, y = batch(8)
    for o, m in ((opt, model), (sgd, plain)):
        nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        if not name.startswith("5."):  # (the K-FAC layer moves differently; the others as SGD, to rounding)
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)


def test_the_older_hook_based_weight_norm_spectral_norm_and_pruning_are_named_as_such():
    """The older API (and ``nn.utils.prune``) writes a plain tensor over ``weight`` from ``weight_orig`` (or
    ``weight_g``, ``weight_v``) in a forward pre-hook: left to the base update, and the summary names the hook and
    the parameters it reads (it said "weight frozen")."""
    torch.manual_seed(0)
    pruned = nn.Linear(4, 4)
    nn.utils.prune.l1_unstructured(pruned, "weight", amount=0.5)
    model = nn.Sequential(
        nn.utils.weight_norm(nn.Linear(4, 4)), nn.Tanh(), nn.utils.spectral_norm(nn.Linear(4, 4)), pruned, nn.Linear(4, 2)
    )
    opt = SPDKFACOptimizer(model, lr=0.1, backend="single")
    assert [layer.name for layer in opt.layers] == ["4"]
    summary = opt.kfac_summary()
    for hook, source in (("WeightNorm", "weight_g, weight_v"), ("SpectralNorm", "weight_orig"), ("L1Unstructured", "weight_orig")):
        assert (
            f"1 x Linear: not supported: its weight is recomputed by a forward pre-hook ({hook}) from other parameters ({source};"
            in summary
        )
    assert "weight frozen" not in summary


def test_a_layer_called_with_its_input_as_a_keyword_is_refused_by_name():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(72, 8), nn.Linear(8, 5)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.tanh(self.a(input=x.flatten(1))))

    model = Net()
    _opt = SPDKFACOptimizer(model, lr=0.05, backend="single")  # kept: the model holds its hooks weakly
    x, _ = batch(4)
    with pytest.raises(TypeError, match=r"layer 'a' was called with its input as a keyword argument .*: pass it positionally"):
        model(x)
