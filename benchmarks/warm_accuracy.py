"""The warm eigenbasis refresh's accuracy at a training learning rate: its preconditioned gradient against ``eigh``'s.

    python -m benchmarks.warm_accuracy --model cifar_resnet20 --lr 0.1 --iters 20

One process trains ``--model`` with the exact eigen method (SGD, momentum
0.9, damping 0.003, KL-clip 0.001, factors and decompositions every
iteration, one fixed random batch as ``vs_kaisa`` uses, or with
``--fresh-batches`` a new one every iteration, so that the factors also move
with the sampling noise as in training). Beside it, each warm
step keeps its own chain of bases, refreshed every iteration from its own
previous one and never replaced by a full ``eigh`` (so iteration ``t`` shows
the error ``t`` refreshes after an ``eigh``), one chain per
:class:`~spdkfac.kfac.methods.warm.WarmStepKind`: ``block`` (the default: a
subspace and a Rayleigh–Ritz step on the leading columns, the rest kept
orthonormal to them), ``subspace`` (one subspace step on every column, the
earlier default) and ``ritz`` (that step followed by Rayleigh–Ritz). Per iteration and step it
records the relative error of the preconditioned gradient against the exact
one over the whole model and for the worst layer, and the largest residual of
the previous basis on the new factor (the drift) and of the refreshed basis
(what the shipped check compares with its tolerance). Block-diagonal and
diagonal factors are left out. Writes ``warm_accuracy.json``.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from spdkfac import make_optimizer
from spdkfac.kfac.eigenbasis import Eigen, eigen_precondition
from spdkfac.kfac.methods.warm import WarmRefresh, WarmStepKind, drift
from spdkfac.models import get_model

from .common import machine, save_json, start, workload_parser

STEPS = tuple(kind.value for kind in WarmStepKind)


def refresh(step: str, factor: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, float]:
    """``(d, Q, residual of the refreshed basis)`` of one warm step, never falling back."""
    refreshed = WarmRefresh(tolerance=float("inf"), kind=step).step(factor, q)
    assert refreshed.refreshed is not None  # never None at this tolerance (a block step's overlap check aside)
    d, q = refreshed.refreshed
    return d, q, drift(q, factor @ q) if refreshed.refined is None else refreshed.refined


def main(argv: list[str] | None = None) -> None:
    ap = workload_parser(__doc__, iters=20, out_name="warm_accuracy.json", model="cifar_resnet20")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--damping", type=float, default=0.003)
    ap.add_argument(
        "--fresh-batches", action="store_true", help="a new random batch every iteration (default: one fixed batch, as vs_kaisa)"
    )
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    start(args, distributed=False)
    torch.manual_seed(0)
    model = get_model(args.model)
    opt = make_optimizer(
        "spdkfac:compute_method=eigen",
        model,
        lr=args.lr,
        momentum=0.9,
        damping=args.damping,
        kl_clip=0.001,
        backend="single",
        perf_model=args.perf_model,
    )
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch_size, 3, args.resolution, args.resolution, generator=gen)
    y = torch.randint(0, 10, (args.batch_size,), generator=gen)
    chains: dict[str, dict[tuple[str, str], Eigen]] = {step: {} for step in STEPS}
    rows: list[dict[str, Any]] = []
    for it in range(args.iters):
        if args.fresh_batches and it > 0:
            x = torch.randn(args.batch_size, 3, args.resolution, args.resolution, generator=gen)
            y = torch.randint(0, 10, (args.batch_size,), generator=gen)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        grads = {layer.name: layer.grad_matrix().clone() for layer in opt.layers}  # type: ignore[union-attr]
        opt.step()
        row: dict[str, Any] = {"iteration": it, "loss": float(loss)}
        for step, chain in chains.items():
            num = den = 0.0
            worst, worst_layer, drifts, residuals = 0.0, "", [0.0], [0.0]
            for layer in opt.layers:
                exact = {kind: layer.decomposition(kind) for kind in "AG"}
                if any(e.Q is None or e.Q.dim() != 2 for e in exact.values()):
                    continue
                warm = {}
                for kind in "AG":
                    packed = layer.packed_factor(kind)
                    assert packed is not None
                    factor = layer.shape(kind).unpack(packed) if packed.dim() == 1 else packed
                    previous = chain.get((layer.name, kind))
                    if previous is None:  # the chain starts from the exact basis (descending, as the warm method keeps it)
                        warm[kind] = Eigen(exact[kind].Q.flip(-1).clone(), exact[kind].d.flip(-1).clone())
                        continue
                    assert previous.Q is not None
                    drifts.append(drift(previous.Q, factor @ previous.Q))
                    d, q, residual = refresh(step, factor, previous.Q.clone())
                    residuals.append(residual)
                    warm[kind] = Eigen(q, d.clamp_min(0.0))
                chain.update({(layer.name, kind): warm[kind] for kind in "AG"})
                reference = eigen_precondition(grads[layer.name], exact["A"], exact["G"], args.damping)
                mine = eigen_precondition(grads[layer.name], warm["A"], warm["G"], args.damping)
                error = float((mine - reference).norm() / reference.norm())
                if error > worst:
                    worst, worst_layer = error, layer.name
                num += float((mine - reference).norm()) ** 2
                den += float(reference.norm()) ** 2
            row[step] = {
                "relative_error": math.sqrt(num / den) if den else 0.0,
                "worst_layer_error": worst,
                "worst_layer": worst_layer,
                "max_drift": max(drifts),
                "max_residual": max(residuals),
            }
        rows.append(row)
        print(
            f"iteration {it}: loss {float(loss):.3f}  "
            + "  ".join(f"{s} {100 * row[s]['relative_error']:.2f}% (worst {100 * row[s]['worst_layer_error']:.1f}%)" for s in STEPS),
            flush=True,
        )
    out = Path(args.out)
    save_json({"args": vars(args), "machine": machine(), "rows": rows}, out.name, out.parent)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
