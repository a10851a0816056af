"""Multi-process worker: rank 1 is killed with SIGKILL in the middle of an iteration; the others must not hang.

    python tests/workers/lost_worker.py --backend torch --phase forward|factor|inversion

``forward``: in a layer's forward pass; ``factor``: while computing the last
G factor of the backward pass, after the others have sent theirs (rank 0 is
then in the factor all-reduce); ``inversion``: in the inversion stage, while
rank 0 waits for a broadcast inverse. Training runs at most 50 steps; rank 1
dies at step 3.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nets import batch, small_net

from spdkfac import SPDKFACOptimizer
from spdkfac.comm import get_backend

warnings.filterwarnings("ignore")
KILL_STEP = 3


def die() -> None:
    print(f"rank 1: killing myself (SIGKILL) at step {KILL_STEP}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--phase", required=True, choices=("forward", "factor", "inversion"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    backend = get_backend(args.backend)
    model = small_net()
    # 'seq' placement: every rank owns inverses and broadcasts them, so rank 0 waits for rank 1's in the inversion stage.
    opt = SPDKFACOptimizer(model, lr=0.01, backend=backend, placement="seq")
    x, y = batch(8)
    x, y = x[backend.rank * 4 : (backend.rank + 1) * 4], y[backend.rank * 4 : (backend.rank + 1) * 4]
    first, last = opt.layers[0], opt.layers[-1]
    if backend.rank == 1:
        if args.phase == "forward":
            last.module.register_forward_pre_hook(lambda m, i: die() if opt.steps == KILL_STEP else None)
        elif args.phase == "factor":
            compute_g = first.compute_g  # the first layer's G is the last factor of the backward pass

            def killing_compute_g(*a, **k):
                if opt.steps == KILL_STEP:
                    die()
                return compute_g(*a, **k)

            first.compute_g = killing_compute_g
        else:
            method = opt.kfac_step.decompositions.method  # this rank decomposes the factors it owns with it
            owned = method.owned

            def killing_owned(*a, **k):
                if opt.steps == KILL_STEP:
                    die()
                return owned(*a, **k)

            method.owned = killing_owned
    for step in range(50):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        print(f"rank {backend.rank}: step {step} done", flush=True)
    print(f"rank {backend.rank}: finished all steps (the lost worker was not noticed)", flush=True)


if __name__ == "__main__":
    main()
