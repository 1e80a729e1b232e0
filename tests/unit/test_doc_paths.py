"""Every repository path the documentation names exists.

A file moves (the tests went to `tests/unit/<area>/`, the internals to `src/jaxnitro/_src/`)
and the prose that points at it goes stale without a failing test; this is that test. It reads
the pages a reader follows (the docs site, the front pages, the contributing guide) and the
config that names paths in comments, picks out every path rooted at a top-level folder of the
checkout, and checks it is there (a glob: that it matches something).
"""

from __future__ import annotations

import re
from pathlib import Path

from helpers.paths import ROOT

# The top-level folders a path in prose starts with.
FOLDERS = ("src", "tests", "docs", "examples", "benchmarks", "tools", "deploy")
# A path: one of FOLDERS, then `/` and path characters; not the tail of a longer path
# (`runs/docs/x`) or of a URL. `<area>`-style placeholders stop the match before them.
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(FOLDERS)})/[\w./*-]*)")

# Paths that are named but are not files of the checkout, each with why. Keep it small:
# a moved file is fixed where it is named, not listed here.
ALLOWED: dict[str, str] = {}


def documents() -> list[Path]:
    """The files whose paths are checked."""
    return sorted(
        [
            *(ROOT / "docs").rglob("*.md"),
            ROOT / "README.md",
            ROOT / "CONTRIBUTING.md",
            ROOT / "tests" / "README.md",
            ROOT / "benchmarks" / "README.md",
            ROOT / "benchmarks" / "RESULTS.md",
            ROOT / "mkdocs.yml",
            ROOT / "pyproject.toml",
        ]
    )


def named_paths(text: str) -> list[tuple[int, str]]:
    """`(line, path)` for each repository path in `text`; a trailing full stop is prose."""
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        for m in PATH.finditer(line):
            out.append((number, m.group(1).rstrip(".")))
    return out


def exists(path: str) -> bool:
    if any(c in path for c in "*?["):
        return next(ROOT.glob(path), None) is not None
    return (ROOT / path).exists()


def test_the_pattern_finds_paths_and_skips_the_rest():
    text = "see `tests/unit/run/test_options.py`. Or runs/docs/x, https://x.org/docs/y, src/\n"
    assert named_paths(text) == [(1, "tests/unit/run/test_options.py"), (1, "src/")]
    assert named_paths("tests/unit/<area>/") == [(1, "tests/unit/")]
    assert exists("tests/unit/*/test_serve_limits.py") and not exists("tests/nothing/*.py")


def test_every_documented_repository_path_exists():
    missing = [
        f"{doc.relative_to(ROOT)}:{line}: {path}"
        for doc in documents()
        for line, path in named_paths(doc.read_text())
        if path not in ALLOWED and not exists(path)
    ]
    assert not missing, (
        "these files name repository paths that do not exist (moved or renamed?); "
        f"point them at the file's new place: {missing}"
    )


def test_the_allow_list_is_still_needed():
    named = {path for doc in documents() for _, path in named_paths(doc.read_text())}
    stale = sorted(p for p in ALLOWED if p not in named or exists(p))
    assert not stale, f"remove from ALLOWED (no longer named, or now exists): {stale}"
