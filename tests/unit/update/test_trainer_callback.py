"""hugging_face_callback(): the Trainer's optimizer gathers every worker's K-FAC state before each checkpoint.

The callback's rule runs here on its own (CI has no transformers); with
transformers installed, a real one-process ``Trainer`` shows the gather
happens before each save it makes, on the optimizer it wrapped. The 2-worker
resume under torchrun, bitwise the uninterrupted run, is a one-off check
(docs/hugging-face.md).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from nets import batch, small_net

import spdkfac
from spdkfac import KFACPreconditioner
from spdkfac.update.trainer_callback import _gather_if_best_may_save, _gather_if_saving

pytestmark = [pytest.mark.filterwarnings("ignore:no perf_model given")]


class _Recording:
    def __init__(self) -> None:
        self.calls = 0

    def consolidate_state_dict(self, to: int = 0) -> None:
        self.calls += 1


@pytest.mark.parametrize("should_save", [False, True])
def test_the_gather_runs_at_a_step_the_trainer_saves_after_only(should_save):
    optimizer = _Recording()
    wrapped = SimpleNamespace(optimizer=optimizer)  # as accelerate's AcceleratedOptimizer holds yours
    _gather_if_saving(None, SimpleNamespace(save_strategy="steps"), None, SimpleNamespace(should_save=should_save), optimizer=wrapped)
    assert optimizer.calls == int(should_save)


@pytest.mark.parametrize(("strategy", "gathers"), [("best", 1), ("steps", 0), ("epoch", 0)])
def test_under_save_strategy_best_every_evaluation_gathers(strategy, gathers):
    """'best' decides to save after an evaluation, with no callback between the decision and the save."""
    optimizer = _Recording()
    _gather_if_best_may_save(None, SimpleNamespace(save_strategy=strategy), None, SimpleNamespace(should_save=False), optimizer=optimizer)
    assert optimizer.calls == gathers
    # An evaluate() before train(): the Trainer has no optimizer yet, and there is nothing to gather.
    _gather_if_best_may_save(None, SimpleNamespace(save_strategy=strategy), None, SimpleNamespace(should_save=False), optimizer=None)


def test_an_optimizer_without_kfac_is_refused_naming_the_fix():
    sgd = torch.optim.SGD(small_net().parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"\(SGD\) has no consolidate_state_dict\(\).*KFACPreconditioner\(model, optimizer=optimizer\)"):
        _gather_if_saving(None, None, None, SimpleNamespace(should_save=True), optimizer=SimpleNamespace(optimizer=sgd))


def test_without_transformers_making_it_raises_import_error():
    try:
        import transformers  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError):
            spdkfac.hugging_face_callback()
    else:
        pytest.skip("transformers is installed here")


class _Classifier(nn.Module):
    """A small net with the Trainer's calling convention (keyword inputs, a dict with the loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = small_net()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.net(x), labels)}


def test_a_real_trainer_gathers_before_each_checkpoint(tmp_path, float64):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # (Trainer needs it)
    torch.manual_seed(0)
    x, y = batch(40)
    data = [{"x": x[i], "labels": y[i]} for i in range(40)]
    model = _Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    preconditioner = KFACPreconditioner(model, optimizer=optimizer, backend="single", damping=0.01)
    seen: list[tuple[int, list[str]]] = []  # (K-FAC steps, checkpoints on disk) at each gather
    preconditioner.kfac.consolidate_state_dict = lambda to: seen.append((preconditioner.steps, sorted(os.listdir(tmp_path))))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=5, save_steps=2, per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_steps=100
    )
    trainer = transformers.Trainer(
        model, args, train_dataset=data, optimizers=(optimizer, None), callbacks=[spdkfac.hugging_face_callback()]
    )
    trainer.train()
    assert seen == [(2, []), (4, ["checkpoint-2"]), (5, ["checkpoint-2", "checkpoint-4"])]
    assert "kfac_preconditioner" in torch.load(tmp_path / "checkpoint-4" / "optimizer.pt", weights_only=False)
