"""Image classification on an ImageNet-style folder with torchrun and DistributedDataParallel: K-FAC in one line.

The usual DDP training loop; ``--optimizer`` picks torch's SGD, spdkfac's
``SPDKFACOptimizer`` (the one-line swap) or KAISA's usage, ``KFACPreconditioner``
before your own optimizer. The data is ``DATA/{train,val}/<class>/<image>``.

    torchrun --nproc_per_node 4 examples/torchrun_ddp.py --data /path/to/imagenet --arch resnet50 --optimizer kfac
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from spdkfac import KFACPreconditioner, SPDKFACOptimizer
from spdkfac.comm import worker_device
from spdkfac.models import get_model
from spdkfac.train.imagefolder import ImageFolder, make_loader


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--arch", default="resnet50", help="a model of spdkfac.models (or torchvision:<name>)")
    ap.add_argument("--optimizer", choices=["sgd", "kfac", "kaisa"], default="kfac")
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--batch-size", type=int, default=32, help="per worker")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--weight-decay", type=float, default=1e-4)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--loader-workers", type=int, default=4)
    ap.add_argument("--max-steps", type=int, default=None, help="stop each epoch after this many steps (a quick check)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--pgd-steps", type=int, default=0, help="adversarial training: a PGD attack of this many steps")
    ap.add_argument("--pgd-eps", type=float, default=0.03, help="the attack's L-inf radius (on the normalised input)")
    args = ap.parse_args()

    device = worker_device()  # cuda:<local rank>, or the CPU
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    train_set = ImageFolder(args.data / "train", args.image_size, train=True)
    val_set = ImageFolder(args.data / "val", args.image_size, train=False, classes=train_set.classes)
    train_loader = make_loader(train_set, args.batch_size, rank, size, train=True, workers=args.loader_workers)
    val_loader = make_loader(val_set, args.batch_size, rank, size, train=False, workers=args.loader_workers)

    model = DistributedDataParallel(get_model(args.arch, num_classes=len(train_set.classes)).to(device))
    if args.compile:
        model = torch.compile(model)
    preconditioner = None
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    elif args.optimizer == "kfac":  # the one-line swap
        optimizer = SPDKFACOptimizer(model, lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    else:  # KAISA's usage: your optimizer, preconditioned gradients
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
        preconditioner = KFACPreconditioner(model, lr=lambda _step: optimizer.param_groups[0]["lr"])
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
            if args.pgd_steps:  # crafted in train mode, as usual: K-FAC drops the attack's passes itself
                x = pgd(model, loss_fn, x, y, args.pgd_steps, args.pgd_eps)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            if preconditioner is not None:
                preconditioner.step()
            optimizer.step()
            scheduler.step()
        correct, seen = evaluate(model, val_loader, device)
        if rank == 0:
            print(f"epoch {epoch}: train loss {loss.item():.4f}, val top-1 {correct / seen:.4f} ({seen:.0f} images)", flush=True)
    # Every rank arrives before any tears the group down: a gloo group destroyed while a peer still finishes its
    # last collective aborts that peer ("terminate called without an active exception"; 1 run in 8 without this).
    dist.barrier()
    dist.destroy_process_group()


def pgd(model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int, eps: float) -> torch.Tensor:
    """Madry et al.'s PGD: ``steps`` signed-gradient steps of size ``2.5 eps / steps`` within the L-inf ball."""
    delta = torch.zeros_like(x)
    for _ in range(steps):
        delta.requires_grad_(True)
        (grad,) = torch.autograd.grad(loss_fn(model(x + delta), y), delta)
        delta = (delta + 2.5 * eps / steps * grad.sign()).clamp(-eps, eps).detach()
    return x + delta


@torch.no_grad()
def evaluate(model: nn.Module, loader: torch.utils.data.DataLoader, device: torch.device) -> tuple[float, float]:
    """Correct predictions and images over every worker's shard of the validation set."""
    model.eval()
    counts = torch.zeros(2, device=device)
    for x, y in loader:
        counts += torch.tensor([(model(x.to(device)).argmax(1) == y.to(device)).sum().item(), len(y)], device=device)
    dist.all_reduce(counts)
    return counts[0].item(), counts[1].item()


if __name__ == "__main__":
    main()
