"""The suite's own rules (helpers/session.py): the fast tier's CPU budget, and one persistent
compilation cache for the session, which a test marked `no_suite_cache` compiles without."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap

import pytest
from helpers.paths import TESTS
from helpers.procs import child_env

from jaxnitro._src.dist.devices import apply_env, cache_in_use

SUITE = """
    import sys
    sys.path.insert(0, {tests!r})
    pytest_plugins = ["helpers.session"]
"""
TESTS_OF_A_SUITE = """
    import time
    import pytest

    def burn():
        end = time.process_time() + 0.5
        while time.process_time() < end:
            pass

    def test_unmarked_and_costly():
        burn()

    @pytest.mark.slow
    def test_marked_and_costly():
        burn()

    def test_unmarked_and_cheap():
        pass
"""


def _pytest_in(folder, **env: str) -> subprocess.CompletedProcess:
    """A child pytest session over `folder` (its conftest loads helpers.session)."""
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder)],
        capture_output=True, text=True, cwd=folder, env=child_env(**env), timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_an_unmarked_test_over_the_budget_fails_and_a_marked_one_passes(tmp_path):
    (tmp_path / "conftest.py").write_text(textwrap.dedent(SUITE.format(tests=str(TESTS))))
    (tmp_path / "test_suite.py").write_text(textwrap.dedent(TESTS_OF_A_SUITE))
    log = tmp_path / "tiers.txt"
    got = _pytest_in(tmp_path, JAXNITRO_TIER_BUDGET="0.2", JAXNITRO_TIER_LOG=str(log))
    assert got.returncode == 1, got.stdout[-3000:] + got.stderr[-3000:]
    assert "1 failed, 2 passed" in got.stdout, got.stdout[-3000:]
    assert "test_unmarked_and_costly took" in got.stdout
    assert "over the fast tier's 0.2 (JAXNITRO_TIER_BUDGET)" in got.stdout
    assert "@pytest.mark.slow" in got.stdout
    rows = {line.split()[4].split("::")[1]: line.split() for line in log.read_text().splitlines()}
    assert (
        rows["test_marked_and_costly"][3] == "slow"
        and float(rows["test_marked_and_costly"][0]) >= 0.5
    )
    assert rows["test_unmarked_and_cheap"][3] == "fast"


CACHE_SUITE = """
    import os
    import jax
    import jax.numpy as jnp
    import pytest
    from jaxnitro._src.dist.devices import cache_in_use

    CACHE = os.environ["JAXNITRO_SUITE_CACHE"]
    seen = []  # the cache's files after the first test

    def compile_one(x):
        return jax.jit(lambda a: a * x + 1).lower(jnp.ones(3)).compile()

    def test_unmarked_uses_the_sessions_cache():
        assert cache_in_use() == CACHE
        compile_one(2.0)
        seen.append(sorted(os.listdir(CACHE)))
        assert seen[0]  # the program was written there

    @pytest.mark.no_suite_cache
    def test_marked_compiles_without_it():
        assert cache_in_use() is None
        compile_one(3.0)  # another program: written nowhere

    def test_the_next_one_uses_it_again():
        assert cache_in_use() == CACHE
        assert sorted(os.listdir(CACHE)) == seen[0]  # the marked test wrote nothing
        compile_one(4.0)
        assert sorted(os.listdir(CACHE)) != seen[0]

    def test_compiling_into_the_cache_is_not_counted_against_the_budget():
        def long(a):  # ~0.1 CPU s to trace, ~1.7 to compile (the loop unrolled by XLA)
            def body(i, a):
                return jnp.sin(a) * (1 + i * 1e-3) + jnp.cos(a[::-1])

            return jax.lax.fori_loop(0, 1200, body, a, unroll=True)

        jax.jit(long).lower(jnp.ones(64)).compile()
"""


def test_the_test_process_and_its_children_share_the_sessions_cache():
    suite_cache = os.environ["JAXNITRO_SUITE_CACHE"]
    assert os.environ["JAXNITRO_COMPILATION_CACHE"] == suite_cache  # what children inherit
    assert stat.S_IMODE(os.stat(suite_cache).st_mode) == 0o700  # private, as mkdtemp makes it
    apply_env()  # what a run's setup does: decided already, the environment is not read again
    assert cache_in_use() == suite_cache


@pytest.mark.slow
def test_a_test_marked_no_suite_cache_compiles_without_it_and_the_next_one_with_it(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    (tmp_path / "conftest.py").write_text(textwrap.dedent(SUITE.format(tests=str(TESTS))))
    (tmp_path / "test_cache_suite.py").write_text(textwrap.dedent(CACHE_SUITE))
    log = tmp_path / "tiers.txt"
    got = _pytest_in(
        tmp_path,
        JAXNITRO_SUITE_CACHE=str(cache),
        JAXNITRO_TIER_BUDGET="1.2",
        JAXNITRO_TIER_LOG=str(log),
    )
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "4 passed" in got.stdout, got.stdout[-3000:]
    cpu, _, compiled, tier, _ = log.read_text().splitlines()[-1].split()
    # over the budget in all, under it without the compile the next test would load
    assert tier == "fast" and float(cpu) > 1.2 and float(cpu) - float(compiled) < 1.2, cpu


def test_tools_tiers_marks_the_fast_tests_over_the_cut_and_leaves_the_rest(tmp_path):
    """`tools/tiers.py LOG --over S --apply`: the costly fast test's function gains the slow
    mark (once for all its parameters, with `import pytest` added), a cheap one does not."""
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "test_a.py").write_text(
        '"""Doc."""\n\nfrom __future__ import annotations\n\n\n'
        "def test_costly(x):\n    pass\n\n\ndef test_cheap():\n    pass\n"
    )
    log = tmp_path / "tiers.txt"
    log.write_text(
        "2.50 2.60 0.10 fast tests/test_a.py::test_costly[1]\n"
        "3.00 3.10 fast tests/test_a.py::test_costly[2]\n"  # the older format, no compile column
        "0.20 0.20 0.00 fast tests/test_a.py::test_cheap\n"
        "9.00 9.00 0.00 slow tests/test_b.py::test_marked_already\n"
    )
    got = subprocess.run(
        [sys.executable, str(TESTS.parent / "tools" / "tiers.py"), str(log), "--over", "1.2",
         "--apply", "--root", str(tmp_path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert got.returncode == 0, got.stderr
    assert "2 fast tests over 1.2 CPU s; the fast tier without them: 0 CPU s" in got.stdout
    text = (tests / "test_a.py").read_text()
    assert "from __future__ import annotations\n\nimport pytest\n" in text
    assert text.count("@pytest.mark.slow") == 1
    assert "@pytest.mark.slow\ndef test_costly(x):" in text
    assert "@pytest.mark.slow\ndef test_cheap" not in text
