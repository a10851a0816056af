"""Multi-process worker: rank 0 leaves with an error before a collective the other ranks wait in.

    python tests/workers/one_rank_exits.py --backend torch [--tell-engine]

With ``--tell-engine`` rank 0 first calls ``spdkfac.comm.leaving_on_error()``
(what ``spdkfac.train`` does on any error), so it must not wait for the
others at exit: the launcher sees its failure at once and stops the job.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spdkfac.comm import get_backend, leaving_on_error


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", required=True)
    ap.add_argument("--tell-engine", action="store_true")
    args = ap.parse_args()
    backend = get_backend(args.backend)  # the default timeout (300 s): far longer than the job may take
    backend.barrier()
    if backend.rank == 0:
        if args.tell_engine:
            leaving_on_error()
        raise SystemExit("error: rank 0 leaves alone")
    backend.barrier()  # never completes: rank 0 is gone
    print(f"rank {backend.rank}: passed a barrier rank 0 never reached", flush=True)


if __name__ == "__main__":
    main()
