"""Plot test accuracy and training loss per epoch from spdkfac.train CSV logs, or redraw benchmarks.convergence figures.

    python scripts/plot_curves.py runs/spdkfac/log.csv runs/sgd/log.csv --labels SPD-KFAC SGD --out curves.png
    python scripts/plot_curves.py benchmarks/results/convergence/mnist5k_b256_interleaved/convergence.json

A convergence.json (from ``python -m benchmarks.convergence``) gives one
figure per (data, batch size) next to the JSON: test accuracy and test loss
against epochs and against training seconds.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path


def plot_convergence(path: Path) -> None:
    """The benchmark's own figures, redrawn from its JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.convergence import plot

    result = json.loads(path.read_text())
    for st in result["settings"]:
        out = path.parent / f"convergence_{st['data']}_b{st['batch_size']}.png"
        print(f"wrote {plot(st, out, result['world_size'])}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("logs", nargs="+", type=Path)
    ap.add_argument("--labels", nargs="*")
    ap.add_argument("--out", type=Path, default=Path("curves.png"))
    args = ap.parse_args()
    if all(p.suffix == ".json" for p in args.logs):
        for path in args.logs:
            plot_convergence(path)
        return
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
