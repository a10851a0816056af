"""Multi-process worker: rank 1 stays alive but stops issuing collectives (a hang in user code).

    python tests/workers/stuck_worker.py --backend torch --timeout 5

The other ranks wait in an all-reduce rank 1 never joins; with the collective
timeout they must end the job, saying every worker is alive (nobody froze).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spdkfac.comm import get_backend

STUCK_STEP = 3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--timeout", type=float, required=True)
    args = ap.parse_args()
    backend = get_backend(args.backend, collective_timeout=args.timeout)
    for step in range(10):
        if backend.rank == 1 and step == STUCK_STEP:
            print(f"rank 1: stuck at step {step}", flush=True)
            time.sleep(600)
        t = torch.full((8,), float(backend.rank))
        backend.allreduce_async(t, f"stuck.step{step}").wait()
    print(f"rank {backend.rank}: finished all steps (the stuck worker was not noticed)", flush=True)


if __name__ == "__main__":
    main()
