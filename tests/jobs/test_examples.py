"""The example scripts (examples/) run end to end on 2 workers, on scikit-learn's bundled digits written as an image folder.

Each run is a few steps of one epoch (``--max-steps``) of a CIFAR-style
ResNet-20 on 16x16 images, then the validation pass; the test checks that the
script finishes and reports the top-1 accuracy of every validation image.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import ROOT, run_workers

pytestmark = pytest.mark.multiprocess

ARGS = ["--arch", "cifar_resnet20", "--image-size", "16", "--batch-size", "8", "--epochs", "1", "--max-steps", "3", "--loader-workers", "0"]


def digits_folder(root: Path, train: int = 8, val: int = 2) -> Path:
    """``root/{train,val}/<digit>/<i>.png``: the first ``train`` + ``val`` bundled 8x8 digits of each class, as RGB PNGs."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images * 16).clamp(0, 255).to(torch.uint8)
    for c in range(10):
        of_class = images[torch.tensor(digits.target) == c]
        for split, part in (("train", of_class[:train]), ("val", of_class[train : train + val])):
            folder = root / split / str(c)
            folder.mkdir(parents=True, exist_ok=True)
            for i, image in enumerate(part):
                Image.fromarray(image[:, :, None].expand(8, 8, 3).contiguous().numpy()).save(folder / f"{i}.png")
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return digits_folder(tmp_path_factory.mktemp("digits"))


@pytest.mark.parametrize("optimizer", ["kfac", "kaisa"])
def test_torchrun_ddp_example(data, optimizer):
    out = run_workers("torch", 2, [str(ROOT / "examples" / "torchrun_ddp.py"), "--data", str(data), "--optimizer", optimizer, *ARGS])
    assert "epoch 0: train loss" in out, out[-3000:]
    assert "(20 images)" in out, out[-3000:]


def test_torchrun_ddp_example_with_adversarial_training(data):
    """``--pgd-steps``: each batch's PGD attack crafted in train mode on the DDP model, then trained on."""
    args = [str(ROOT / "examples" / "torchrun_ddp.py"), "--data", str(data), "--optimizer", "kfac", "--pgd-steps", "2", *ARGS]
    out = run_workers("torch", 2, args)
    assert "epoch 0: train loss" in out, out[-3000:]
    assert "(20 images)" in out, out[-3000:]


def test_horovod_example(data):
    out = run_workers("horovod", 2, [str(ROOT / "examples" / "horovod_train.py"), "--data", str(data), "--optimizer", "kfac", *ARGS])
    assert "epoch 0: train loss" in out, out[-3000:]
    assert "(20 images)" in out, out[-3000:]
