"""Background imports (`core/background_imports.py`): started once per name, waited for before
a fork, and before the interpreter finalizes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from helpers.paths import SRC

from jaxnitro._src.core import background_imports

CHILD = """
import atexit, sys, threading

def alive_at_exit():  # registered first, so it runs after the module's own exit handler
    alive = [t.name for t in threading.enumerate() if t.name == "jn-test-import" and t.is_alive()]
    sys.stdout.write(f"alive at exit: {alive}\\n")

atexit.register(alive_at_exit)
from jaxnitro._src.core import background_imports
background_imports.start("jn-test-import", MODULES)
sys.exit(3)
"""


def test_start_runs_once_per_name_and_wait_joins(monkeypatch):
    monkeypatch.setattr(background_imports, "_threads", {})
    background_imports.start("jn-a", ["json"])
    first = background_imports._threads["jn-a"]
    background_imports.start("jn-a", ["this_module_does_not_exist"])  # once per name
    assert background_imports.started("jn-a") and background_imports._threads["jn-a"] is first
    background_imports.wait()
    assert not first.is_alive()


def test_the_process_waits_for_the_import_before_it_finalizes():
    """A daemon thread still running Python while the interpreter finalizes can run the
    collector and free a JAX array there, which aborted a failed CLI run (SIGABRT instead of
    exit 1, a few times in a hundred on a loaded machine). The import is joined at exit."""
    modules = ["matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.ticker"]
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD.replace("MODULES", repr(modules)))],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 3, done.stderr[-3000:]
    assert "alive at exit: []" in done.stdout, done.stdout + done.stderr[-3000:]
