"""The package keeps to the oldest Python and torch it declares (pyproject.toml), where ruff's py39 target cannot see.

ruff checks the syntax for Python 3.9, but not what runs: a type union
``A | B`` evaluated at import (``import spdkfac`` failed on 3.9 with
"unsupported operand type(s) for |"), ``zip(strict=)`` or a dataclass's
``slots=``. The one-off run on the oldest versions is
``scripts/check_oldest.sh``; these tests keep what it found from coming back.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest
import torch

import spdkfac

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "spdkfac"

#: Calls whose keyword arguments are newer than Python 3.9: (callee, keyword) -> the version that added it.
NEWER_KEYWORDS = {("zip", "strict"): "3.10", ("dataclass", "slots"): "3.10", ("dataclass", "kw_only"): "3.10"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _annotations(tree: ast.AST) -> set[int]:
    """The ids of every node inside an annotation (never evaluated under ``from __future__ import annotations``)."""
    roots: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign):
            roots.append(node.annotation)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            roots += [
                a.annotation for a in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg] if a and a.annotation
            ]
            if node.returns is not None:
                roots.append(node.returns)
    return {id(sub) for root in roots for sub in ast.walk(root)}


def _resolve(node: ast.expr, namespace: dict[str, object]) -> object:
    """The value of a name or a dotted name in the module's namespace; a sentinel where it is anything else."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        return namespace.get(node.id, _resolve)
    if isinstance(node, ast.Attribute):
        base = _resolve(node.value, namespace)
        return _resolve if base is _resolve else getattr(base, node.attr, _resolve)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _resolve(node.left, namespace)
    return _resolve


def _is_type(value: object) -> bool:
    return value is None or isinstance(value, type)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_type_union_is_evaluated(path):
    """``A | B`` of classes outside annotations runs at import (or call) time: Python 3.10's, a TypeError on 3.9."""
    tree = ast.parse(path.read_text())
    # (a __main__ is a command line: not run here; its unions of None still show)
    namespace = {} if path.name == "__main__.py" else vars(importlib.import_module(_module_name(path)))
    skip = _annotations(tree)
    found = [
        f"line {node.lineno}: {ast.unparse(node)}"
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp)
        and isinstance(node.op, ast.BitOr)
        and id(node) not in skip
        and (_is_type(_resolve(node.left, namespace)) or _is_type(_resolve(node.right, namespace)))
    ]
    assert not found, f"type unions evaluated at run time (use typing.Union / a tuple for isinstance): {found}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(ROOT)))
def test_annotations_are_not_evaluated_and_no_newer_keywords(path):
    """A module with annotations defers them (``X | None`` in a signature is evaluated at ``def`` time otherwise),
    and no call uses a keyword newer than 3.9."""
    text = path.read_text()
    tree = ast.parse(text)
    if _annotations(tree):
        assert "from __future__ import annotations" in text, "annotations are evaluated on Python 3.9: add the __future__ import"
    newer = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            newer += [
                f"line {node.lineno}: {callee}({kw.arg}=) needs {NEWER_KEYWORDS[callee, kw.arg]}"
                for kw in node.keywords
                if (callee, kw.arg) in NEWER_KEYWORDS
            ]
    assert not newer, newer


def test_the_declared_minimums_agree():
    """pyproject.toml, the README and the import check name the same oldest Python and torch, and this torch passes."""
    pyproject = (ROOT / "pyproject.toml").read_text()  # (tomllib is Python 3.11's)
    assert 'requires-python = ">=3.9"' in pyproject
    minimum = ".".join(map(str, spdkfac.MIN_TORCH))
    assert re.findall(r'"torch>=([0-9.]+)"', pyproject) == [minimum]
    assert f"Python ≥ 3.9 and torch ≥ {minimum}" in (ROOT / "README.md").read_text()
    assert spdkfac.torch_is_supported(torch.__version__)


@pytest.mark.parametrize(
    ("version", "supported"),
    [
        ("2.13.0+cpu", True),
        ("2.4.1+cu121", True),
        ("2.4.0", True),
        ("2.10.0a0+git1234", True),
        ("3.0.0", True),
        ("2.3.1", False),
        ("2.1.2+cu121", False),
        ("1.13.1", False),
    ],
)
def test_the_torch_version_check(version, supported):
    assert spdkfac.torch_is_supported(version) is supported
