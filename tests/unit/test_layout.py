"""The layout of tests/: unit tests by area (a subpackage of jaxnitro), end-to-end runs apart.

A test file at tests/ top level fails here with the folder `tools/place_tests.py` gives it;
`python tools/place_tests.py --apply` moves it there.
"""

from __future__ import annotations

import collections
import importlib.util

import pytest
from helpers.paths import ROOT, TESTS

_spec = importlib.util.spec_from_file_location("place_tests", ROOT / "tools" / "place_tests.py")
assert _spec is not None and _spec.loader is not None
place_tests = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(place_tests)

PACKAGE = ROOT / "src" / "jaxnitro" / "_src"


def test_no_test_file_sits_at_the_top_of_tests():
    stray = [f"tests/{p.name} -> tests/{folder}/" for p, folder in place_tests.misplaced()]
    assert not stray, (
        "test files belong in tests/unit/<area>/ or tests/e2e/, not at tests/ top level: "
        f"{stray}. Move them with: python tools/place_tests.py --apply"
    )


def test_the_unit_folders_are_the_packages_subpackages():
    subpackages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert set(place_tests.AREAS) == subpackages
    folders = {p.name for p in (TESTS / "unit").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert folders <= subpackages, f"not a subpackage of jaxnitro: {sorted(folders - subpackages)}"
    assert {p.name for p in TESTS.iterdir() if p.is_dir()} - {"__pycache__"} == {
        "unit",
        "e2e",
        "helpers",
        "fixtures",  # data files tests read (the Kubernetes schemas of issue 44)
    }


def test_each_known_file_is_where_the_mapping_says():
    wrong = []
    for path in TESTS.rglob("*.py"):
        folder = place_tests.PLACES.get(path.name)
        if folder is not None and path.parent != TESTS / folder:
            wrong.append(f"{path.relative_to(TESTS)} (PLACES says {folder}/)")
    assert not wrong, wrong


def test_test_file_names_are_unique():
    # tests/ has no __init__.py files: pytest imports each test file by its bare name
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []


@pytest.mark.parametrize(
    ("name", "text", "folder"),
    [
        ("test_errors.py", "", "unit/core"),  # a known file: the mapping decides
        (
            "test_new_thing.py",
            "from jaxnitro._src.serve.batcher import x\nimport jaxnitro._src.serve\n",
            "unit/serve",
        ),
        ("test_checkpoint_tls.py", "import jaxnitro as jn\n", "unit/checkpoint"),
        ("test_ranks.py", 'run(["jaxnitro", "launch", "-n", "2"])  # "launch"\n', "e2e"),
        ("test_anything.py", "import jaxnitro as jn\n", "unit/train"),
    ],
)
def test_a_new_file_at_the_top_is_named_with_its_area(tmp_path, name, text, folder):
    (tmp_path / name).write_text(text)
    (tmp_path / "conftest.py").write_text("")
    assert place_tests.misplaced(tmp_path) == [(tmp_path / name, folder)]
