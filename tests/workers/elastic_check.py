"""Horovod elastic worker: SPDKFACOptimizer under ``hvd.elastic.run`` while one worker dies and others join.

Every step trains on a fixed global batch (``GLOBAL_BATCH`` samples of step
``s``), split evenly over the workers of the moment, so the parameters do not
depend on how many workers made each step. The worker on host ``--die-host``
exits in the middle of step ``--die-at`` (after its backward pass, before
``step()``): the others' collectives fail, they restore the last commit and
continue without it. At step ``--grow-at`` rank 0 rewrites the discovery
script's host file (``--grow-to``) and waits for Horovod to notice: the next
commit adds the new workers, which start from rank 0's commit.

Each process appends JSON lines to ``<out>/events-<pid>.jsonl``: every
(re)start of the training function with the size, rank, step and whether
its live state equals the commit it resumed from bit for bit (and, for a
process that made that commit, where it differs from the one made then), and at the end the
digest of its model and optimizer state. Rank 0 saves the final parameters
to ``<out>/params.pt``. ``--reference`` trains one process on the same
batches (``backend='single'``) and saves ``<out>/reference.pt``.

    horovodrun -np 2 --min-np 1 --max-np 3 --host-discovery-script D --network-interface lo --gloo \\
        python tests/workers/elastic_check.py --out DIR --hosts-file H
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import batch, small_net

from spdkfac import SPDKFACOptimizer
from spdkfac.train.checkpoint import content_digest

warnings.filterwarnings("ignore", message="no perf_model given")
torch.set_default_dtype(torch.float64)

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4 workers
OPTIONS: dict[str, Any] = dict(
    lr=0.05, momentum=0.9, weight_decay=1e-3, damping=0.01, kl_clip=0.01, factor_update_freq=1, inv_update_freq=2, profile_steps=2
)


def make(backend: str) -> tuple[nn.Module, SPDKFACOptimizer]:
    model = small_net(seed=0)
    return model, SPDKFACOptimizer(model, backend=backend, **OPTIONS)


def step_batch(step: int, rank: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(GLOBAL_BATCH, seed=100 + step)
    per = GLOBAL_BATCH // size
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def train_step(model: nn.Module, optimizer: SPDKFACOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()


def live_digest(model: nn.Module, optimizer: SPDKFACOptimizer) -> str:
    return content_digest({"model": model.state_dict(), "optimizer": optimizer.state_dict()})


def differences(a: Any, b: Any, where: str = "") -> list[str]:
    """The paths at which two states differ (tensors compared bit for bit)."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=repr) for d in differences(a.get(k), b.get(k), f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and content_digest(a) == content_digest(b)
        return [] if same else [where]
    return [] if type(a) is type(b) and a == b else [where]


def reference(args: argparse.Namespace) -> None:
    model, optimizer = make("single")
    for s in range(args.steps):
        train_step(model, optimizer, *step_batch(s, 0, 1))
        optimizer.step()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, Path(args.out) / "reference.pt")


def elastic(args: argparse.Namespace) -> None:
    import horovod.torch as hvd

    from spdkfac.train.elastic import ElasticState

    hvd.init()
    out = Path(args.out)
    host = os.environ.get("HOROVOD_HOSTNAME", "")
    events = out / f"events-{os.getpid()}.jsonl"

    def log(**record: Any) -> None:
        with open(events, "a") as fh:
            fh.write(json.dumps({"pid": os.getpid(), "host": host, **record}) + "\n")

    model, optimizer = make("horovod")
    state = ElasticState(model, optimizer, step=0)
    made: dict[int, Any] = {}  # step -> the commit this process made there

    @hvd.elastic.run
    def train(state: ElasticState) -> None:
        live = live_digest(model, optimizer)
        committed = content_digest({"model": state.committed["model"], "optimizer": state.committed["objects"]["optimizer"]})
        log(
            event="start",
            size=hvd.size(),
            rank=hvd.rank(),
            step=state.step,
            live_equals_commit=live == committed,
            differences=differences(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()},
                {"model": state.committed["model"], "optimizer": state.committed["objects"]["optimizer"]},
            ),
            differences_from_commit_made_here=None
            if state.step not in made
            else differences({"model": state.committed["model"], "optimizer": state.committed["objects"]["optimizer"]}, made[state.step]),
            commit=committed,
            planned_for=optimizer.work_plan.workers,
        )
        while state.step < args.steps:
            s = state.step
            x, y = step_batch(s, hvd.rank(), hvd.size())
            train_step(model, optimizer, x, y)
            if s == args.die_at and host == args.die_host:
                log(event="dying", step=s, rank=hvd.rank(), size=hvd.size())
                os._exit(1)
            optimizer.step()
            state.step += 1
            if hvd.rank() == 0 and s == args.grow_at and Path(args.hosts_file).read_text().strip() != args.grow_to.strip():
                Path(args.hosts_file).write_text(args.grow_to.replace(",", "\n") + "\n")
                log(event="grow", step=s, to=args.grow_to)
                time.sleep(4)  # Horovod polls the discovery script every second; the next commit sees the new hosts
            if state.step % args.commit_every == 0:
                try:
                    state.commit()
                finally:
                    made[state.step] = copy.deepcopy(
                        {"model": state.committed["model"], "optimizer": state.committed["objects"]["optimizer"]}
                    )

    train(state)
    log(event="end", size=hvd.size(), rank=hvd.rank(), step=state.step, digest=live_digest(model, optimizer))
    if hvd.rank() == 0:
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / "params.pt")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--commit-every", type=int, default=2)
    parser.add_argument("--die-at", type=int, default=5)
    parser.add_argument("--die-host", default="127.0.0.1")
    parser.add_argument("--grow-at", type=int, default=9)
    parser.add_argument("--grow-to", default="localhost:3")
    parser.add_argument("--hosts-file", default="")
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.reference:
        reference(args)
    else:
        elastic(args)


if __name__ == "__main__":
    main()
