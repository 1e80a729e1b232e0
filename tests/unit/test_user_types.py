"""What a user's type checker sees: mypy --strict and pyright over the single-file examples and
the README's quick start are clean, and a misspelled `jn.Nitro` option is an error to both.

The package ships `py.typed`; `@jn.experiment` is a `dataclass_transform`, the markers are
`Annotated` aliases to checkers, and `jn.Nitro` declares its options (run/nitro.py).
pyright runs in its default (standard) mode: its strict mode also reports every value an
untyped library (optax, flax) hands back as "partially unknown", which no user code can fix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import ROOT, SRC

pytestmark = pytest.mark.slow  # mypy over jax, flax and optax: about a minute of CPU

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
PLANTED = """\
import jaxnitro as jn


@jn.experiment
class Exp:
    width: jn.GraphConst[int] = 8
    smoothing: jn.Device[float] = 0.1
    note: jn.Host[str] = ""


n = jn.Nitro(Exp(width=16), max_epoch=3)  # the planted typo: max_epochs
"""


def quick_start() -> str:
    """The README's quick start: the first python block under its heading."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme[readme.index("## Quick start") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "README.md's quick start has no ```python block"
    return match.group(1)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The examples, the quick start and the planted typo, side by side (sweep_tensorboard.py
    imports mnist.py), with configs that name nothing of this repository's."""
    where = tmp_path_factory.mktemp("user")
    for path in EXAMPLES:
        shutil.copy(path, where / path.name)
    (where / "readme_quick_start.py").write_text(quick_start(), encoding="utf-8")
    (where / "planted.py").write_text(PLANTED, encoding="utf-8")
    (where / "mypy.ini").write_text("[mypy]\n", encoding="utf-8")
    config = {"pythonVersion": "3.11", "extraPaths": [str(SRC)]}
    (where / "pyrightconfig.json").write_text(json.dumps(config), encoding="utf-8")
    return where


def _run(args: list[str], where: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(SRC)}  # this checkout's jaxnitro, not an install
    done = subprocess.run(args, cwd=where, env=env, capture_output=True, text=True, timeout=900)
    return done.stdout + done.stderr


def _files(where: Path) -> list[str]:
    return sorted(p.name for p in where.glob("*.py"))


def test_the_examples_are_the_files_checked(sources: Path):
    assert {p.name for p in EXAMPLES} >= {"mnist.py", "gan.py"}
    assert "@jn.experiment" in (sources / "readme_quick_start.py").read_text()


def test_mypy_strict_is_clean_but_for_the_planted_typo(sources: Path):
    pytest.importorskip("mypy")
    out = _run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file=mypy.ini",
            "--strict",
            "--follow-untyped-imports",  # optax has annotations but no py.typed
            *_files(sources),
        ],
        sources,
    )
    errors = [line for line in out.splitlines() if ": error:" in line]
    assert len(errors) == 1, out
    assert errors[0].startswith("planted.py:11:"), out
    assert 'Unexpected keyword argument "max_epoch" for "Nitro"' in errors[0], out


def test_pyright_is_clean_but_for_the_planted_typo(sources: Path):
    pytest.importorskip("pyright")
    out = _run(
        [sys.executable, "-m", "pyright", "--pythonpath", sys.executable, *_files(sources)],
        sources,
    )
    errors = [line.strip() for line in out.splitlines() if " - error: " in line]
    assert len(errors) == 1, out
    assert "planted.py:11:" in errors[0] and 'No parameter named "max_epoch"' in errors[0], out
