"""Elastic Horovod training with SPD-KFAC: workers may leave and join while the job runs.

A Horovod elastic script (``hvd.elastic.run``) with ``spdkfac.train.elastic.ElasticState``
in place of ``hvd.elastic.TorchState``; the K-FAC state (factors, decompositions,
momentum, step counter) is committed with the model, restored after a lost
worker, sent to joining workers, and fusion and placement are re-planned at
every new size. Trains the digits CNN on scikit-learn's bundled 8x8 digits::

    echo localhost:2 > hosts.txt; printf '#!/bin/sh\\ncat hosts.txt\\n' > discover.sh; chmod +x discover.sh
    horovodrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./discover.sh --network-interface lo --gloo \\
        python examples/elastic_horovod.py --epochs 3
    # or: MIN_NP=1 MAX_NP=4 DISCOVERY=./discover.sh bash scripts/launch_horovod.sh   (runs this script)

Edit hosts.txt while it runs (``localhost:3``) and a worker joins at the
next commit; kill a worker and the others go on from the last commit.
"""

from __future__ import annotations

import argparse
import hashlib

import horovod.torch as hvd
import torch
import torch.nn as nn

from spdkfac import SPDKFACOptimizer
from spdkfac.models import get_model
from spdkfac.train.data import ShardedLoader, load_digits
from spdkfac.train.elastic import ElasticState


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="per worker")
    parser.add_argument("--lr", type=float, default=0.02, help="per worker: the job's learning rate is lr * workers")
    parser.add_argument("--commit-every", type=int, default=5, help="steps between commits (a lost worker costs at most these)")
    parser.add_argument("--perf-model", default="perfmodels/reference-cpu-gloo-2.json")
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    train, test = load_digits(seed=0)
    model = get_model("digits_cnn", num_classes=train.num_classes)
    optimizer = SPDKFACOptimizer(model, lr=args.lr * hvd.size(), momentum=0.9, perf_model=args.perf_model)
    # ElasticState in place of hvd.elastic.TorchState: epoch and samples are plain values committed with the rest.
    state = ElasticState(model, optimizer, epoch=0, samples=0)

    def on_reset() -> None:  # after a reset the optimizer is already re-planned; the LR follows the new size
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: {hvd.size()} workers from epoch {state.epoch}, sample {state.samples}", flush=True)

    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def run(state: ElasticState) -> None:
        while state.epoch < args.epochs:
            # Rank and size are read at every (re)start; the loader resumes the epoch where the commit left it.
            loader = ShardedLoader(train, args.batch_size, hvd.rank(), hvd.size(), shuffle=True, seed=0)
            loader.set_epoch(state.epoch, start=state.samples)
            loss = None  # a restart near the epoch's end may leave no batch of it to this worker count
            for step, (x, y) in enumerate(loader, start=1):
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                state.samples += len(y) * hvd.size()
                if step % args.commit_every == 0:
                    state.commit()
            state.epoch, state.samples = state.epoch + 1, 0
            accuracy = evaluate(model, test)
            if hvd.rank() == 0:
                last = f"loss {float(loss):.4f}" if loss is not None else "no step after the restart"
                print(f"epoch {state.epoch - 1}: {last}, test accuracy {accuracy:.3f}, {hvd.size()} workers", flush=True)
            state.commit()

    run(state)
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
    print(f"rank {hvd.rank()}/{hvd.size()}: done, parameters sha256 {digest}", flush=True)


def evaluate(model: nn.Module, test: object) -> float:
    """Accuracy on the whole test set (every worker computes the same)."""
    model.eval()
    with torch.no_grad():
        accuracy = float((model(test.x).argmax(1) == test.y).double().mean())  # type: ignore[attr-defined]
    model.train()
    return accuracy


if __name__ == "__main__":
    main()
