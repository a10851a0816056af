#!/usr/bin/env bash
# Install everything the tests need (scripts/setup.sh), then run the whole test suite,
# including the real multi-process runs under horovodrun and torchrun (gloo, CPU).
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh"
export PATH="$ROOT/.venv/bin:$PATH"
export SPDKFAC_REQUIRE_HOROVOD=1   # a missing Horovod fails the suite instead of skipping
export SPDKFAC_RUN_SLOW=1          # the whole suite: tests marked slow too (tests/conftest.py)
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest -q -p no:cacheprovider tests "$@"
