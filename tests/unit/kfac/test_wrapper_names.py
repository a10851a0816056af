"""``skip_layers`` and ``no_weight_decay`` name the same layers with activation checkpointing turned on or off.

torch's activation-checkpoint wrapper (accelerate's and Lightning's FSDP
activation checkpointing) puts ``_checkpoint_wrapped_module`` into the
module names of the layers it wraps: a script's ``skip_layers=['blocks.0.fc']``
then matched nothing and was refused. Names now match with or without the
wrappers' attributes, on either side.
"""

from __future__ import annotations

import pytest
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

from spdkfac import SPDKFACOptimizer


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(nn.Sequential(nn.Linear(4, 6), nn.Tanh()), nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
        self.head = nn.Linear(6, 3)


def _net(checkpointed: bool) -> Net:
    net = Net()
    if checkpointed:
        blocks = {id(b) for b in net.blocks}
        apply_activation_checkpointing(net, check_fn=lambda m: id(m) in blocks)
    return net


@pytest.mark.parametrize("checkpointed", [False, True])
@pytest.mark.parametrize("entry", ["blocks.0.0", "blocks.0._checkpoint_wrapped_module.0", "blocks.0.*"])
def test_skip_layers_names_a_layer_with_or_without_the_wrapper(checkpointed, entry):
    net = _net(checkpointed)
    names = [layer.name for layer in SPDKFACOptimizer(net, lr=0.1, skip_layers=[entry]).layers]
    wrapped = "._checkpoint_wrapped_module" if checkpointed else ""
    assert names == [f"blocks.1{wrapped}.0", "head"]


@pytest.mark.parametrize("checkpointed", [False, True])
def test_an_entry_naming_no_layer_is_still_refused(checkpointed):
    with pytest.raises(ValueError, match="match no module"):
        SPDKFACOptimizer(_net(checkpointed), lr=0.1, skip_layers=["blocks.2.0"])
    with pytest.raises(ValueError, match="match no trainable parameter"):
        SPDKFACOptimizer(_net(checkpointed), lr=0.1, weight_decay=0.1, no_weight_decay=["blocks.0.1.bias"])


@pytest.mark.parametrize("checkpointed", [False, True])
def test_no_weight_decay_names_a_parameter_with_or_without_the_wrapper(checkpointed):
    net = _net(checkpointed)
    opt = SPDKFACOptimizer(net, lr=0.1, weight_decay=0.1, no_weight_decay=["blocks.0.0.bias", "head.bias"])
    undecayed = {id(p) for group in opt.param_groups if group["weight_decay"] == 0 for p in group["params"]}
    assert undecayed == {id(net.head.bias), id(net.blocks[0]._checkpoint_wrapped_module[0].bias if checkpointed else net.blocks[0][0].bias)}
