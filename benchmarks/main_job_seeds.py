"""The main job over several seeds: SPD-KFAC's final test loss against SGD's, seed by seed.

    python -m benchmarks.main_job_seeds [--seeds 42 1 2] [--configs sgd spdkfac spdkfac-paper-damping]

Runs what ``bash scripts/run_digits.sh`` runs (``spdkfac.train --data digits
--epochs 8``, 2 Horovod workers) once per configuration and seed, one run at a
time, and records every epoch's test loss and accuracy from each run's log.
The seed fixes the model's initialisation, the shuffling and the train/test
split, so SGD and SPD-KFAC are compared on the same split for each seed.
``spdkfac`` is the main job as it is: Adam in K-FAC's eigenbasis, the options
scripts/run_digits.sh adds (read from its ``MAIN_JOB_KFAC`` line);
``spdkfac-lr0.001``, ``spdkfac-lr0.004`` and ``spdkfac-ekfac-decay0.8`` are
its neighbours (half and twice the LR, a shorter second-moment average), to
show whether its margin over SGD depends on the exact setting.
``spdkfac-inverse`` is the training job's K-FAC defaults (the inverse method
with momentum SGD, damping 0.1 on digits: the main job before), and
``spdkfac-paper-damping`` the same with the paper's damping of 0.003, the
default on digits before it was raised (README, "The main job").
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from spdkfac.runtime.output_path import output_file

from .common import RESULTS, machine

ROOT = Path(__file__).resolve().parent.parent
RUN_DIGITS = ROOT / "scripts" / "run_digits.sh"


def main_job_kfac(script: Path = RUN_DIGITS) -> list[str]:
    """The K-FAC options the main job adds (``MAIN_JOB_KFAC=(...)`` in scripts/run_digits.sh), so the script stays their one source."""
    match = re.search(r"^MAIN_JOB_KFAC=\((.*)\)\s*$", script.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"{script} has no MAIN_JOB_KFAC=(...) line")
    return shlex.split(match.group(1))


#: The main job's K-FAC options (Adam in K-FAC's eigenbasis, docs/eigenbasis.md).
MAIN_JOB = main_job_kfac()
#: Configurations: the arguments each adds to ``spdkfac.train --data digits --epochs 8``.
CONFIGS: dict[str, list[str]] = {
    "sgd": ["--optimizer", "sgd"],
    "spdkfac": MAIN_JOB,
    "spdkfac-inverse": [],
    "spdkfac-paper-damping": ["--damping", "0.003"],
    "spdkfac-lr0.001": [*MAIN_JOB, "--lr", "0.001"],
    "spdkfac-lr0.004": [*MAIN_JOB, "--lr", "0.004"],
    "spdkfac-ekfac-decay0.8": [*MAIN_JOB, "--ekfac-decay", "0.8"],
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", nargs="+", type=int, default=[42, 1, 2], help="--seed of each run (42: the main job's default)")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--epochs", type=int, default=8, help="the main job's 8")
    ap.add_argument("--np", type=int, default=2, help="Horovod workers (the main job's 2)")
    ap.add_argument("--perf-model", default="perfmodels/reference-cpu-gloo-2.json")
    ap.add_argument("--out", default=str(RESULTS / "main_job_seeds.json"), type=output_file(make_parents=True))
    args = ap.parse_args(argv)
    if args.epochs < 1 or args.np < 1:
        ap.error("--epochs and --np must be >= 1")
    return args


def job_command(args: argparse.Namespace, extra: Sequence[str], seed: int, out_dir: Path) -> list[str]:
    """The main job's command line (scripts/run_digits.sh without the installer) for one run."""
    n = args.np
    return [
        *(str(Path(sys.executable).with_name("horovodrun")), "-np", str(n), "-H", f"localhost:{n}", "--gloo"),
        *(sys.executable, "-m", "spdkfac.train", "--data", "digits", "--epochs", str(args.epochs)),
        *("--perf-model", args.perf_model, "--out-dir", str(out_dir), "--seed", str(seed), "--quiet", *extra),
    ]


def read_log(path: Path) -> list[dict[str, float]]:
    """The per-epoch rows of a run's log.csv (epoch, losses, accuracies, lr)."""
    with open(path, newline="") as fh:
        return [
            {key: (int(row[key]) if key == "epoch" else float(row[key])) for key in ("epoch", "train_loss", "test_loss", "test_acc", "lr")}
            for row in csv.DictReader(fh)
        ]


def finished(stdout: str, curve: list[dict[str, float]], epochs: int) -> bool:
    """Whether a run trained every epoch and said so (``done:``): a failure after that is in its teardown, not its numbers."""
    return len(curve) == epochs and "done: log" in stdout


def summary(curve: list[dict[str, float]]) -> dict[str, float]:
    """Final test loss and accuracy, best test accuracy."""
    return {
        "final_test_loss": curve[-1]["test_loss"],
        "final_test_acc": curve[-1]["test_acc"],
        "best_test_acc": max(r["test_acc"] for r in curve),
        "min_test_loss": min(r["test_loss"] for r in curve),
    }


def targets(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per seed, each K-FAC configuration's final test loss at most SGD's (and best accuracy at least SGD's), and its ratio to SGD's."""
    if "sgd" not in runs:
        return {}
    out: dict[str, Any] = {}
    for name, per_seed in runs.items():
        if name == "sgd":
            continue
        rows = {
            seed: {
                "final_loss_at_most_sgd": r["summary"]["final_test_loss"] <= runs["sgd"][seed]["summary"]["final_test_loss"],
                "final_loss_over_sgd": r["summary"]["final_test_loss"] / runs["sgd"][seed]["summary"]["final_test_loss"],
                "best_acc_at_least_sgd": r["summary"]["best_test_acc"] >= runs["sgd"][seed]["summary"]["best_test_acc"],
            }
            for seed, r in per_seed.items()
            if seed in runs["sgd"]
        }
        out[name] = {
            "per_seed": rows,
            "final_loss_at_most_sgd_every_seed": all(v["final_loss_at_most_sgd"] for v in rows.values()),
            # the margin: the seed where the configuration comes closest to SGD's final test loss (below 1: lower on every seed)
            "worst_final_loss_over_sgd": max((v["final_loss_over_sgd"] for v in rows.values()), default=None),
        }
    return out


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    runs: dict[str, dict[str, Any]] = {name: {} for name in args.configs}
    with tempfile.TemporaryDirectory(prefix="main_job_seeds-") as tmp:
        for seed in args.seeds:
            for name in args.configs:
                out_dir = Path(tmp) / f"{name}-{seed}"
                cmd = job_command(args, CONFIGS[name], seed, out_dir)
                print(f"[main_job_seeds] {name}, seed {seed}", flush=True)
                done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True)
                curve = read_log(out_dir / "log.csv") if (out_dir / "log.csv").is_file() else []
                if done.returncode != 0 and not finished(done.stdout, curve, args.epochs):
                    raise SystemExit(f"error: {shlex.join(cmd)} failed ({done.returncode}):\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
                if done.returncode != 0:  # recorded and shown: the run's numbers are complete, its teardown failed
                    print(f"  exit status {done.returncode} after the run finished:\n{done.stdout[-600:]}{done.stderr[-600:]}", flush=True)
                runs[name][str(seed)] = {"curve": curve, "summary": summary(curve), "exit_status": done.returncode}
                s = runs[name][str(seed)]["summary"]
                print(f"  final test loss {s['final_test_loss']:.4f}, best test acc {s['best_test_acc']:.4f}", flush=True)
    result = {
        "command": " ".join(["python -m benchmarks.main_job_seeds", *map(shlex.quote, argv if argv is not None else sys.argv[1:])]),
        "job": "horovodrun -np N -H localhost:N --gloo python -m spdkfac.train --data digits --epochs E "
        "--perf-model PERF_MODEL --seed SEED [configuration's arguments]",
        "machine": {**machine(), "torch_threads": 1},  # each worker's (spdkfac.train's --threads default), not this driver's
        "engine": "horovod",
        "world_size": args.np,
        "epochs": args.epochs,
        "seeds": args.seeds,
        "configs": {name: CONFIGS[name] for name in args.configs},
        "runs": runs,
        "targets": targets(runs),
    }
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
