"""README.md and docs/: every relative link resolves, and the README stays a user's README.

A relative Markdown link (``[text](path)``, ``![alt](path)``, optionally ``path#anchor`` or ``#anchor``)
in README.md or any docs/**/*.md must name an existing file; an anchor into a Markdown file must match
one of its headings, slugged as GitHub slugs them. Links inside fenced code blocks and inline code
are not links. A source path named in inline code (```spdkfac/update_fusion.py```, ```tests/...```,
```scripts/...```, ```benchmarks/....py```) must exist too, so that moving a module shows which pages
name it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) or ![alt](target); the text may hold one level of brackets, the target no spaces.
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A repository path in inline code: the package, the tests, the scripts, or a benchmark's source.
_SOURCE_PATH = re.compile(r"(?<![\w./-])((?:spdkfac|tests|scripts)/[\w./-]*|benchmarks/[\w./-]*\.(?:py|sh))")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: formatting dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors: set[str] = set()
    for _, line in _prose_lines(path.read_text(encoding="utf-8")):
        m = _HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _links(path: Path) -> list[tuple[int, str]]:
    links = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for m in _LINK.finditer(_INLINE_CODE.sub("", line)):
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            links.append((number, target))
    return links


def _source_paths(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in _prose_lines(path.read_text(encoding="utf-8")):
        for span in _INLINE_CODE.findall(line):
            found += [(number, m.group(1).rstrip(".")) for m in _SOURCE_PATH.finditer(span)]
    return found


def _broken(path: Path) -> list[str]:
    problems = []
    for number, target in _links(path):
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(ROOT)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            problems.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
    for number, source in _source_paths(path):
        if not (ROOT / source).exists():
            problems.append(f"{path.relative_to(ROOT)}:{number}: `{source}` (no such file in the repository)")
    return problems


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    problems = _broken(path)
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_every_docs_page_is_in_the_index() -> None:
    index = DOCS / "README.md"
    linked = {(index.parent / target.partition("#")[0]).resolve() for _, target in _links(index) if target.partition("#")[0]}
    missing = [str(p.relative_to(ROOT)) for p in DOCS.rglob("*.md") if p != index and p.resolve() not in linked]
    assert not missing, f"docs pages missing from docs/README.md: {missing}"


def test_readme_is_short_and_names_the_ci_test_command() -> None:
    text = README.read_text(encoding="utf-8")
    lines = len(text.splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the user's README keeps to {MAX_README_LINES} (details go to docs/)"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    commands = [line.strip() for line in ci.splitlines() if "scripts/test.sh" in line and not line.lstrip().startswith("#")]
    assert commands, ".ci/run no longer runs scripts/test.sh: update this test"
    for command in commands:
        assert command in text, f"README.md must name the test command .ci/run runs: {command!r}"
    assert "bash scripts/run_digits.sh" in text, "README.md must name the main job's command"


def test_slugs_follow_github() -> None:
    assert _slug("Time to accuracy: mnist5k_b256_screen_wd0.5") == "time-to-accuracy-mnist5k_b256_screen_wd05"
    assert _slug("The update after preconditioning: SGD, AdamW, LAMB") == "the-update-after-preconditioning-sgd-adamw-lamb"
    assert _slug("DHO2 (hybrid order, `dho2/`)") == "dho2-hybrid-order-dho2"


def test_source_paths_are_the_repository_paths_in_inline_code() -> None:
    found = [m.group(1) for m in _SOURCE_PATH.finditer("spdkfac/update_fusion.py; tests/test_x.py, benchmarks/run.sh")]
    assert found == ["spdkfac/update_fusion.py", "tests/test_x.py", "benchmarks/run.sh"]
    assert not _SOURCE_PATH.search("benchmarks/results/x.json")  # an output, not a source
    assert not _SOURCE_PATH.search("python -m spdkfac.train")  # a module, not a path
