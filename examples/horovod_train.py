"""Image classification on an ImageNet-style folder with horovodrun: K-FAC in one line.

The usual Horovod training loop; ``--optimizer`` picks Horovod's
``DistributedOptimizer`` around torch's SGD, or spdkfac's ``SPDKFACOptimizer``
in its place (the one-line swap: it averages the gradients itself, so it is
not wrapped). The data is ``DATA/{train,val}/<class>/<image>``.

    horovodrun -np 4 python examples/horovod_train.py --data /path/to/imagenet --arch resnet50 --optimizer kfac
"""

from __future__ import annotations

import argparse
from pathlib import Path

import horovod.torch as hvd
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import worker_device
from spdkfac.models import get_model
from spdkfac.train.imagefolder import ImageFolder, make_loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--arch", default="resnet50", help="a model of spdkfac.models (or torchvision:<name>)")
    ap.add_argument("--optimizer", choices=["sgd", "kfac"], default="kfac")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--loader-workers", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps (a quick check)")
    args = ap.parse_args()

    hvd.init()
    device = worker_device()  # cuda:<local rank>, or the CPU
    train_set = ImageFolder(args.data / "train", args.image_size, train=True)
    val_set = ImageFolder(args.data / "val", args.image_size, train=False, classes=train_set.classes)
    train_loader = make_loader(train_set, args.batch_size, hvd.rank(), hvd.size(), train=True, workers=args.loader_workers)
    val_loader = make_loader(val_set, args.batch_size, hvd.rank(), hvd.size(), train=False, workers=args.loader_workers)

    model = get_model(args.arch, num_classes=len(train_set.classes)).to(device)
    if args.optimizer == "sgd":
        sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
        optimizer = hvd.DistributedOptimizer(sgd, named_parameters=model.named_parameters())
    else:  # the one-line swap
        optimizer = SPDKFACOptimizer(model, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # Horovod's usual start: it works on SPDKFACOptimizer too
    steps_per_epoch = min(len(train_loader), args.max_steps or len(train_loader))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)
    loss_fn = nn.CrossEntropyLoss()

    for epoch in range(args.epochs):
        train_loader.sampler.set_epoch(epoch)  # type: ignore[attr-defined]
        model.train()
        for step, (x, y) in enumerate(train_loader):
            if step == steps_per_epoch:
                break
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
        correct, seen = evaluate(model, val_loader, device)
        if hvd.rank() == 0:
            print(f"epoch {epoch}: train loss {loss.item():.4f}, val top-1 {correct / seen:.4f} ({seen:.0f} images)", flush=True)


@torch.no_grad()
def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device) -> tuple[float, float]:
    """Correct predictions and images over every worker's shard of the validation set."""
    model.eval()
    counts = torch.zeros(2)
    for x, y in loader:
        counts += torch.tensor([float((model(x.to(device)).argmax(1) == y.to(device)).sum()), float(len(y))])
    counts = hvd.allreduce(counts, op=hvd.Sum, name="val_counts")
    return counts[0].item(), counts[1].item()


if __name__ == "__main__":
    main()
