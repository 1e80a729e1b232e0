"""What the persistent compilation cache trusts: a private path, and entries signed by you.

An entry of JAX's cache is an executable that is loaded and run as it is, so whoever can put
a file where this process reads one can change what it computes. Two guards, both checked
at every load and store (not once at start-up):

1. **The path.** The cache directory and every directory on the way to it must be private
   to this user as `core.private_dirs` checks it (owners, write bits, links, each component
   opened relative to its parent with `O_NOFOLLOW`). A path that fails is not used: the
   program is compiled instead, and the user is told once why.
2. **The entries.** Each entry is written with an HMAC-SHA256 of its key and its bytes,
   under a per-user secret kept in the cache directory (`jaxnitro-key`, 32 random bytes,
   created 0600 with `O_EXCL`; trusted only as a regular, single-linked file of this user
   that no one else can read). An entry that is not this user's regular file, that others
   can write, or whose signature does not match is never deserialized, whatever its owner:
   it is removed, the program compiled (and stored, signed) again, and the user is told once.

The hook is JAX's own factory for its file cache (`compilation_cache.get_file_cache`): for
a directory jaxnitro configured, JAX's `LRUCache` (eviction, file lock, access times) is
wrapped in `SignedCache`; any other directory gets JAX's cache untouched. Only on POSIX
systems: elsewhere the cache is JAX's, as it is.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from typing import Any, cast

from jaxnitro._src.core.errors import warn_user
from jaxnitro._src.core.private_dirs import (
    SUPPORTED,
    Problem,
    make_private,
    open_private_dir,
    problems,
)

__all__ = [
    "KEY_FILE",
    "Problem",
    "SignedCache",
    "guard",
    "make_private",
    "prepare",
    "problems",
    "sign",
]

KEY_FILE = "jaxnitro-key"
_KEY_BYTES = 32
_MAGIC = b"jaxnitro-signed-entry-1\n"
_TAG_BYTES = 32
_ENTRY = "-cache"  # JAX's suffixes: the executable, and its last access time
_ATIME = "-atime"
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no FIFO blocks
STATS_FILE = "jaxnitro-stats.jsonl"  # persistent's record of hit rates, beside the entries


# -- the directory ------------------------------------------------------------------------


def prepare(path: str | os.PathLike) -> list[Problem]:
    """`make_private(path)` for a cache directory, and its signing key made. Returns why
    the cache must not be used (empty: it may)."""
    if not SUPPORTED:
        return make_private(path)
    fd, found = open_private_dir(os.fspath(path), create=True)
    if fd is None:
        return found
    try:
        _sweep(fd, os.fspath(path))
        _secret(fd, os.fspath(path))
    except OSError as e:
        return [Problem(f"its key {KEY_FILE} cannot be made ({e.strerror})")]
    finally:
        os.close(fd)
    return []


def _sweep(dir_fd: int, directory: str) -> None:
    """Remove the cache's files that are not this user's single-linked regular files: left
    by whoever could write here before the directory was private. Unread, since a planted
    FIFO would block a read (JAX's eviction reads every access time) and another user's
    `.lockfile` could be held forever."""
    removed = []
    for name in os.listdir(dir_fd):
        if not (name.endswith((_ENTRY, _ATIME)) or name in (".lockfile", STATS_FILE)):
            continue
        with contextlib.suppress(FileNotFoundError):
            why = _file_problem(os.stat(name, dir_fd=dir_fd, follow_symlinks=False))
            if why is not None and not why.startswith("others can write"):
                os.unlink(name, dir_fd=dir_fd)
                removed.append((name, why))
    if removed:
        name, why = removed[0]
        more = f", and {len(removed) - 1} other file(s) not yours" if len(removed) > 1 else ""
        done = "they were removed unread" if more else "it was removed unread"
        _say_refused(directory, f"{name}: {why}{more}", done)


# -- the key and the signature ------------------------------------------------------------


def sign(secret: bytes, key: str, payload: bytes) -> bytes:
    """The bytes stored for JAX's entry `payload` under cache key `key`."""
    return _MAGIC + _tag(secret, key, memoryview(payload)) + payload


def _tag(secret: bytes, key: str, payload: memoryview) -> bytes:
    mac = hmac.new(secret, key.encode() + b"\0", hashlib.sha256)  # the key too: no swaps
    mac.update(payload)
    return mac.digest()


def _unsign(secret: bytes, key: str, raw: bytes) -> tuple[bytes | None, str]:
    """JAX's entry inside `raw`, or None and why it is refused."""
    if not raw.startswith(_MAGIC):
        return None, (
            "it is not signed with your cache key (something other than your jaxnitro wrote "
            "it: plain JAX, another user, or an older jaxnitro)"
        )
    view = memoryview(raw)
    tag, payload = view[len(_MAGIC) : len(_MAGIC) + _TAG_BYTES], view[len(_MAGIC) + _TAG_BYTES :]
    if not hmac.compare_digest(bytes(tag), _tag(secret, key, payload)):
        return None, (
            "its signature does not match your cache key (it was changed, copied from "
            "another entry, or signed with someone else's key)"
        )
    return bytes(payload), ""


def _secret(dir_fd: int, directory: str) -> bytes:
    """This user's signing key in the cache directory `dir_fd`, made on first use. A key
    file that cannot be trusted is replaced (entries signed with it compile again)."""
    uid = os.getuid()
    for _ in range(500):
        try:
            fd = os.open(KEY_FILE, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
        except FileNotFoundError:
            _make_secret(dir_fd)
            continue
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            _replace_secret(dir_fd, directory, "it is a symbolic link")
            continue
        being_written = False
        try:
            st = os.fstat(fd)
            why = _key_problem(st, uid)
            if why is None:
                data = os.read(fd, _KEY_BYTES + 1)
                if len(data) == _KEY_BYTES:
                    return data
                why = f"it holds {len(data)} bytes, not {_KEY_BYTES}"
                being_written = len(data) < _KEY_BYTES and time.time() - st.st_mtime < 5
        finally:
            os.close(fd)
        if being_written:  # by another process of ours, just now
            time.sleep(0.01)
            continue
        _replace_secret(dir_fd, directory, why)
    raise OSError(errno.EAGAIN, f"the cache key {KEY_FILE} kept changing")


def _key_problem(st: os.stat_result, uid: int) -> str | None:
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != uid:
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o077:
        return f"others may read or write it (mode {stat.S_IMODE(st.st_mode):o})"
    if st.st_nlink != 1:
        return "it has other names (hard links)"
    return None


def _make_secret(dir_fd: int) -> None:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW
    try:
        fd = os.open(KEY_FILE, flags, 0o600, dir_fd=dir_fd)
    except FileExistsError:  # another process made it first: read theirs
        return
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, secrets.token_bytes(_KEY_BYTES))
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_secret(dir_fd: int, directory: str, why: str) -> None:
    _say_once(
        ("key", directory),
        f"the compilation cache key {os.path.join(directory, KEY_FILE)} was not used: {why}. "
        "A new key was made; entries signed with the old one are compiled again.",
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(KEY_FILE, dir_fd=dir_fd)


# -- the cache JAX uses -------------------------------------------------------------------


class SignedCache:
    """JAX's file cache (`base`, an `LRUCache`) behind both guards: the path is re-checked
    and the entry's owner, mode and signature verified before a single byte of it is
    deserialized; stores are signed. Implements JAX's `CacheInterface` (get/put)."""

    def __init__(self, directory: str, base: Any) -> None:
        self._directory = directory
        self._base = base
        self._path = base._path  # JAX logs it on reset

    def get(self, key: str) -> bytes | None:
        fd = self._open()
        if fd is None:
            return None
        try:
            why = _entry_problem(fd, key)
            if why == "":
                return None
            if why is None:  # this user's private file: now its signature
                raw = self._base.get(key)
                if raw is None:
                    return None
                payload, why = _unsign(_secret(fd, self._directory), key, raw)
                if payload is not None:
                    return payload
            self._refuse(fd, key, why)
            return None
        finally:
            os.close(fd)

    def put(self, key: str, value: bytes) -> None:
        fd = self._open()
        if fd is None:
            return
        try:
            self._base.put(key, sign(_secret(fd, self._directory), key, value))
            for name in (key + _ENTRY, key + _ATIME):  # private whatever the umask
                _make_private(fd, name)
        finally:
            os.close(fd)

    def _open(self) -> int | None:
        fd, found = open_private_dir(self._directory, create=False)
        if fd is None:
            found = found or [Problem("it was removed")]
            warn_not_used(self._directory, found, since_start=False)
        return fd

    def _refuse(self, fd: int, key: str, why: str) -> None:
        for name in (key + _ENTRY, key + _ATIME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        _say_refused(self._directory, f"{key}{_ENTRY}: {why}", "it was not loaded but removed")


def _say_refused(directory: str, what: str, done: str) -> None:
    _say_once(
        ("entry", directory),
        f"jaxnitro refused an entry of the compilation cache {directory} ({what}). It could "
        "be a program someone planted there (anyone who can write to that directory, now or "
        f"before it was made private, could have), so {done}, and the program is compiled "
        f"again. Only entries signed with your key ({KEY_FILE} in that directory) are "
        "loaded. This is said once per process; `jaxnitro cache clear` empties the cache.",
    )


def _entry_problem(dir_fd: int, key: str) -> str | None:
    """'' when there is no entry for `key`; why it must not be read; None: read it."""
    try:
        return _file_problem(os.stat(key + _ENTRY, dir_fd=dir_fd, follow_symlinks=False))
    except FileNotFoundError:
        return ""


def _file_problem(st: os.stat_result) -> str | None:
    """Why a file of the cache (stat'ed without following links) is not to be read."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_nlink != 1:
        return "it has other names (hard links)"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return "others can write to it"
    return None


def _make_private(dir_fd: int, name: str) -> None:
    try:
        fd = os.open(name, os.O_RDONLY | _NOFOLLOW, dir_fd=dir_fd)
    except OSError:  # not written (too large, or already there): nothing to do
        return
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & 0o700)
    finally:
        os.close(fd)


_guarded: set[str] = set()


def guard(directory: str) -> bool:
    """Have JAX build its cache for `directory` as a `SignedCache` (from then on, in this
    process). False when this JAX has no such hook: then the cache must not be used."""
    if not SUPPORTED:
        return True
    try:
        from jax._src import compilation_cache
        from jax._src.lru_cache import LRUCache
    except ImportError:  # pragma: no cover - a JAX without them
        return False
    original = getattr(compilation_cache, "get_file_cache", None)
    if original is None:  # pragma: no cover - a JAX that builds its cache otherwise
        return False
    _guarded.add(os.path.abspath(directory))
    if getattr(original, "_jaxnitro", False):
        return True

    def get_file_cache(path: str) -> tuple[Any, str] | None:
        if os.path.abspath(path) not in _guarded:
            return original(path)
        from jax._src import config

        cache = SignedCache(path, LRUCache(path, max_size=config.compilation_cache_max_size.value))
        if config.compilation_cache_check_contents.value:
            return compilation_cache.VerificationCache(cast(Any, cache)), path
        return cache, path

    get_file_cache._jaxnitro = True  # type: ignore[attr-defined]
    compilation_cache.get_file_cache = get_file_cache
    return True


# -- telling the user ---------------------------------------------------------------------

_said: set = set()
_said_lock = threading.Lock()


def _say_once(what: tuple, message: str) -> None:
    with _said_lock:
        if what in _said:
            return
        _said.add(what)
    warn_user(message)


def warn_not_used(directory: str, found: list[Problem], *, since_start: bool = True) -> None:
    """Say once per directory why the cache there is not used, and the fix."""
    why = " and ".join(p.why for p in found)
    fixes = [p.fix for p in found if p.fix]
    how = f"Make it private to you ({'; '.join(fixes)}), or p" if fixes else "P"
    when = "is not used" if since_start else "is not used from now on"
    _say_once(
        ("path", directory),
        f"the compilation cache {directory} {when}: {why}. Its entries are executables this "
        "process would run, so anyone who can write there, or replace a directory on the way "
        f"to it, could change what it computes. {how}oint JAXNITRO_COMPILATION_CACHE (or "
        "jn.setup_devices(compilation_cache=...)) at a directory only you can write to; "
        "programs are compiled without it meanwhile.",
    )
