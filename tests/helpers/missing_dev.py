"""A pytest plugin: with ``JAXNITRO_FAIL_ON_MISSING_DEV=1`` (CI sets it), a test skipped
because a module could not be imported fails the session.

CI installs the dev extra, which holds every optional extra the tests use, so there a
``pytest.importorskip`` that skips means the install is broken or the dev extra lacks a
module: a green run would hide tests that never ran. On a user's machine, without the
variable, such a test skips as before. Registered by `tests/conftest.py`
(``pytest_plugins``).
"""

from __future__ import annotations

import os
import re

import pytest

ENV = "JAXNITRO_FAIL_ON_MISSING_DEV"
# pytest.importorskip's reason ("could not import 'x': No module named 'x'") and an
# ImportError's own message, in a reason written by hand.
_MISSING = re.compile(r"could not import '([\w.]+)'|No module named '([\w.]+)'")

_found: list[tuple[str, str]] = []  # (test id, missing module)


def missing_module(reason: str) -> str | None:
    """The module a skip reason says is missing, or None."""
    match = _MISSING.search(reason)
    return None if match is None else (match.group(1) or match.group(2))


def _reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # (path, line, "Skipped: ...")
        return str(longrepr[2])
    return str(longrepr)


def _note(report: pytest.CollectReport | pytest.TestReport) -> None:
    if report.skipped and os.environ.get(ENV) == "1":
        module = missing_module(_reason(report))
        if module is not None:
            _found.append((report.nodeid, module))


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _note(report)  # a module-level importorskip skips the whole file at collection


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _note(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _found:
        return
    terminalreporter.section("skipped for a missing dev dependency", red=True)
    for nodeid, module in _found:
        terminalreporter.line(f"{nodeid}: no module {module!r}")
    terminalreporter.line(
        f"{ENV}=1: these tests must run. Install the dev extra (pip install -e '.[dev]'); a "
        f"module it does not provide goes into the dev extra in pyproject.toml."
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _found and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
