"""The code base passes the linter, the formatter check and the type checker configured in pyproject.toml.

scripts/setup.sh installs ruff and mypy; a missing tool skips its test, except under
SPDKFAC_REQUIRE_HOROVOD=1 (CI, where the environment is complete), where it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATHS = ["spdkfac", "tests", "benchmarks", "scripts", "examples"]


def _tool(name: str) -> str:
    exe = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if exe is None:
        if os.environ.get("SPDKFAC_REQUIRE_HOROVOD") == "1":
            pytest.fail(f"{name} is not installed (scripts/setup.sh installs it)")
        pytest.skip(f"{name} not installed (scripts/setup.sh installs it)")
    return exe


def _run(cmd: list[str], timeout: float = 600) -> None:
    proc = subprocess.run(cmd, cwd=ROOT, check=False, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{Path(cmd[0]).name} {' '.join(cmd[1:])} failed:\n{proc.stdout}{proc.stderr}"


def test_ruff_clean():
    _run([_tool("ruff"), "check", *PATHS])


def test_ruff_formatted():
    # Lists the files `ruff format` would change; `ruff format --diff` shows how.
    _run([_tool("ruff"), "format", "--check", *PATHS])


@pytest.mark.slow
def test_mypy_clean():
    # The files and the strictness come from [tool.mypy] in pyproject.toml.
    _run([_tool("mypy")])
