#!/usr/bin/env bash
# The oldest Python and torch spdkfac declares (Python 3.9, torch 2.4.1), checked by hand, not in CI: torch 2.4.1
# for Python 3.9 is a CUDA build of about 5 GB (it runs on the CPU). Makes .venv-oldest/ with them and runs the
# tests there without installing spdkfac (PYTHONPATH); Horovod, transformers and heavyball are left out, and
# their tests skip.
#
#   bash scripts/check_oldest.sh                          # the fast loop (-m "not multiprocess")
#   bash scripts/check_oldest.sh -m multiprocess          # the torchrun tests (arguments go to pytest)
#   PYTHON=/path/to/python3.9 bash scripts/check_oldest.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-oldest"
TORCH="2.4.1"

python_39() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    if command -v python3.9 >/dev/null 2>&1 && python3.9 --version >/dev/null 2>&1; then command -v python3.9; return; fi
    local found
    found="$(ls -d "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/3.9.*/bin/python 2>/dev/null | tail -1 || true)"
    if [[ -n "$found" ]]; then echo "$found"; return; fi
    echo "check_oldest.sh: no Python 3.9 found (set PYTHON=/path/to/python3.9)" >&2
    exit 2
}

if [[ ! -x "$VENV/bin/python" ]]; then
    "$(python_39)" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH')" 2>/dev/null; then
    echo "check_oldest.sh: installing torch $TORCH and the test dependencies into $VENV (several GB, once)"
    "$VENV/bin/python" -m pip install -q "torch==$TORCH" "numpy<2" pytest psutil scikit-learn matplotlib pillow \
        mlxtend pyyaml cloudpickle packaging
fi
"$VENV/bin/python" -c "import sys, torch; print('check_oldest.sh: Python', sys.version.split()[0], 'torch', torch.__version__)"
cd "$ROOT"
if [[ $# -eq 0 ]]; then set -- -m "not multiprocess"; fi
PATH="$VENV/bin:$PATH" PYTHONPATH="$ROOT:$ROOT/scripts/oldest" exec "$VENV/bin/python" -m pytest -p no:cacheprovider -q tests "$@"
