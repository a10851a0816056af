#!/usr/bin/env bash
# Check the scale simulator against a measurement, with every input taken back to back on the same
# workers: fit the performance models, profile the workload, measure the variants, profile again, then
# predict them from the mean of the two profiles. (A model fitted hours earlier on a shared machine mixes
# the machine's drift into the simulator's error; the two profiles bracket the measured window.)
#
#   bash benchmarks/simulator_check.sh [iteration_time args...]
#   bash benchmarks/simulator_check.sh --resolution 224 --batch-size 32 \
#       --update-freq 10 100 --iters 10 --warmup 1 --interleave --variants sgd spdkfac spdkfac-dp
#
# Writes benchmarks/results/simulator_check/{perfmodel,profile_before,iteration_time,profile_after}.json and
# benchmarks/results/simulator_check.json, replacing the previous run's (one current run; the JSON records
# the arguments). NP (default 2) workers, Horovod over gloo. With --bind-cores
# among the arguments, the performance models and the profiles are measured with bound workers too.
# CHECK_NAME=name writes benchmarks/results/name/ and name.json instead (e.g. simulator_check_224 for 224x224).
# PERF_MODEL=file skips step 1 and predicts with that fitted file instead (a quicker look at the compute phases;
# the communication and inversion phases then carry the drift between that fit and this run).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -ge 1 && "$1" != -* ]]; then
    echo "usage: bash benchmarks/simulator_check.sh [benchmarks.iteration_time args] (no run name: results are replaced)" >&2
    exit 2
fi
NP="${NP:-2}"
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || { echo "error: $PY not found; run bash scripts/setup.sh first" >&2; exit 1; }
export PATH="$ROOT/.venv/bin:$PATH"
cd "$ROOT"

# The workload flags the profile must share with the measurement (and the core binding, which the
# performance models must share too).
MODEL=resnet50; RES=32; BATCH=4; BIND=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[$i]}" in
        --model) MODEL="${args[$((i + 1))]}" ;;
        --resolution) RES="${args[$((i + 1))]}" ;;
        --batch-size) BATCH="${args[$((i + 1))]}" ;;
        --bind-cores) BIND=(--bind-cores) ;;
    esac
done
NAME="${CHECK_NAME:-simulator_check}"   # another name keeps another workload's check beside the main one
DIR="benchmarks/results/$NAME"
mkdir -p "$DIR"
launch() { horovodrun -np "$NP" -H "localhost:$NP" --gloo "$PY" "$@"; }

profile() {
    echo "[simulator_check] $1 per-layer profile -> $DIR/$2 ($(date -u +%H:%M:%S))"
    launch -m spdkfac.simulate profile --model "$MODEL" --resolution "$RES" --batch-size "$BATCH" "${BIND[@]}" --out "$DIR/$2"
}
START=$(date +%s)
if [[ -n "${PERF_MODEL:-}" ]]; then
    [[ -f "$PERF_MODEL" ]] || { echo "error: PERF_MODEL=$PERF_MODEL is not a file" >&2; exit 2; }
    echo "[simulator_check] 1/5 performance models: $PERF_MODEL (PERF_MODEL, not fitted here)"
    [[ "$(realpath "$PERF_MODEL")" == "$(realpath -m "$DIR/perfmodel.json")" ]] || cp "$PERF_MODEL" "$DIR/perfmodel.json"
else
    echo "[simulator_check] 1/5 performance models -> $DIR/perfmodel.json ($(date -u +%H:%M:%S))"
    launch -m spdkfac.perfmodels benchmark --quick --threads 1 --model "$MODEL" "${BIND[@]}" --out "$DIR/perfmodel.json"
fi
profile 2/5 profile_before.json
echo "[simulator_check] 3/5 measured iteration times -> $DIR/iteration_time.json ($(date -u +%H:%M:%S))"
launch -m benchmarks.iteration_time --model "$MODEL" --threads 1 "$@" --out "$DIR/iteration_time.json"
profile 4/5 profile_after.json
echo "[simulator_check] 5/5 predictions vs measurements ($(date -u +%H:%M:%S))"
"$PY" -m benchmarks.simulator_check "$DIR/iteration_time.json" --profile "$DIR/profile_before.json" "$DIR/profile_after.json" \
    --perf-model "$DIR/perfmodel.json" --out "$NAME.json" \
    --script "${CHECK_NAME:+CHECK_NAME=$CHECK_NAME }${PERF_MODEL:+PERF_MODEL=$PERF_MODEL }bash benchmarks/simulator_check.sh $*" --script-seconds "$(( $(date +%s) - START ))"
echo "[simulator_check] done in $(( $(date +%s) - START )) s"
