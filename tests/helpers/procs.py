"""Child processes: an environment that imports this tree, and polling with deadlines.

Deadlines are generous on purpose: the suite shares its cores with other jobs, and a test
asserts that something happens, not how fast.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

import pytest

from helpers.paths import SRC

T = TypeVar("T")


def child_env(**extra: str) -> dict[str, str]:
    """os.environ for a child Python that imports this checkout's jaxnitro on the CPU, with no
    end-of-train plot; `extra` entries are added (or override)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXNITRO_NO_PLOT": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def alive(pid: int) -> bool:
    """Whether process `pid` is running (a zombie, exited but not yet reaped, is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (macOS): ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def gone(pids: Iterable[int], seconds: float = 60.0) -> bool:
    """Poll until none of `pids` is alive; False if some still are after `seconds`."""
    pids = list(pids)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return not any(alive(p) for p in pids)


def until(predicate: Callable[[], T], seconds: float = 60.0) -> T:
    """Poll `predicate()` until it returns something truthy (returned), or fail the test."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"gave up after {seconds} s waiting for {predicate}")
