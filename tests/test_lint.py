"""The code base passes the linter configured in pyproject.toml."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_clean():
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff not installed (scripts/setup.sh installs it)")
    proc = subprocess.run([ruff, "check", "spdkfac", "tests", "benchmarks", "scripts"], cwd=ROOT, check=False, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
