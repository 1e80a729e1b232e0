"""The documentation site stays complete: every public name in the API reference, every page in
the nav, the README a front page whose links land, and `mkdocs build --strict` clean."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import paths

import jaxnitro as jn

ROOT = paths.ROOT
DOCS = ROOT / "docs"
API = DOCS / "api"
# Not pages: the Griffe extension the API reference loads (mkdocs.yml's exclude_docs).
NOT_PAGES = ("hooks/",)
# A `::: identifier` line of mkdocstrings, as written on the API pages.
ENTRY = re.compile(r"^:::\s*(\S+)\s*$", re.MULTILINE)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def nav_pages(node: object) -> list[str]:
    """Every page path the nav of mkdocs.yml names, in order."""
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, dict):
        return [p for value in node.values() for p in nav_pages(value)]
    if isinstance(node, list):
        return [p for item in node for p in nav_pages(item)]
    return []


def mkdocs_config() -> dict:
    yaml = pytest.importorskip("yaml")
    return yaml.safe_load((ROOT / "mkdocs.yml").read_text())


def api_entries() -> dict[str, str]:
    """identifier -> the API page that documents it."""
    found = {}
    for page in sorted(API.glob("*.md")):
        for identifier in ENTRY.findall(page.read_text()):
            found[identifier] = page.relative_to(ROOT).as_posix()
    return found


def resolve(identifier: str) -> object:
    """The object an API entry documents (a module, or a name in one)."""
    try:
        return importlib.import_module(identifier)
    except ImportError:
        module, _, name = identifier.rpartition(".")
        return getattr(importlib.import_module(module), name)


# jn.train, jn.compile and jn.experiment share their names with subpackages (jaxnitro/_src/train/
# ...), which `::: jaxnitro.train` would document instead: their entries name the definition.
def documented(name: str, entries: dict[str, str]) -> bool:
    public = getattr(jn, name)
    return any(
        identifier == f"jaxnitro.{name}"
        or (identifier.endswith(f".{name}") and resolve(identifier) is public)
        for identifier in entries
    )


def test_every_public_name_is_in_the_api_reference():
    entries = api_entries()
    pages = ", ".join(sorted({p.relative_to(ROOT).as_posix() for p in API.glob("*.md")}))
    missing = [name for name in jn.__all__ if not documented(name, entries)]
    assert not missing, (
        f"public names with no entry in the API reference: {missing}. Add a line "
        f"'::: jaxnitro.<name>' for each to the page of docs/api/ where it belongs ({pages}), "
        "and its name to the table in docs/api/index.md."
    )


def test_the_api_reference_documents_only_public_names():
    """A renamed or removed name leaves no stale entry, and no entry documents a subpackage
    where the jn. name of the same spelling is meant."""
    public = {id(getattr(jn, name)) for name in jn.__all__}
    stale = [identifier for identifier in api_entries() if id(resolve(identifier)) not in public]
    assert not stale, (
        f"API entries that are not jn.__all__ names: {stale}. Document a public name as "
        "'::: jaxnitro.<name>', or by the module that defines it where a subpackage has the "
        "same name ('::: jaxnitro._src.train.driver.train'), or remove the line."
    )


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    nav = nav_pages(mkdocs_config()["nav"])
    pages = sorted(
        p.relative_to(DOCS).as_posix()
        for p in DOCS.rglob("*.md")
        if not p.relative_to(DOCS).as_posix().startswith(NOT_PAGES)
    )
    unlisted = [p for p in pages if p not in nav]
    assert not unlisted, (
        f"pages under docs/ missing from the nav of mkdocs.yml: {unlisted}. Add each where a "
        "reader looks for it, e.g. '  - Background runs and MCP: drive.md' under the section "
        "it belongs to; a page outside the nav has no way in."
    )
    absent = [p for p in nav if not (DOCS / p).is_file()]
    assert not absent, f"the nav of mkdocs.yml names pages that do not exist: {absent}"
    assert len(nav) == len(set(nav)), f"pages listed twice in the nav: {nav}"


def anchors(page: Path) -> set[str]:
    """The heading anchors of a Markdown page, slugged as GitHub and MkDocs' toc do."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    slugs = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.MULTILINE):
        words = re.sub(r"[^\w\s-]", "", heading.replace("`", "").lower())
        slugs.add(re.sub(r"\s+", "-", words.strip()))
    return slugs


def test_the_readme_is_a_front_page_whose_links_land():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200, "README.md is the front page: move detail into docs/"
    assert "make demo    #" in readme and "make test    #" in readme  # the two commands, on top
    assert readme.index("make demo") < readme.index("## Quick start")
    broken = []
    for target in LINK.findall(readme):
        if target.startswith(("http://", "https://", "#")):
            continue
        path, _, anchor = target.partition("#")
        file = ROOT / path
        if not file.exists():
            broken.append(target)
        elif anchor and anchor not in anchors(file):
            broken.append(target)
    assert not broken, f"README.md links to files or headings that do not exist: {broken}"


@pytest.mark.slow
def test_mkdocs_build_strict_passes(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings_handlers.python"):
        pytest.importorskip(module)  # the docs extra (in dev): CI fails on this skip
    site = tmp_path / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner, not a warning
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-4000:]}"
    # A newcomer's view: the search index holds the pages, the nav links them, code renders.
    assert "Getting started" in (site / "index.html").read_text()
    index = (site / "search" / "search_index.json").read_text()
    assert "HostFieldError" in index and "TopKCheckpointer" in index
    api = (site / "api" / "training" / "index.html").read_text()
    assert 'id="jaxnitro.Nitro"' in api and 'class="highlight"' in api
