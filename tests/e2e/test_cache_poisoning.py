"""The persistent compilation cache under attack by another local user (issue 41, items 1-2).

Each victim is a fresh Python process with jaxnitro's cache on; the attacker's executable is
made by plain JAX (a valid program, `x * 100`, stored under the key of the victim's `x + 1`),
and planted by a second user (root only: the tests act as it with `setpriv`) or by this user.
The directories live in a fresh directory under /tmp that the second user can enter.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from helpers.procs import child_env, until
from helpers.second_user import other_user

pytestmark = pytest.mark.slow

# Plain JAX, configured as jaxnitro configures it: the key of `NAME(x) = x + 1` in CACHE
# (the key depends on the directory) and the executable of `NAME(x) = x * 100`, copied out.
FORGE = textwrap.dedent("""
    import os, shutil, sys
    import numpy as np, jax
    cache, out, name = sys.argv[1:]
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_compilation_cache_max_size", 2 * 2**30)

    def new_entry(fn):
        before = set(os.listdir(cache)) if os.path.isdir(cache) else set()
        jax.jit(fn)(np.float32(1.0))
        (got,) = [n for n in set(os.listdir(cache)) - before if n.endswith("-cache")]
        return got

    def make(body):  # a function called `name` (the key holds the name) computing `body`
        ns = {}
        exec(f"def {name}(x):\\n    return {body}", ns)
        return ns[name]

    add = new_entry(make("x + 1"))
    mul = new_entry(make("x * 100"))
    shutil.copyfile(os.path.join(cache, mul), out)
    for n in os.listdir(cache):  # leave no trace of this process in the cache
        if n.startswith("jit_"):
            os.unlink(os.path.join(cache, n))
    print("KEY", add)
""")

VICTIM = textwrap.dedent("""
    import os, sys, time
    import numpy as np, jax
    import jaxnitro as jn
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if "cache_hits" in name else None)
    jn.setup_devices(backend="cpu", compilation_cache=sys.argv[1])

    def before(x):
        return x - 1

    def {name}(x):
        return x + 1

    if len(sys.argv) > 2:  # compile one program, then wait to be told to go on
        jax.jit(before)(np.float32(1.0))
        print("READY", flush=True)
        while not os.path.exists(sys.argv[2]):
            time.sleep(0.05)
    print("RESULT", float(jax.jit({name})(np.float32(1.0))), len(hits), flush=True)
""")


@pytest.fixture
def shared_tmp():
    """A fresh directory under /tmp (0755, root's or this user's) a second user can enter."""
    path = Path(tempfile.mkdtemp(prefix="jn-cache-attack-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def forge(cache: Path, out: Path, name: str) -> str:
    """Plain JAX's `x * 100` executable in `out`; returns the key `name`'s `x + 1` has in
    `cache`."""
    script = out.parent / "forge.py"
    script.write_text(FORGE)
    got = subprocess.run(
        [sys.executable, str(script), str(cache), str(out), name],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    out.chmod(0o644)
    return got.stdout.split("KEY ")[-1].strip()


def victim_script(tmp: Path, name: str) -> Path:
    script = tmp / "victim.py"
    script.write_text(VICTIM.format(name=name))
    return script


def result(stdout: str) -> tuple[float, int]:
    """The victim's answer for x = 1, and how many programs it loaded from the cache."""
    line = next(x for x in stdout.splitlines() if x.startswith("RESULT "))
    value, hits = line.split()[1:]
    return float(value), int(hits)


def victim(script: Path, cache: Path) -> tuple[float, int, str]:
    got = subprocess.run(
        [sys.executable, str(script), str(cache)],
        capture_output=True,
        text=True,
        env=child_env(JAXNITRO_COMPILATION_CACHE=str(cache)),
        timeout=300,
    )
    assert got.returncode == 0, got.stderr[-3000:]
    return (*result(got.stdout), got.stderr)


@pytest.mark.parametrize("planter", ["another user", "this user"])
def test_a_planted_entry_is_refused_after_chmod_700(shared_tmp, planter):
    """The issue's repro: a world-writable cache, an entry planted under `f`'s key, the
    `chmod 700` the warning prescribes; the next run must not return x * 100."""
    who = other_user() if planter == "another user" else None
    cache = shared_tmp / "xla"
    cache.mkdir()
    cache.chmod(0o777)  # shared by mistake
    planted = shared_tmp / "planted"
    key = forge(cache, planted, "f")
    plant = f'cp "{planted}" "{cache}/.p" && mv -f "{cache}/.p" "{cache}/{key}"'
    if who is not None:
        who.sh(plant)
        assert (cache / key).stat().st_uid == who.uid
    else:
        subprocess.run(["sh", "-c", plant], check=True)
    cache.chmod(0o700)  # the fix the warning prescribed
    script = victim_script(shared_tmp, "f")

    value, hits, err = victim(script, cache)
    assert value == 2.0 and hits == 0, err[-3000:]  # x + 1, compiled: the planted one refused
    assert err.count("refused an entry of the compilation cache") == 1, err[-3000:]
    assert key in err and "compiled again" in err
    why = "belongs to another user" if who is not None else "not signed with your cache key"
    assert why in err

    value, hits, err = victim(script, cache)  # its own entry, signed, is loaded
    assert (value, hits) == (2.0, 1), err[-3000:]
    assert "refused" not in err


def test_a_cache_swapped_for_a_symlink_mid_run_is_refused(shared_tmp):
    """/tmp/share/xla, where share passes to another user while a run goes on (the issue's
    sticky, world-writable directory of another user): it swaps xla for a link to its own
    directory holding a planted entry. The next compile must not load it."""
    who = other_user()
    share = shared_tmp / "share"
    share.mkdir(mode=0o755)
    cache = share / "xla"
    planted = shared_tmp / "planted"
    key = forge(cache, planted, "g")
    evil = shared_tmp / "evil"
    evil.mkdir(mode=0o755)
    os.chown(evil, who.uid, who.gid)
    go = shared_tmp / "go"
    script = victim_script(shared_tmp, "g")
    proc = subprocess.Popen(
        [sys.executable, str(script), str(cache), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(JAXNITRO_COMPILATION_CACHE=str(cache)),
    )
    try:
        assert proc.stdout is not None
        until(lambda: proc.stdout.readline().startswith("READY") or proc.poll() is not None)
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        os.chown(share, who.uid, who.gid)  # now another user's, sticky and world-writable
        share.chmod(0o1777)
        who.sh(
            f'cp "{planted}" "{evil}/{key}" && mv "{cache}" "{share}/old" '
            f'&& ln -s "{evil}" "{cache}"'
        )
        assert cache.is_symlink() and cache.lstat().st_uid == who.uid
        go.touch()
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    value, hits = result(out)
    assert (value, hits) == (2.0, 0), err[-3000:]  # compiled: the planted x * 100 not loaded
    assert f"the compilation cache {cache} is not used from now on" in err, err[-3000:]
    assert f"{share} is owned by another user (uid {who.uid})" in err
    assert sorted(p.name for p in evil.iterdir()) == [key]  # not read (no access time), nor written


def test_under_umask_000_what_jaxnitro_creates_is_private(tmp_path):
    home = tmp_path / "home"  # $XDG_CACHE_HOME, missing: jaxnitro makes it and what is under it
    code = "import os; os.umask(0); import jaxnitro as jn; jn.setup_devices(backend='cpu')"
    env = child_env(XDG_CACHE_HOME=str(home))
    for name in ("JAXNITRO_COMPILATION_CACHE", "JAX_COMPILATION_CACHE_DIR"):
        env.pop(name, None)  # the default directory
    got = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert got.returncode == 0, got.stderr[-3000:]
    made = [home, home / "jaxnitro", home / "jaxnitro" / "xla"]
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in made} == {
        str(p): "0o700" for p in made
    }
    key = home / "jaxnitro" / "xla" / "jaxnitro-key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
