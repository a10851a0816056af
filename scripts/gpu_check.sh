#!/usr/bin/env bash
# The GPU path checked and timed in one command (benchmarks/gpu_check.py): the gpu tests, 2 processes on one GPU,
# torch.linalg vs cupy decompositions, ResNet-50/224 iteration times under bf16 next to SGD and AdamW, the
# decomposition curves. Needs torch (and cupy for its comparison), nothing installed: the project runs from source.
#
#   bash scripts/gpu_check.sh [--out FILE.json] [--stages tests timing ...]    # on a GPU: under 8 minutes
#   bash scripts/gpu_check.sh --device cpu --quick                             # the script itself, on a CPU
#
# Then render it into benchmarks/RESULTS.md: python scripts/results_md.py
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PY="$ROOT/.venv/bin/python"; else PY="$(command -v python3)"; fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
cd "$ROOT"
exec "$PY" -m benchmarks.gpu_check "$@"
