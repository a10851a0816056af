#!/usr/bin/env bash
# The main job: install (scripts/setup.sh), then a real 2-worker horovodrun training run
# of SPDKFACOptimizer on scikit-learn's bundled 8x8 digits (no download needed).
#   bash scripts/run_digits.sh [extra spdkfac.train args, e.g. --epochs 10 --optimizer sgd]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NP="${NP:-2}"
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
echo "[run_digits] horovodrun -np $NP --gloo python -m spdkfac.train --data digits $*"
# A new run directory each time (a later --out-dir in the arguments wins): spdkfac.train never overwrites a run.
exec "$ROOT/.venv/bin/horovodrun" -np "$NP" -H "localhost:$NP" --gloo \
    "$ROOT/.venv/bin/python" -m spdkfac.train --data digits --epochs 8 \
    --perf-model "$ROOT/perfmodels/reference-cpu-gloo-2.json" --out-dir "runs/digits-$(date +%Y%m%d-%H%M%S)" "$@"
