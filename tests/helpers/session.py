"""The suite's pytest plugin (loaded by `tests/conftest.py`): one persistent compilation
cache for the session, and the fast tier stays fast.

Cache: conftest points ``$JAXNITRO_COMPILATION_CACHE`` at the session's directory. The test
process uses it too, as do the child processes tests start: each loads the small programs an
earlier test compiled instead of compiling them again (most of the suite's time otherwise).
A test whose assertions depend on what this process compiles (``programs_compiled == 2``, a
compile report's times, ``persistent_hits``) is marked ``@pytest.mark.no_suite_cache``: it
runs with the cache off, so its counts do not depend on which tests ran before it.
``$JAXNITRO_SUITE_INPROC=0`` keeps the test process off the cache altogether (the children
still use it); ``$JAXNITRO_SUITE_CACHE=0`` turns it off everywhere.

Tiers: `make test-fast` runs the tests not marked `slow` or `multi_device`. This plugin
fails such a test when its setup and call take more CPU seconds than
``$JAXNITRO_TIER_BUDGET`` (default 5; ``0`` turns the check off): mark it `slow`, or make it
cheaper. CPU time, not wall time: this process's and that of the child processes it waited
for, so a machine busy with other work hardly changes it; less the time XLA spent compiling
programs into the session's cache, which falls on whichever test needs a program first (a test
run alone compiles what, in the whole tier, an earlier test compiled for it).
``$JAXNITRO_TIER_LOG=path`` appends one line per test (CPU seconds, wall seconds, seconds in
XLA's compiler while the session's cache was on, tier, test id), the measure in
tests/README.md (`tools/tiers.py` reads it).
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
DEFAULT_BUDGET = 5.0  # CPU seconds: the fast tier holds the tests under 1.5 in a whole-tier
# run (tests/README.md); the margin covers a test that compiles its programs first (run alone,
# or first on its worker) and a busy machine
_start = pytest.StashKey[tuple]()
_compiled = [0.0]  # seconds this process spent in XLA's compiler (JAX's monitoring events)


def _on_duration(event: str, duration: float, **_: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _compiled[0] += duration


def pytest_configure(config: pytest.Config) -> None:
    from jaxnitro._src.dist.devices import configure_cache

    config.addinivalue_line(
        "markers",
        "no_suite_cache: the test process compiles without the session's persistent cache "
        "during this test (its assertions count what it compiles)",
    )
    configure_cache(suite_cache())
    import jax

    jax.monitoring.register_event_duration_secs_listener(_on_duration)


def suite_cache() -> str | bool:
    """What the test process compiles with between tests: the session's cache directory, or
    False (off) under ``$JAXNITRO_SUITE_INPROC=0`` or ``$JAXNITRO_SUITE_CACHE=0``."""
    suite = os.environ.get("JAXNITRO_SUITE_CACHE", "0")
    if suite == "0" or os.environ.get("JAXNITRO_SUITE_INPROC", "1") == "0":
        return False
    return suite


def test_cache(item: pytest.Item) -> str | bool:
    """What the test process compiles with during `item`."""
    return False if item.get_closest_marker("no_suite_cache") else suite_cache()


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
    from jaxnitro._src.dist.devices import cache_in_use, configure_cache

    item.stash[_start] = (cpu_seconds(), time.perf_counter(), _compiled[0])
    if cache_in_use() != (test_cache(item) or None):
        configure_cache(test_cache(item))
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield  # a failing test fails on its own: nothing to add
    cpu0, wall0, compiled0 = item.stash[_start]
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - wall0
    compiled = _compiled[0] - compiled0 if test_cache(item) else 0.0
    if log := os.environ.get("JAXNITRO_TIER_LOG"):
        with open(log, "a") as f:
            f.write(f"{cpu:.2f} {wall:.2f} {compiled:.2f} {tier(item)} {item.nodeid}\n")
    limit, own = budget(), cpu - compiled
    if limit and own > limit and tier(item) == "fast":
        pytest.fail(
            f"{item.nodeid} took {own:.1f} CPU seconds (setup and call, apart from "
            f"{compiled:.1f} s compiling programs the session's cache keeps for the tests "
            f"after it), over the fast tier's {limit:g} (JAXNITRO_TIER_BUDGET). Mark it "
            f"@pytest.mark.slow, or make it cheaper (a smaller model, fewer epochs, a shared "
            f"fixture).",
            pytrace=False,
        )
    return result


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Whatever a test set in this process (`jn.setup_devices`, an in-process `jaxnitro
    --compilation-cache DIR ...`, `jaxnitro serve`, `no_suite_cache`), the next test starts
    from the session's setting again."""
    from jaxnitro._src.dist.devices import cache_in_use, configure_cache

    if cache_in_use() != (suite_cache() or None):
        configure_cache(suite_cache())
    suite = os.environ.get("JAXNITRO_SUITE_CACHE", "0")
    if suite != "0":  # an in-process `jaxnitro --compilation-cache X` rewrote what children get
        os.environ["JAXNITRO_COMPILATION_CACHE"] = suite
