"""Multi-process Horovod smoke test.

Run under horovodrun, e.g.:

    .venv/bin/horovodrun -np 2 --gloo -H localhost:2 .venv/bin/python scripts/check_horovod.py

Exercises the asynchronous in-place collectives that spdkfac relies on
(``allreduce_async_`` with ``op=hvd.Sum`` and the default average,
``broadcast_async_`` from a non-zero root, ``synchronize``) and asserts the
results on every rank.
"""

import sys

import horovod.torch as hvd
import torch


def main() -> int:
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if size < 2:
        print(f"check_horovod: expected >= 2 processes, got size={size}", file=sys.stderr)
        return 2

    # Rank-dependent inputs: value r+1 on rank r.
    vec_sum = torch.full((5,), float(rank + 1), dtype=torch.float32)
    vec_avg = torch.full((5,), float(rank + 1), dtype=torch.float64)
    # A symmetric 2-D "factor"-like matrix, as K-FAC averages.
    mat = torch.eye(3, dtype=torch.float32) * (rank + 1) + 0.5
    bcast = torch.arange(4, dtype=torch.float32) + 100.0 * rank
    root = 1

    handles = [
        hvd.allreduce_async_(vec_sum, op=hvd.Sum, name="check.sum"),
        hvd.allreduce_async_(vec_avg, name="check.avg"),  # default op: Average
        hvd.allreduce_async_(mat, name="check.mat"),
        hvd.broadcast_async_(bcast, root_rank=root, name="check.bcast"),
    ]
    outputs = [hvd.synchronize(h) for h in handles]

    total = size * (size + 1) / 2.0  # sum over ranks of (r+1)
    mean = total / size
    expected = [
        torch.full((5,), total, dtype=torch.float32),
        torch.full((5,), mean, dtype=torch.float64),
        torch.eye(3, dtype=torch.float32) * mean + 0.5,
        torch.arange(4, dtype=torch.float32) + 100.0 * root,
    ]
    in_place = [vec_sum, vec_avg, mat, bcast]
    names = ["allreduce_async_(op=Sum)", "allreduce_async_(average)", "allreduce_async_(matrix)", f"broadcast_async_(root_rank={root})"]
    for name, out, buf, exp in zip(names, outputs, in_place, expected):
        assert torch.allclose(out, exp), f"rank {rank}: {name} returned {out}, expected {exp}"
        assert torch.allclose(buf, exp), f"rank {rank}: {name} did not update in place: {buf}"

    # All ranks must agree that every rank passed.
    ok = hvd.allreduce(torch.ones(1), op=hvd.Sum, name="check.ok")
    assert int(ok.item()) == size, f"rank {rank}: only {ok.item()} of {size} ranks passed"

    print(f"horovod OK rank {rank}/{size}", flush=True)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
