"""What every section of RESULTS.md uses: reading a result file, formatting numbers, the command and machine
lines, Markdown tables, the :class:`Writer` that collects the sections, and the registry of sections.

A benchmark's report module (``benchmarks/report/<name>.py``) registers its renderer with :func:`renders`
(or a :class:`Section` of its own with :func:`register`); :func:`benchmarks.report.build` writes every
registered section in ``order``.
"""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

#: A section's renderer: the result file and its JSON object -> the section's Markdown lines (below its title).
Render = Callable[[Path, dict[str, Any]], list[str]]

#: Table labels of the variants (iteration time, update fusion, the simulator check).
LABELS = {
    "sgd": "SGD",
    "dkfac": "D-KFAC",
    "mpdkfac": "MPD-KFAC",
    "spdkfac": "**SPD-KFAC**",
    "-pipe-lbp": "−Pipe−LBP",
    "+pipe-lbp": "+Pipe−LBP",
    "-pipe+lbp": "−Pipe+LBP",
    "+pipe+lbp": "+Pipe+LBP",
    "spdkfac-dp": "SPD-KFAC + dist. precond.",
}
#: Recorded arguments that are derived by the benchmark, not given on its command line.
DERIVED_ARGS = {"grids"}


class ResultsError(Exception):
    """A result file that cannot be read or lacks what its benchmark writes (the message names the file)."""


def load(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``; :class:`ResultsError` naming the file when it is malformed."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise ResultsError(f"{path}: cannot be read ({exc})") from None
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected a JSON object, found {type(data).__name__}")
    return data


def need(data: dict[str, Any], path: Path, *keys: str) -> None:
    """Raise :class:`ResultsError` naming ``path`` unless ``data`` has every key in ``keys``."""
    missing = [k for k in keys if k not in data]
    if missing:
        raise ResultsError(f"{path}: missing {', '.join(repr(k) for k in missing)} (not a file this benchmark writes?)")


def ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds ('–' when not recorded)."""
    return "–" if seconds is None else f"{seconds * 1e3:.0f}"


def ratio(value: float | None, lo: float | None = None, hi: float | None = None) -> str:
    """A ratio as ``1.23x``, with its 95% interval when recorded."""
    if value is None:
        return ""
    text = f"{value:.2f}x"
    return f"{text} ({lo:.2f}–{hi:.2f})" if lo is not None and hi is not None else text


def machine_line(data: dict[str, Any]) -> str:
    """What the numbers were measured on, from the JSON's ``machine`` record."""
    m = data.get("machine")
    if not isinstance(m, dict):
        return "not recorded"
    bits = [str(m.get("cpu", "?")), f"{m.get('cores', '?')} cores"]
    bits.append(f"GPU {m['cuda']}" if m.get("cuda") else "no GPU")
    bits.append(f"torch {m.get('torch', '?')}, {m.get('torch_threads', '?')} thread(s) per worker")
    bits.append(f"Python {m.get('python', '?')}")
    workers = data.get("world_size", data.get("workers"))
    if workers is not None:
        bits.append(f"{workers} worker(s) via {data.get('engine', '?')}")
    if m.get("horovod_cycle_time_ms"):
        bits.append(f"HOROVOD_CYCLE_TIME={m['horovod_cycle_time_ms']}")
    if m.get("bound_cores"):
        bits.append("workers bound to cores")
    return "; ".join(bits)


def launcher(data: dict[str, Any], module: str) -> str:
    """The launch prefix for ``python -m module`` under the engine and worker count the JSON records."""
    engine, n = data.get("engine"), data.get("world_size", data.get("workers"))
    if engine == "horovod" and n:
        return f"horovodrun -np {n} -H localhost:{n} --gloo .venv/bin/python -m {module}"
    if engine == "torch" and n:
        return f"torchrun --nproc_per_node {n} -m {module}"
    return f".venv/bin/python -m {module}"


def rebuilt_command(data: dict[str, Any], module: str, out: str | None = None) -> str:
    """The benchmark's command line rebuilt from the ``args`` the JSON records (``--out`` replaced by ``out``)."""
    words = [launcher(data, module)]
    for key, value in data["args"].items():
        if key in DERIVED_ARGS or key == "out" or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            words.append(flag)
        elif isinstance(value, list):
            words.append(" ".join([flag, *map(str, value)]))
        else:
            words.append(f"{flag} {value}")
    if out is not None:
        words.append(f"--out {out}")
    return " ".join(words)


def recorded_command(data: dict[str, Any], module: str) -> str:
    """The JSON's ``command``; an ``ENGINE xN: python -m ...`` record is written with its launcher."""
    cmd: str = data["command"]
    match = re.fullmatch(rf"(\w+) x(\d+): python -m {re.escape(module)}(.*)", cmd)
    if match:
        engine, n, rest = match.groups()
        return launcher({"engine": engine, "world_size": int(n)}, module) + rest
    return cmd


def command_block(data: dict[str, Any], module: str, documented: str, out: str | None = None) -> list[str]:
    """Markdown lines giving the command and the machine of one result."""
    if isinstance(data.get("command"), str):
        how, cmd = "as recorded", recorded_command(data, module)
    elif isinstance(data.get("args"), dict):
        how, cmd = "rebuilt from the arguments recorded in the JSON", rebuilt_command(data, module, out)
    else:
        how, cmd = "not recorded; the benchmark's documented command", documented
    return [f"Command ({how}):", "", "```bash", cmd, "```", "", f"Machine: {machine_line(data)}.", ""]


def table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return [*lines, ""]


def labelled_rows(labels: Mapping[str, str], data: Mapping[str, Any], cells: Callable[[str, Any], list[str]]) -> list[list[str]]:
    """A table's rows, one per key of ``labels`` that ``data`` records (not None), in ``labels``' order: the key's
    label, then ``cells(key, data[key])``."""
    return [[label, *cells(key, data[key])] for key, label in labels.items() if data.get(key) is not None]


class Args(dict[str, Any]):
    """A benchmark's recorded arguments: an argument it did not record reads as '?' (older files lack newer ones)."""

    def __missing__(self, key: str) -> str:
        return "?"


def recorded_args(data: dict[str, Any], path: Path, *keys: str) -> Args:
    """The JSON's ``args``, after :func:`need` found ``keys`` and ``args`` in it."""
    need(data, path, *keys, "args")
    return Args(data["args"])


def model_at(a: Mapping[str, Any]) -> str:
    """``<model> at <resolution>×<resolution>`` from the recorded arguments ('?' for one not recorded)."""
    resolution = a.get("resolution", "?")
    return f"{a.get('model', '?')} at {resolution}×{resolution}"


class Writer:
    """Collects the sections; knows where the results and the output file lie, for paths and links."""

    def __init__(self, results: Path, out: Path, label: str, claimed: frozenset[str] = frozenset()) -> None:
        self.results, self.out, self.label = results, out, label
        self.claimed = claimed  # results-relative paths that a section names exactly
        self.lines: list[str] = []
        self.skipped: list[str] = []

    def shown(self, rel: str) -> str:
        """A results-relative path as the reader should type it."""
        return f"{self.label}/{rel}"

    def link(self, rel: str, text: str) -> list[str]:
        """Markdown lines showing a plot next to the results (none when the file does not exist)."""
        target = self.results / rel
        if not target.is_file():
            return []
        href = Path(os.path.relpath(target, self.out.parent)).as_posix()
        return [f"![{text}]({href})", ""]

    def section(self, rel: str, title: str, render: Render, plot: str | None = None) -> None:
        """One claim's section from ``results/rel`` (and its plot), or a note that the file is absent."""
        path = self.results / rel
        self.lines += [f"## {title}", ""]
        if not path.is_file():
            self.skipped.append(rel)
            self.lines += [f"_No `{self.shown(rel)}`: section skipped._", ""]
            return
        self.lines += render(path, load(path))
        if plot is not None:
            self.lines += self.link(plot, title)

    def claims(self, rel: str) -> bool:
        """Whether a section registered for exactly ``rel`` renders it (so a glob's section leaves it out)."""
        return rel in self.claimed


@dataclass(frozen=True)
class Section:
    """A part of RESULTS.md: the result files it renders (``pattern``, relative to the results folder) and its
    place (sections are written by ascending ``order``, then ``pattern``). :meth:`write` appends it to the writer."""

    order: int
    pattern: str

    def write(self, w: Writer) -> None:
        """Append this section (or its note that the files are absent) to ``w``."""
        raise NotImplementedError


@dataclass(frozen=True)
class FileSection(Section):
    """One section per result file: ``pattern`` is a file name or a glob (one section per file it matches, sorted;
    files that another section names exactly are left to it). ``title`` and ``plot`` (a PNG shown under the
    tables when it exists) are fixed, or made from the file's results-relative path. An absent file gets a
    "section skipped" note unless ``optional``; a glob that matches nothing writes nothing."""

    title: str | Callable[[Path], str]
    render: Render
    plot: str | Callable[[Path], str | None] | None = None
    optional: bool = False

    def write(self, w: Writer) -> None:
        if is_glob(self.pattern):
            rels = [p.relative_to(w.results).as_posix() for p in sorted(w.results.glob(self.pattern))]
            rels = [rel for rel in rels if not w.claims(rel)]
        elif self.optional and not (w.results / self.pattern).is_file():
            rels = []
        else:
            rels = [self.pattern]
        for rel in rels:
            title = self.title(Path(rel)) if callable(self.title) else self.title
            plot = self.plot(Path(rel)) if callable(self.plot) else self.plot
            w.section(rel, title, self.render, plot)


#: Every registered section by pattern; filled as the report modules are imported.
SECTIONS: dict[str, Section] = {}


def register(section: Section) -> Section:
    """Add ``section`` to the report (one section per pattern)."""
    if section.pattern in SECTIONS:
        raise ValueError(f"two report sections for {section.pattern!r}")
    SECTIONS[section.pattern] = section
    return section


def renders(
    pattern: str,
    title: str | Callable[[Path], str],
    *,
    order: int,
    plot: str | Callable[[Path], str | None] | None = None,
    optional: bool = False,
) -> Callable[[Render], Render]:
    """Decorator: register the decorated function as the renderer of ``pattern`` (see :class:`FileSection`)."""

    def add(render: Render) -> Render:
        register(FileSection(order, pattern, title, render, plot, optional))
        return render

    return add


def is_glob(pattern: str) -> bool:
    """Whether ``pattern`` names files by a glob rather than exactly."""
    return glob.has_magic(pattern)
