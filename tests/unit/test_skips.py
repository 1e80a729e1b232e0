"""Skips that say so: under CI's JAXNITRO_FAIL_ON_MISSING_DEV=1, a test skipped for a missing
module fails the run (`helpers.missing_dev`); other skips, and any skip without it, do not."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from helpers.missing_dev import ENV, missing_module
from helpers.paths import ROOT, TESTS

TINY = """
import pytest

def test_ran():
    pass

def test_{name}():
    {body}
"""


def run_pytest(tmp_path, body: str, *, ci: bool, name: str = "skipper"):
    """A pytest run of a tiny file with the plugin, in a child: (exit status, output)."""
    (tmp_path / f"test_{name}.py").write_text(TINY.format(name=name, body=body))
    env = {k: v for k, v in os.environ.items() if k != ENV}
    env["PYTHONPATH"] = str(TESTS)
    if ci:
        env[ENV] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider"]
        + ["-p", "helpers.missing_dev", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
def test_a_skip_for_a_missing_module_fails_the_ci_run(tmp_path):
    body = 'pytest.importorskip("jaxnitro_no_such_module")'
    status, out = run_pytest(tmp_path, body, ci=True)
    assert status == 1, out
    assert "skipped for a missing dev dependency" in out
    assert "test_skipper: no module 'jaxnitro_no_such_module'" in out
    assert "pip install -e '.[dev]'" in out
    status, out = run_pytest(tmp_path, body, ci=False)  # a user's machine: a skip, as before
    assert status == 0 and "1 passed, 1 skipped" in out, out


@pytest.mark.slow
def test_a_module_level_importorskip_fails_the_ci_run_too(tmp_path):
    (tmp_path / "test_whole.py").write_text(
        'import pytest\npytest.importorskip("jaxnitro_no_such_module")\n\ndef test_x():\n    pass\n'
    )
    status, out = run_pytest(tmp_path, "pass", ci=True)
    assert status == 1 and "test_whole.py: no module 'jaxnitro_no_such_module'" in out, out


@pytest.mark.slow
def test_other_skips_pass_the_ci_run(tmp_path):
    status, out = run_pytest(tmp_path, 'pytest.skip("needs git")', ci=True)
    assert status == 0 and "1 passed, 1 skipped" in out, out
    status, out = run_pytest(tmp_path, 'pytest.importorskip("os")', ci=True)
    assert status == 0 and "2 passed" in out, out


@pytest.mark.parametrize(
    ("reason", "module"),
    [
        ("could not import 'mlflow': No module named 'mlflow'", "mlflow"),
        ("Skipped: could not import 'wandb.proto.x': No module named 'wandb'", "wandb.proto.x"),
        ("No module named 'grain'", "grain"),
        ("needs git", None),
        ("chown needs root", None),
    ],
)
def test_the_missing_module_is_read_from_the_reason(reason, module):
    assert missing_module(reason) == module


def test_ci_turns_the_check_on():
    """`.ci/run` runs `make test`; the variable is set where the suite runs."""
    makefile = (ROOT / "Makefile").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert f"{ENV}=1" in makefile or f"{ENV}=1" in ci
