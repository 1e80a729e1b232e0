"""What the persistent compilation cache trusts: its key and each entry (the path to it:
tests/unit/core/test_private_dirs.py).

In-process and fast: `SignedCache` over JAX's own `LRUCache` in a tmp directory, no compile.
Ownership by another user needs root (`os.chown`); those cases skip otherwise.
"""

from __future__ import annotations

import os
import stat
import threading

import pytest
from jax._src.lru_cache import LRUCache

from jaxnitro._src.compile import cache_guard
from jaxnitro._src.compile.cache_guard import KEY_FILE, SignedCache, prepare, sign

OTHER = 64123  # a uid no one on this machine has

root_only = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="giving files to another uid needs root"
)
pytestmark = pytest.mark.skipif(not cache_guard.SUPPORTED, reason="POSIX only")


@pytest.fixture(autouse=True)
def fresh_messages(monkeypatch):
    monkeypatch.setattr(cache_guard, "_said", set())


def signed_cache(directory) -> SignedCache:
    assert prepare(directory) == []
    return SignedCache(str(directory), LRUCache(str(directory), max_size=2**20))


def test_a_missing_cache_is_made_private_with_its_key(tmp_path):
    old = os.umask(0)
    try:
        assert prepare(tmp_path / "a" / "b") == []
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700
    key = tmp_path / "a" / "b" / KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and key.stat().st_size == 32


# -- the entries --------------------------------------------------------------------------


def test_entries_round_trip_signed_and_private(tmp_path):
    cache = signed_cache(tmp_path / "xla")
    old = os.umask(0)
    try:
        cache.put("jit_f-abc", b"executable")
    finally:
        os.umask(old)
    raw = (tmp_path / "xla" / "jit_f-abc-cache").read_bytes()
    assert raw != b"executable" and raw.endswith(b"executable")
    assert stat.S_IMODE((tmp_path / "xla" / "jit_f-abc-cache").stat().st_mode) == 0o600
    assert cache.get("jit_f-abc") == b"executable"
    assert cache.get("jit_f-other") is None


def test_an_unsigned_entry_is_refused_removed_and_said_once(tmp_path):
    cache = signed_cache(tmp_path / "xla")
    for key in ("jit_f-1", "jit_f-2"):
        (tmp_path / "xla" / f"{key}-cache").write_bytes(b"plain JAX's bytes")
        (tmp_path / "xla" / f"{key}-cache").chmod(0o600)
    with pytest.warns(UserWarning) as said:
        assert cache.get("jit_f-1") is None
        assert cache.get("jit_f-2") is None
    assert len(said) == 1
    text = str(said[0].message)
    assert "refused an entry of the compilation cache" in text and "jit_f-1-cache" in text
    assert "not signed with your cache key" in text and "compiled again" in text
    assert not (tmp_path / "xla" / "jit_f-1-cache").exists()  # so the compile is stored
    cache.put("jit_f-1", b"mine")
    assert cache.get("jit_f-1") == b"mine"


def test_a_signature_binds_the_bytes_the_key_and_the_user(tmp_path):
    cache = signed_cache(tmp_path / "xla")
    cache.put("jit_f-1", b"x + 1")
    cache.put("jit_g-2", b"x * 100")
    entry = tmp_path / "xla" / "jit_f-1-cache"
    # an entry of this user moved to another key
    entry.write_bytes((tmp_path / "xla" / "jit_g-2-cache").read_bytes())
    with pytest.warns(UserWarning, match="signature does not match"):
        assert cache.get("jit_f-1") is None
    # signed with someone else's key
    entry.write_bytes(sign(b"k" * 32, "jit_f-1", b"x * 100"))
    entry.chmod(0o600)
    assert cache.get("jit_f-1") is None
    # changed in place
    cache.put("jit_f-1", b"x + 1")
    entry.write_bytes(entry.read_bytes()[:-1] + b"2")
    assert cache.get("jit_f-1") is None


def test_links_fifos_and_writable_entries_are_never_read(tmp_path):
    cache = signed_cache(tmp_path / "xla")
    cache.put("jit_g-1", b"x + 1")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # reading it would block forever
    (tmp_path / "xla" / "jit_f-1-cache").symlink_to(fifo)
    os.mkfifo(tmp_path / "xla" / "jit_f-2-cache")
    (tmp_path / "xla" / "jit_g-1-cache").chmod(0o666)
    got: list = []
    t = threading.Thread(
        target=lambda: got.extend(cache.get(k) for k in ("jit_f-1", "jit_f-2", "jit_g-1"))
    )
    with pytest.warns(UserWarning, match="symbolic link"):
        t.start()
        t.join(30)
    assert not t.is_alive() and got == [None, None, None]
    assert sorted(p.name for p in (tmp_path / "xla").glob("jit_*")) == []


@root_only
def test_an_entry_or_key_of_another_user_is_refused(tmp_path):
    cache = signed_cache(tmp_path / "xla")
    cache.put("jit_f-1", b"x + 1")
    os.chown(tmp_path / "xla" / "jit_f-1-cache", OTHER, OTHER)  # even signed with our key
    with pytest.warns(UserWarning, match=f"belongs to another user \\(uid {OTHER}\\)"):
        assert cache.get("jit_f-1") is None
    key = tmp_path / "xla" / KEY_FILE
    before = key.read_bytes()
    os.chown(key, OTHER, OTHER)
    cache.put("jit_f-1", b"x + 1")  # a new key is made; the planted one is gone
    assert key.stat().st_uid == os.getuid() and key.read_bytes() != before
    assert cache.get("jit_f-1") == b"x + 1"


def test_a_key_others_could_read_or_reach_is_replaced(tmp_path):
    cache = signed_cache(tmp_path / "xla")
    key = tmp_path / "xla" / KEY_FILE
    cache.put("jit_f-1", b"x + 1")
    key.chmod(0o644)
    with pytest.warns(UserWarning, match="others may read or write it"):
        assert cache.get("jit_f-1") is None  # signed with a key that may have leaked
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    os.link(key, tmp_path / "elsewhere")
    cache.put("jit_f-2", b"y")
    assert (tmp_path / "elsewhere").read_bytes() != key.read_bytes()
    os.unlink(tmp_path / "elsewhere")
    mine = tmp_path / "known"
    mine.write_bytes(b"k" * 32)
    mine.chmod(0o600)
    key.unlink()
    key.symlink_to(mine)
    cache.put("jit_f-3", b"z")
    assert not key.is_symlink() and key.read_bytes() != b"k" * 32


def test_a_path_that_turns_untrusted_is_not_used_from_then_on(tmp_path):
    parent = tmp_path / "p"
    parent.mkdir(mode=0o755)
    cache = signed_cache(parent / "xla")
    cache.put("jit_f-1", b"x + 1")
    parent.chmod(0o777)
    with pytest.warns(UserWarning, match=r"xla is not used from now on: .*p is world-writable"):
        assert cache.get("jit_f-1") is None
    cache.put("jit_f-2", b"y")
    assert not (parent / "xla" / "jit_f-2-cache").exists()
    parent.chmod(0o755)  # trusted again: used again
    assert cache.get("jit_f-1") == b"x + 1"


def test_processes_starting_together_share_one_key(tmp_path):
    directory = tmp_path / "xla"
    caches: list = []
    ready = threading.Barrier(6)

    def start():
        ready.wait()
        caches.append(signed_cache(directory))

    threads = [threading.Thread(target=start) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(caches) == 6
    caches[0].put("jit_f-1", b"x + 1")
    assert all(c.get("jit_f-1") == b"x + 1" for c in caches)  # one key, read by all


def test_files_left_by_others_are_swept_at_start_unread(tmp_path):
    directory = tmp_path / "xla"
    mine = signed_cache(directory)
    mine.put("jit_f-1", b"x + 1")
    os.mkfifo(directory / "jit_x-9-atime")  # JAX's eviction reads every access time
    (directory / "jit_x-9-cache").write_bytes(b"planted")
    (directory / "jit_y-9-cache").symlink_to(tmp_path / "anywhere")
    (directory / KEY_FILE).unlink()
    os.mkfifo(directory / KEY_FILE)  # would block a read
    (directory / "notes.txt").write_text("not the cache's")
    if os.geteuid() == 0:
        os.chown(directory / "jit_x-9-cache", OTHER, OTHER)
        (directory / ".lockfile").touch()
        os.chown(directory / ".lockfile", OTHER, OTHER)  # could be held forever
    with pytest.warns(UserWarning) as said:
        assert prepare(directory) == []
    texts = [str(w.message) for w in said]
    assert any("refused an entry" in t and "removed unread" in t for t in texts), texts
    assert any("key" in t and "not a regular file" in t for t in texts), texts
    left = sorted(p.name for p in directory.iterdir())
    planted = {"jit_x-9-atime", "jit_y-9-cache"} | (
        {"jit_x-9-cache", ".lockfile"} if os.geteuid() == 0 else set()
    )
    assert not planted & set(left) and {"jit_f-1-cache", "notes.txt", KEY_FILE} <= set(left)
    assert (directory / KEY_FILE).is_file()


# -- the load record ----------------------------------------------------------------------
def test_the_load_record_is_appended_but_never_through_a_planted_link(tmp_path, monkeypatch):
    """At exit a process appends its loads and compiles to the cache's stats file, opened
    with O_NOFOLLOW: a link planted under that name does not make it write elsewhere."""
    from jaxnitro._src.compile import cache, persistent

    directory = tmp_path / "xla"
    assert prepare(directory) == []
    stats = dict(cache.cache_stats())
    monkeypatch.setattr(persistent, "_start", {**stats, "misses": stats["misses"] - 2})
    persistent.record_process(str(directory))  # two compiles this process
    (row,) = (directory / persistent.STATS_FILE).read_text().splitlines()
    assert '"compiled": 2' in row and '"loaded": 0' in row

    (directory / persistent.STATS_FILE).unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("kept\n")
    (directory / persistent.STATS_FILE).symlink_to(victim)
    persistent.record_process(str(directory))  # the open fails (ELOOP), and says nothing
    assert victim.read_text() == "kept\n"
