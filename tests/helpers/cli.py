"""The `jaxnitro` command run as a user runs it: `python -m jaxnitro ...` in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from helpers.procs import child_env


def jaxnitro(
    *args: object, cwd: Path, timeout: float = 300, plot: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run `jaxnitro ARGS` in `cwd` with this checkout on the path; output captured as text.

    Help text wraps at 80 columns whatever the terminal; `plot=True` lets a run draw its
    end-of-train curves.png (off otherwise, as in the tests' own process).
    """
    env = child_env(COLUMNS="80")
    if plot:
        env.pop("JAXNITRO_NO_PLOT")
    return subprocess.run(
        [sys.executable, "-m", "jaxnitro", *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
