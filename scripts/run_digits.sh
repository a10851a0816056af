#!/usr/bin/env bash
# The main job: install (scripts/setup.sh), then a real 2-worker horovodrun training run
# of SPDKFACOptimizer on scikit-learn's bundled 8x8 digits (no download needed).
#   bash scripts/run_digits.sh [extra spdkfac.train args, e.g. --epochs 10 --optimizer sgd]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NP="${NP:-2}"
# The main job's K-FAC configuration: Adam in K-FAC's eigenbasis (README, "The main job": its final test loss is below
# SGD's on every seed measured, benchmarks/main_job_seeds.py reads this line). Left out when the arguments choose
# an --optimizer (these options are K-FAC's); later arguments override it (e.g. --lr 0.001).
MAIN_JOB_KFAC=(--compute-method ekfac --base adamw --ekfac-update adam --kl-clip 0 --factor-update-freq 10 --inv-update-freq 10 --lr 0.002)
for arg in "$@"; do
    case "$arg" in --optimizer | --optimizer=*) MAIN_JOB_KFAC=() ;; esac
done
bash "$ROOT/scripts/setup.sh"
cd "$ROOT"
echo "[run_digits] horovodrun -np $NP --gloo python -m spdkfac.train --data digits ${MAIN_JOB_KFAC[*]} $*"
# A new run directory each time (a later --out-dir in the arguments wins): spdkfac.train never overwrites a run.
exec "$ROOT/.venv/bin/horovodrun" -np "$NP" -H "localhost:$NP" --gloo \
    "$ROOT/.venv/bin/python" -m spdkfac.train --data digits --epochs 8 \
    --perf-model "$ROOT/perfmodels/reference-cpu-gloo-2.json" --out-dir "runs/digits-$(date +%Y%m%d-%H%M%S)" \
    "${MAIN_JOB_KFAC[@]}" "$@"
