"""Warm starts: JAX's persistent compilation cache, on by default, private, capped, honest.

Each test runs fresh Python processes (the cache is decided once per process), with a cache
directory of its own under tmp_path. One first run, which fills a cache, is shared: the tests
of a second process start from that cache as the first run left it.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.compile import persistent
from jaxnitro._src.dist.devices import cache_dir_choice, default_cache_dir

RUN = """
import json, os, sys
sys.path.insert(0, {tests!r})
import jaxnitro as jn
from conftest import Tiny
os.environ["JAXNITRO_COMPILATION_CACHE"] = os.environ["TEST_CACHE"]  # conftest turns it off
{before}
n = jn.Nitro(Tiny(max_epochs=1, n_val=40{fields}), run_dir={run_dir!r}, progress="plain")
result = jn.train(n)
print("RESULT", json.dumps({{"compiled": result.programs_compiled,
    "loaded": result.programs_loaded, "stats": jn.cache_stats()}}))
"""


def run(tmp_path: Path, name: str, cache, *, before: str = "", env: dict | None = None, fields=""):
    """One training process; returns (its result dict, its stdout, its stderr)."""
    script = tmp_path / f"{name}.py"
    script.write_text(
        RUN.format(
            tests=str(TESTS),
            before=textwrap.dedent(before),
            run_dir=str(tmp_path / name),
            fields=fields,
        )
    )
    environ = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXNITRO_NO_PLOT": "1", **(env or {})}
    environ["TEST_CACHE"] = str(cache)
    got = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=environ, timeout=300
    )
    assert got.returncode == 0, got.stderr[-3000:]
    line = next(x for x in got.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT ")), got.stdout, got.stderr


def entries(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.glob("*-cache")) if cache.is_dir() else []


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """(the cache a first process filled, its result, its stdout, the cache's mode as that
    process created it), and a copy of the cache as it was."""
    tmp = tmp_path_factory.mktemp("first")
    result, out, _ = run(tmp, "a", tmp / "xla")
    shutil.copytree(tmp / "xla", tmp / "as-filled")
    return tmp / "xla", result, out, stat.S_IMODE((tmp / "xla").stat().st_mode)


@pytest.fixture
def filled(first_run) -> Path:
    """The first run's cache as that run left it, for one test. In its own place: JAX's keys
    depend on the directory (a copy elsewhere would find nothing), so it is restored there."""
    cache = first_run[0]
    shutil.rmtree(cache)
    shutil.copytree(cache.parent / "as-filled", cache)
    return cache


@pytest.mark.slow
def test_the_second_process_compiles_nothing_and_says_so(tmp_path, first_run, filled):
    cache, (_, first, out1, mode) = filled, first_run
    assert first["compiled"] == 2 and first["loaded"] == 0
    assert mode == 0o700  # created private
    # ... and a path given to setup_devices is honoured like the environment variable
    before = """
        jn.setup_devices(compilation_cache=os.environ["TEST_CACHE"])
    """
    second, out2, _ = run(tmp_path, "b", cache, before=before)
    assert second["compiled"] == 0 and second["loaded"] == 2, second
    assert second["stats"]["persistent_hits"] == 2  # JAX's own cache-hit events
    assert "loaded the train program (Tiny) from the persistent cache in" in out2
    assert "0 program(s) compiled, 2 loaded from the persistent cache" in out2
    assert "compiled the train program" in out1 and "compiled the train program" not in out2
    got = persistent.info(cache)
    assert got.entries >= 2 and got.processes == 2 and got.loaded >= 2


@pytest.mark.slow
def test_off_writes_nothing(tmp_path):
    cache = tmp_path / "xla"
    result, _, _ = run(tmp_path, "a", "0", env={"XDG_CACHE_HOME": str(tmp_path / "home")})
    assert result["compiled"] == 2
    assert not (tmp_path / "home").exists() and not cache.exists()
    before = """
        jn.setup_devices(backend="cpu", compilation_cache=False)
        _Tiny = Tiny
        def Tiny(**fields):  # and a run without validation data: one program
            return _Tiny(**{**fields, "n_val": 0})
    """
    result, _, _ = run(tmp_path, "b", cache, before=before)
    assert result["compiled"] == 1 and not cache.exists()


@pytest.mark.slow
@pytest.mark.parametrize("mode", [0o777, 0o770])
def test_a_cache_others_can_write_to_is_refused(tmp_path, mode):
    cache = tmp_path / "xla"
    cache.mkdir()
    cache.chmod(mode)
    result, _, err = run(tmp_path, "a", cache)
    assert result["compiled"] == 2
    assert "is not used" in err and ("world-writable" in err or "group-writable" in err)
    assert f"chmod 700 {cache}" in err
    assert entries(cache) == []  # nothing written where others could plant programs


@pytest.mark.slow
def test_the_cap_evicts_the_least_recently_used(tmp_path, filled):
    cache = filled
    full = persistent.info(cache).size_bytes
    assert full > 0
    # a cap below what one run writes, and a run with new programs to write (another
    # width): JAX evicts the least recently used entries to make room for them
    cap = str(max(full // 3, 4096))
    env = {"JAXNITRO_COMPILATION_CACHE_MAX_SIZE": cap}
    run(tmp_path, "b", cache, env=env, fields=", width=24")
    total = sum(p.stat().st_size for p in cache.glob("*-cache"))
    assert total <= int(cap), (total, cap)


@pytest.mark.slow
def test_entries_of_another_jax_version_are_never_loaded(tmp_path, filled):
    cache = filled
    # The jaxlib version is one of the inputs of JAX's own cache key: another version's
    # entries sit under other keys, so this process finds none of them.
    before = """
        from jax._src import cache_key
        cache_key.jaxlib_version_str = "0.0.0-another-version"
    """
    result, _, _ = run(tmp_path, "b", cache, before=before)
    assert result["loaded"] == 0 and result["compiled"] == 2


@pytest.mark.slow
def test_programs_that_call_back_into_python_are_not_cached(tmp_path):
    cache = tmp_path / "xla"
    before = """
        import jax, optax
        @jn.experiment
        class Tapped(Tiny):
            def metrics(self, logits, *, y):
                jax.debug.callback(lambda v: None, logits.sum())
                return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}
        Tiny = Tapped
    """
    run(tmp_path, "a", cache, before=before)
    result, _, _ = run(tmp_path, "b", cache, before=before)
    # the eval program calls back: compiled again; the train program does not: loaded
    assert result["compiled"] == 1 and result["loaded"] == 1, result


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == str(tmp_path / "jaxnitro" / "xla")
    monkeypatch.setenv("JAXNITRO_COMPILATION_CACHE", str(tmp_path / "env"))
    assert cache_dir_choice(None) == cache_dir_choice(True) == str(tmp_path / "env")
    monkeypatch.delenv("JAXNITRO_COMPILATION_CACHE")
    assert cache_dir_choice(None) == default_cache_dir()
    monkeypatch.setenv("JAXNITRO_COMPILATION_CACHE", "0")
    assert cache_dir_choice(None) is None
    assert cache_dir_choice(False) is None
    assert cache_dir_choice(tmp_path / "x") == str(tmp_path / "x")


def test_a_bad_cap_is_named(monkeypatch):
    with pytest.raises(jn.ConfigError, match="compilation_cache_max_size='lots'"):
        jn.setup_devices(compilation_cache=False, compilation_cache_max_size="lots")


@pytest.mark.slow
def test_the_cache_command_shows_and_clears(tmp_path):
    cache = tmp_path / "xla"
    cache.mkdir(mode=0o700)
    (cache / "k1-cache").write_bytes(b"x" * 100)
    (cache / "k1-atime").write_bytes(b"t")
    (cache / "keep.txt").write_text("not the cache's")
    (cache / persistent.STATS_FILE).write_text(
        json.dumps({"loaded": 3, "compiled": 1}) + "\nnot json\n"
    )
    cli = [sys.executable, "-m", "jaxnitro", "cache"]
    got = subprocess.run(
        [*cli, "info", "--dir", str(cache), "--json"], capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stderr
    shown = json.loads(got.stdout)
    assert shown["entries"] == 1 and shown["hit_rate"] == 0.75 and shown["processes"] == 1
    assert shown["untrusted"] == []
    cache.chmod(0o777)
    got = subprocess.run(
        [*cli, "info", "--dir", str(cache)], capture_output=True, text=True, timeout=60
    )
    assert "trusted    no: it is world-writable (runs do not use it)" in got.stdout, got.stderr
    cache.chmod(0o700)
    got = subprocess.run(
        [*cli, "clear", "--dir", str(cache)], capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0 and "removed 1" in got.stdout
    assert sorted(p.name for p in cache.iterdir()) == ["keep.txt"]
