"""The suite's pytest plugin (loaded by `tests/conftest.py`): the test process compiles
without the persistent cache, and the fast tier stays fast.

Cache: conftest points ``$JAXNITRO_COMPILATION_CACHE`` at the session's directory, so the child
processes tests start load the programs an earlier child compiled. The test process itself
does not use it: a test that counts its compiles must not depend on which tests ran first.

Tiers: `make test-fast` runs the tests not marked `slow` or `multi_device`. This plugin
fails such a test when its setup and call take more CPU seconds than
``$JAXNITRO_TIER_BUDGET`` (default 15; ``0`` turns the check off): mark it `slow`, or make it
cheaper. CPU time, not wall time: this process's and that of the child processes it waited
for, so a machine busy with other work hardly changes it. ``$JAXNITRO_TIER_LOG=path`` appends
one line per test (CPU seconds, wall seconds, tier, test id), the measure in tests/README.md.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

try:
    import resource
except ImportError:  # pragma: no cover - Windows: this process only
    resource = None  # type: ignore[assignment]

SLOW_TIER = ("slow", "multi_device")
DEFAULT_BUDGET = 15.0  # CPU seconds: most fast-tier tests take well under one, the costliest
# unmarked ones 9 to 10 (tests/README.md); the margin keeps a busy machine from flapping it
_start = pytest.StashKey[tuple]()


def pytest_configure(config: pytest.Config) -> None:
    from jaxnitro._src.dist.devices import configure_cache

    configure_cache(False)


def cpu_seconds() -> float:
    """CPU seconds of this process and of its children that were waited for."""
    if resource is None:  # pragma: no cover
        return time.process_time()
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def budget() -> float:
    """The fast tier's CPU seconds per test (0: no check); tripled under coverage.py."""
    value = float(os.environ.get("JAXNITRO_TIER_BUDGET", DEFAULT_BUDGET))
    return value * (3 if "coverage" in sys.modules else 1)


def tier(item: pytest.Item) -> str:
    return "slow" if any(item.get_closest_marker(m) for m in SLOW_TIER) else "fast"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    item.stash[_start] = (cpu_seconds(), time.perf_counter())
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # a failing test fails on its own: nothing to add
    cpu0, wall0 = item.stash[_start]
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    if log := os.environ.get("JAXNITRO_TIER_LOG"):
        with open(log, "a") as f:
            f.write(f"{cpu:.2f} {wall:.2f} {tier(item)} {item.nodeid}\n")
    limit = budget()
    if limit and cpu > limit and tier(item) == "fast":
        pytest.fail(
            f"{item.nodeid} took {cpu:.1f} CPU seconds (setup and call), over the fast tier's "
            f"{limit:g} (JAXNITRO_TIER_BUDGET). Mark it @pytest.mark.slow, or make it cheaper "
            f"(a smaller model, fewer epochs, a shared fixture).",
            pytrace=False,
        )
    return result


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Whatever a test turned on in this process (`jn.setup_devices`, an in-process
    `jaxnitro --compilation-cache DIR ...`, `jaxnitro serve`), the next test again compiles
    without the persistent cache: a compile count must not depend on the tests before it."""
    from jaxnitro._src.dist.devices import cache_in_use, configure_cache

    if cache_in_use() is not None:
        configure_cache(False)
    suite = os.environ.get("JAXNITRO_SUITE_CACHE", "0")
    if suite != "0":  # an in-process `jaxnitro --compilation-cache X` rewrote what children get
        os.environ["JAXNITRO_COMPILATION_CACHE"] = suite
