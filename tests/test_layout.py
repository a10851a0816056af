"""The package layout is the design: every module in docs/design.md's table, imports that run one way, none hidden.

Read from the source (no imports), so it runs in milliseconds.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spdkfac"
DESIGN = ROOT / "docs" / "design.md"

#: The top level keeps the public API only; everything else lives in a folder with one job.
TOP_LEVEL = {"__init__.py", "config.py", "optimizer.py", "options.py", "preconditioner.py", "schedules.py", "variants.py"}

#: Imports a function may make: optional dependencies, loaded only where used.
OPTIONAL = ("horovod", "torch.distributed", "torch._C._distributed_c10d", "torch.utils.dlpack", "cupy", "cupyx", "mpi4py")
OPTIONAL += ("matplotlib", "PIL", "sklearn", "mlxtend", "torchvision", "spdkfac.comm.horovod_backend", "spdkfac.comm.torch_backend")
OPTIONAL += ("transformers",)

#: folder -> the parts of spdkfac it must not import (the arrows of the design run the other way).
FORBIDDEN = {
    "kfac": {"step", "plan", "update", "optimizer", "config", "variants", "simulate", "train", "runtime", "dho2"},
    "plan": {"step", "update", "optimizer", "variants", "simulate", "train", "runtime", "dho2"},
    "step": {"update", "optimizer", "variants", "simulate", "train", "runtime", "dho2"},
    "update": {"optimizer", "variants", "simulate", "train", "runtime", "dho2"},
    "comm": {"kfac", "step", "plan", "update", "optimizer", "config", "variants", "simulate", "train", "dho2", "perfmodels"},
}
#: The performance-model library is a leaf: it imports nothing else of spdkfac (its benchmark and CLI measure through it).
PERFMODELS_LIBRARY = {"__init__.py", "models.py", "fitting.py", "file_version.py", "plot.py"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _imports(path: Path) -> tuple[tuple[str, bool], ...]:
    """(absolute module, inside a function) of every import of ``path``; ``from X import y`` gives both X and X.y.

    Cached: several tests read every module's imports."""
    tree = ast.parse(path.read_text())
    package = _name(path) if path.name == "__init__.py" else _name(path).rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                out.extend((alias.name, inside) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[: len(parts) - (child.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                out.append((base, inside))
                out.extend((f"{base}.{alias.name}", inside) for alias in child.names)
            visit(child, inside)

    visit(tree, False)
    return tuple(out)


def _part(module: str) -> str:
    """``spdkfac.kfac.layers`` -> ``kfac``; ``spdkfac.optimizer`` -> ``optimizer``."""
    return module.split(".")[1] if module.count(".") else ""


def test_the_top_level_keeps_only_the_public_api():
    assert {p.name for p in PACKAGE.glob("*.py")} == TOP_LEVEL


def test_every_module_is_in_the_design_table_and_every_row_is_a_module():
    rows = set(re.findall(r"^\| `([\w/]+\.py)` \|", DESIGN.read_text(), flags=re.M))
    modules = {p.relative_to(PACKAGE).as_posix() for p in _modules()}
    assert not modules - rows, f"modules missing from docs/design.md's table (Code layout): {sorted(modules - rows)}"
    assert not rows - modules, f"docs/design.md's table names modules that do not exist: {sorted(rows - modules)}"


def test_every_module_states_its_job_in_its_docstring():
    assert not [p for p in _modules() if not ast.get_docstring(ast.parse(p.read_text()))]


def test_no_import_inside_a_function_except_optional_dependencies():
    hidden = [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _modules()
        for module, inside in _imports(path)
        if inside and module.startswith("spdkfac") and not module.startswith(OPTIONAL)
    ]
    hidden += [
        f"{path.relative_to(ROOT)}: {module}"
        for path in _modules()
        for module, inside in _imports(path)
        if inside and not module.startswith(("spdkfac", *OPTIONAL))
    ]
    assert not hidden, "imports inside functions (place the code where it belongs instead):\n" + "\n".join(sorted(set(hidden)))


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_the_imports_run_one_way(folder):
    wrong = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((PACKAGE / folder).rglob("*.py"))
        for module, _ in _imports(path)
        if module.startswith("spdkfac.") and _part(module) in FORBIDDEN[folder]
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_the_performance_model_library_imports_nothing_else_of_spdkfac():
    wrong = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in sorted((PACKAGE / "perfmodels").glob("*.py"))
        if path.name in PERFMODELS_LIBRARY
        for module, _ in _imports(path)
        if module.startswith("spdkfac") and _part(module) != "perfmodels"
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_only_the_training_application_imports_it():
    wrong = {
        f"{path.relative_to(ROOT)} imports {module}"
        for path in _modules()
        if _part(_name(path)) != "train"
        for module, _ in _imports(path)
        if _part(module) == "train" and module.startswith("spdkfac.train")
    }
    assert not wrong, "\n".join(sorted(wrong))


def test_the_tests_mirror_the_folders():
    """Unit tests in ``tests/unit/<folder>/`` (one level down: ``tests/`` is on ``sys.path``, and a ``tests/kfac/``
    would pass for KAISA's ``kfac`` module), real-launcher runs in ``tests/multiprocess/``, whole jobs in ``tests/jobs/``."""
    tests = ROOT / "tests"
    assert {p.name for p in tests.iterdir() if p.is_dir() and p.name != "__pycache__"} == {"unit", "multiprocess", "jobs", "workers"}
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} | {"scripts"}
    assert {p.name for p in (tests / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"} <= folders
