"""The enumerated options as types: declared once, passed as strings or members, stored as members, saved as plain strings."""

from __future__ import annotations

import io
import json
import pickle

import pytest
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.config import (
    BaseOptimizer,
    ComputeMethod,
    EigenOptions,
    EigenRefresh,
    EKFACOptions,
    EKFACUpdate,
    FusionPolicy,
    KFACConfig,
    Option,
    Placement,
    UpdateFusion,
)
from spdkfac.kfac.factor_shape import FactorKind
from spdkfac.kfac.methods import METHODS, EKFACMethod
from spdkfac.kfac.methods.ekfac_updates import UPDATES, AdamState, ScalingState

#: option name -> (its type, the strings users pass).
OPTIONS = {
    "fusion": (FusionPolicy, ("optimal", "threshold", "layerwise", "naive")),
    "placement": (Placement, ("lbp", "seq", "local")),
    "compute_method": (ComputeMethod, ("inverse", "eigen", "ekfac")),
    "eigen_refresh": (EigenRefresh, ("exact", "warm")),
    "ekfac_update": (EKFACUpdate, ("natural", "adam")),
    "update_fusion": (UpdateFusion, ("none", "forward", "backward")),
    "base": (BaseOptimizer, ("sgd", "adamw", "lamb")),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_type_lists_the_strings_users_pass(name):
    kind, values = OPTIONS[name]
    assert issubclass(kind, Option)
    assert kind.choices() == values
    for value in values:
        member = kind.parse(name, value)
        assert member == value
        assert hash(member) == hash(value)
        assert str(member) == value
        assert f"{member}" == value
        assert repr(member) == repr(value)
        assert json.dumps(member) == json.dumps(value)
        assert kind.parse(name, member) is member
        assert pickle.loads(pickle.dumps(member)) is member


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_a_bad_value_raises_naming_the_option_and_its_choices(name):
    kind, values = OPTIONS[name]
    with pytest.raises(ValueError, match=f"^{name} must be one of") as err:
        KFACConfig(**{name: "bogus"})
    assert str(values) in str(err.value)
    assert "'bogus'" in str(err.value)
    with pytest.raises(ValueError, match=f"{name} must be one of"):
        kind.parse(name, 3)


def test_the_config_stores_members_and_saves_plain_strings():
    cfg = KFACConfig(fusion="naive", placement="seq", compute_method="eigen", eigen_refresh="warm", base="adamw")
    assert cfg.fusion is FusionPolicy.NAIVE
    assert cfg.placement is Placement.SEQ
    assert cfg.compute_method is ComputeMethod.EIGEN
    assert cfg.eigen_refresh is EigenRefresh.WARM
    assert cfg.base is BaseOptimizer.ADAMW
    assert cfg.update_fusion is UpdateFusion.NONE
    assert "fusion='naive'" in repr(cfg)
    assert "placement='seq'" in repr(cfg)
    saved = cfg.as_dict()
    assert all(type(v) is str for k, v in saved.items() if k in OPTIONS)
    assert KFACConfig(**{k: v for k, v in saved.items() if k != "skip_layers"}) == cfg
    assert KFACConfig(fusion=FusionPolicy.NAIVE) == KFACConfig(fusion="naive")


def test_a_state_dict_with_enum_options_loads_with_weights_only():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    opt = SPDKFACOptimizer(net, lr=0.1, backend="single", compute_method=ComputeMethod.EKFAC, placement=Placement.SEQ, perf_model=None)
    nn.functional.cross_entropy(net(torch.randn(5, 4)), torch.randint(0, 2, (5,))).backward()
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    assert loaded["kfac"]["config"]["compute_method"] == "ekfac"
    assert loaded["kfac"]["compute_method"] == "ekfac"
    opt.load_state_dict(loaded)


def test_a_method_registered_at_run_time_is_taken_by_its_plain_name(monkeypatch):
    monkeypatch.setitem(METHODS, "mine", METHODS["inverse"])
    assert KFACConfig(compute_method="mine").compute_method == "mine"
    with pytest.raises(ValueError, match=r"compute_method must be one of \('inverse', 'eigen', 'ekfac', 'mine'\)"):
        KFACConfig(compute_method="yours")


def test_every_built_in_method_and_update_is_registered_under_its_member():
    assert list(METHODS) == list(ComputeMethod)
    assert all(METHODS[m].name == m for m in ComputeMethod)
    assert list(UPDATES) == list(EKFACUpdate)
    assert all(UPDATES[u].update is u for u in EKFACUpdate)
    assert FactorKind.choices() == ("A", "G")


def test_grouped_per_method_options_stand_for_their_flat_keywords():
    grouped = KFACConfig.from_options(
        dict(compute_method="ekfac", eigen=EigenOptions("warm", 4), ekfac=EKFACOptions(0.9, "natural"), eigen_refresh="exact")
    )
    flat = KFACConfig(compute_method="ekfac", eigen_refresh="warm", eigen_full_every=4, ekfac_decay=0.9)
    assert grouped == flat
    assert flat.eigen == EigenOptions(EigenRefresh.WARM, 4)
    assert flat.ekfac == EKFACOptions(0.9, EKFACUpdate.NATURAL)
    with pytest.raises(ValueError, match=r"pass eigen=EigenOptions\(...\) or eigen_full_every=3, not both"):
        KFACConfig.from_options(dict(compute_method="eigen", eigen=EigenOptions("warm"), eigen_full_every=3))
    with pytest.raises(TypeError, match="ekfac must be a EKFACOptions"):
        KFACConfig.from_options(dict(ekfac={"decay": 0.9}))
    with pytest.raises(ValueError, match="eigen_refresh must be one of"):
        EigenOptions("lukewarm")
    with pytest.raises(ValueError, match=r"ekfac_decay must be in \[0, 1\)"):
        EKFACOptions(1.0)


def test_the_optimizer_takes_the_grouped_options():
    net = nn.Sequential(nn.Linear(4, 3))
    opt = SPDKFACOptimizer(
        net, lr=0.1, backend="single", compute_method="ekfac", ekfac=EKFACOptions(0.8, "adam"), base="adamw", kl_clip=None
    )
    assert isinstance(opt.method, EKFACMethod)
    assert opt.method.decay == 0.8
    assert opt.method.update is EKFACUpdate.ADAM
    assert isinstance(opt.layers[0].method_state, AdamState)
    assert repr(opt.method) == "EKFACMethod(decay=0.8, update='adam')"


def test_each_ekfac_update_keeps_its_own_typed_state():
    assert isinstance(EKFACMethod().new_state(), ScalingState)
    assert isinstance(EKFACMethod(update="adam").new_state(), AdamState)
    with pytest.raises(ValueError, match="resume with ekfac_update='adam'"):
        EKFACMethod().load_state({"exp_avg": None, "exp_avg_sq": None, "step": 1}, torch.device("cpu"))
    with pytest.raises(ValueError, match="resume with ekfac_update='natural'"):
        EKFACMethod(update="adam").load_state({"scale": None, "samples": 4}, torch.device("cpu"))
