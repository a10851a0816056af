"""Generate benchmarks/RESULTS.md from the result JSON files the benchmarks write.

    python scripts/results_md.py [--results benchmarks/results] [--out benchmarks/RESULTS.md]

One table per claim, each with the command that produced it (as recorded in
the JSON, or rebuilt from the arguments the JSON records, or else the
benchmark's documented command) and the machine it ran on (from the JSON's
``machine`` record, or "not recorded"). Result files that are absent are
skipped with a note; a file that is not valid JSON, or lacks what its
benchmark always writes, stops the script with an error naming the file.
The output depends only on the input files, so regenerating it after an
unchanged set of results gives the same bytes.

Each benchmark's section is rendered by its module in benchmarks/report/ (see docs/benchmarks.md, "Adding a
benchmark's section"); this file is the command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks.report of this checkout

from benchmarks.report import build  # noqa: E402
from benchmarks.report.common import ResultsError  # noqa: E402

__all__ = ["ResultsError", "build", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--results", default="benchmarks/results", help="folder holding the result JSON files")
    ap.add_argument("--out", default="benchmarks/RESULTS.md", help="Markdown file to write")
    args = ap.parse_args(argv)
    out = Path(args.out)
    try:
        text = build(Path(args.results), out, args.results.rstrip("/"))
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
