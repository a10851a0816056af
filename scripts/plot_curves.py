"""Plot test accuracy and training loss per epoch from spdkfac.train CSV logs, or redraw benchmarks.convergence figures.

    python scripts/plot_curves.py runs/spdkfac/log.csv runs/sgd/log.csv --labels SPD-KFAC SGD --out curves.png
    python scripts/plot_curves.py benchmarks/results/convergence/mnist5k_b256_interleaved/convergence.json
    python scripts/plot_curves.py benchmarks/results/convergence/mnist5k_b256_race/convergence.json --per-seed soap adamw

A convergence.json (from ``python -m benchmarks.convergence``) gives one
figure per (data, batch size) next to the JSON: test accuracy and test loss
against epochs and against training seconds; with ``--per-seed SPEC ...``, one
figure of those optimizers' curves seed by seed at their chosen LR
(``convergence_<data>_b<batch>_per_seed.png``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def plot_convergence(path: Path, per_seed: list[str] | None = None) -> None:
    """The benchmark's own figures, redrawn from its JSON; or, given ``per_seed``, those optimizers' curves per seed."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.convergence import plot, plot_per_seed

    result = json.loads(path.read_text())
    for st in result["settings"]:
        stem = path.parent / f"convergence_{st['data']}_b{st['batch_size']}"
        if per_seed:
            try:
                print(f"wrote {plot_per_seed(st, per_seed, stem.with_name(stem.name + '_per_seed.png'))}")
            except ValueError as exc:
                raise SystemExit(f"error: --per-seed: {exc}") from None
        else:
            print(f"wrote {plot(st, stem.with_suffix('.png'), result['world_size'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--out", type=Path, default=Path("curves.png"))
    ap.add_argument("--per-seed", nargs="+", metavar="SPEC", help="convergence.json: these optimizers' curves seed by seed")
    args = ap.parse_args()
    if all(p.suffix == ".json" for p in args.logs):
        for path in args.logs:
            plot_convergence(path, args.per_seed)
        return
    if args.per_seed:
        raise SystemExit("error: --per-seed applies to convergence.json files only")
    labels = args.labels or [p.parent.name for p in args.logs]
    if len(labels) != len(args.logs):
        raise SystemExit("error: give one --labels entry per log")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_acc, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for path, label in zip(args.logs, labels):
        if not path.is_file():
            raise SystemExit(f"error: {path} does not exist")
        rows = list(csv.DictReader(path.open()))
        if not rows:
            raise SystemExit(f"error: {path} has no epochs")
        epochs = [int(r["epoch"]) + 1 for r in rows]
        ax_acc.plot(epochs, [100 * float(r["test_acc"]) for r in rows], "o-", label=label)
        ax_loss.semilogy(epochs, [max(float(r["train_loss"]), 1e-6) for r in rows], "o-", label=label)
    ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy")
    ax_loss.set(xlabel="epoch", ylabel="training loss", title="training loss")
    for ax in (ax_acc, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
