#!/usr/bin/env bash
# Launch spdkfac.train with Horovod.
#   one node:     NP=4 bash scripts/launch_horovod.sh --data /data/imagenet --epochs 55
#   several nodes: NP=16 HOSTFILE=hosts.txt bash scripts/launch_horovod.sh --data /data/imagenet
#   elastic:      MIN_NP=1 MAX_NP=4 DISCOVERY=./discover.sh NIC=lo bash scripts/launch_horovod.sh --epochs 3
# HOSTFILE lines look like "node1 slots=4". Set GLOO=0 to use MPI (Horovod built with MPI).
# Elastic (horovodrun --min-np/--max-np, gloo): DISCOVERY is Horovod's host discovery script (prints "host:slots"
# lines; edit what it prints and workers join or leave), NIC the network interface (lo on one machine). It runs
# SCRIPT (default examples/elastic_horovod.py), a script written for hvd.elastic.run with
# spdkfac.train.elastic.ElasticState; spdkfac.train itself restarts from checkpoints (--resume auto), not elastically.
# CYCLE_MS sets Horovod's background cycle (--cycle-time-ms; Horovod's default is 1 ms). On CPU-only nodes
# with one worker per core, CYCLE_MS=20 leaves the cores to the computation, and spdkfac.train's --bind-cores
# keeps each worker on its own cores (see docs/performance.md, Running on CPUs).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NP="${NP:-2}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
HVDRUN="${HOROVODRUN:-$ROOT/.venv/bin/horovodrun}"
[[ -x "$HVDRUN" ]] || { echo "horovodrun not found at $HVDRUN; run scripts/setup.sh first" >&2; exit 1; }
hosts=(-H "localhost:$NP")
if [[ -n "${HOSTFILE:-}" ]]; then
    [[ -f "$HOSTFILE" ]] || { echo "HOSTFILE $HOSTFILE does not exist" >&2; exit 1; }
    hosts=(-hostfile "$HOSTFILE")
fi
engine=(--gloo)
[[ "${GLOO:-1}" == "0" ]] && engine=(--mpi)
if [[ -n "${CYCLE_MS:-}" ]]; then
    [[ "$CYCLE_MS" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "CYCLE_MS must be a number of milliseconds, got '$CYCLE_MS'" >&2; exit 2; }
    engine+=(--cycle-time-ms "$CYCLE_MS")
fi
cd "$ROOT"
if [[ -n "${MIN_NP:-}${MAX_NP:-}" ]]; then
    [[ -n "${DISCOVERY:-}" && -x "${DISCOVERY}" ]] || {
        echo "elastic mode (MIN_NP/MAX_NP) needs DISCOVERY=an executable host discovery script that prints host:slots lines" >&2; exit 2; }
    [[ "${GLOO:-1}" != "0" ]] || { echo "Horovod's elastic mode needs gloo (unset GLOO=0)" >&2; exit 2; }
    [[ "${MIN_NP:-1}${MAX_NP:-1}" =~ ^[0-9]+$ ]] || { echo "MIN_NP and MAX_NP must be numbers of workers" >&2; exit 2; }
    nic=()
    [[ -n "${NIC:-}" ]] && nic=(--network-interface "$NIC")
    set -x
    exec "$HVDRUN" -np "$NP" --min-np "${MIN_NP:-1}" --max-np "${MAX_NP:-$NP}" --host-discovery-script "$DISCOVERY" "${nic[@]}" \
        "${engine[@]}" "$PY" "${SCRIPT:-examples/elastic_horovod.py}" "$@"
fi
set -x
exec "$HVDRUN" -np "$NP" "${hosts[@]}" "${engine[@]}" "$PY" -m spdkfac.train "$@"
