"""A module of the package as it was at an earlier commit, for the A/B benchmarks
(`host_ab.py`, `loop_ab.py`) that time the old and the new code in one process."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def old_module(name: str, path: str, rev: str) -> ModuleType:
    """`path` as it was at `rev`, imported as `name` (its imports resolve to this tree). A
    path under `src/jaxnitro/_src/` is looked for at its pre-move place too (before the
    internals moved under `_src`)."""
    shown = None
    for candidate in (path, path.replace("src/jaxnitro/_src/", "src/jaxnitro/", 1)):
        shown = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{candidate}"], capture_output=True, text=True
        )
        if shown.returncode == 0:
            break
    assert shown is not None
    if shown.returncode != 0:
        raise SystemExit(f"{path} is not in commit {rev}: {shown.stderr.strip()}")
    text = shown.stdout
    file = Path(tempfile.mkdtemp()) / f"{name}.py"
    file.write_text(text)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise SystemExit(
            f"{path} at {rev} imports {e.name or e}, which this tree no longer has: an A/B "
            f"benchmark runs the old module inside this tree, so it works only while the "
            f"modules the old one imports stay where they were. Run it from a checkout of the "
            f"commit it was written for (benchmarks/README.md), or pick a later --before."
        ) from e
    return module
