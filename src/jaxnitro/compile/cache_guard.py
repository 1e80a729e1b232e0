"""What the persistent compilation cache trusts: a private path, and entries signed by you.

An entry of JAX's cache is an executable that is loaded and run as it is, so whoever can put
a file where this process reads one can change what it computes. Two guards, both checked
at every load and store (not once at start-up):

1. **The path.** Every component from `/` to the cache directory is opened relative to its
   parent's descriptor with `O_NOFOLLOW`, and must be owned by this user or root and
   writable by no one else (a sticky directory such as `/tmp` excepted above the cache: its
   other users cannot rename what is ours). A symbolic link on the way counts only when this
   user or root made it; it is followed component by component under the same rules. The
   cache directory itself must be this user's and writable by no one else. A path that
   fails is not used: the program is compiled instead, and the user is told once why.
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
import dataclasses
import errno
import hashlib
import hmac
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Any, cast

from jaxnitro.core.errors import warn_user

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
_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # no FIFO blocks
STATS_FILE = "jaxnitro-stats.jsonl"  # persistent's record of hit rates, beside the entries
_MAX_LINKS = 40
SUPPORTED = os.name == "posix" and {os.open, os.stat, os.mkdir, os.readlink, os.unlink} <= (
    os.supports_dir_fd
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a cache path is not trusted, and the command that fixes it ('' when there is
    none but choosing another directory)."""

    why: str
    fix: str = ""


# -- the path -----------------------------------------------------------------------------


def problems(path: str | os.PathLike) -> list[Problem]:
    """Why others could plant programs in the cache at `path` (empty when they cannot). A
    path not created yet is checked as far as it exists: it is created private when used.

    Example:
        >>> problems("/tmp/share/xla")  # /tmp/share: another user's sticky directory
        [Problem(why='/tmp/share is owned by another user (uid 1001), ...', fix='')]
    """
    if not SUPPORTED:
        return []
    fd, found = _open_dir(os.fspath(path), create=False)
    if fd is not None:
        os.close(fd)
    return found


def make_private(path: str | os.PathLike) -> list[Problem]:
    """Create the directory `path` and what is missing above it, each 0700 whatever the
    umask, and check every component; returns why others could change what it holds."""
    if not SUPPORTED:
        try:
            os.makedirs(path, mode=0o700, exist_ok=True)
        except OSError as e:
            return [Problem(f"it cannot be created ({e.strerror})")]
        return []
    fd, found = _open_dir(os.fspath(path), create=True)
    if fd is not None:
        os.close(fd)
    return found


def prepare(path: str | os.PathLike) -> list[Problem]:
    """`make_private(path)` for a cache directory, and its signing key made. Returns why
    the cache must not be used (empty: it may)."""
    if not SUPPORTED:
        return make_private(path)
    fd, found = _open_dir(os.fspath(path), create=True)
    if fd is None:
        return found
    try:
        _sweep(fd)
        _secret(fd, os.fspath(path))
    except OSError as e:
        return [Problem(f"its key {KEY_FILE} cannot be made ({e.strerror})")]
    finally:
        os.close(fd)
    return []


def _sweep(dir_fd: int) -> None:
    """Remove the cache's files that are not this user's single-linked regular files: left
    by whoever could write here before the directory was private. Unread, since a planted
    FIFO would block a read (JAX's eviction reads every access time) and another user's
    `.lockfile` could be held forever."""
    uid = os.getuid()
    for name in os.listdir(dir_fd):
        if not (name.endswith((_ENTRY, _ATIME)) or name in (".lockfile", STATS_FILE)):
            continue
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid or st.st_nlink != 1:
                os.unlink(name, dir_fd=dir_fd)


def _open_dir(path: str, *, create: bool) -> tuple[int | None, list[Problem]]:
    """A descriptor of the directory `path` reached through trusted components only (the
    caller closes it), or None and why not. With `create`, missing directories are made
    0700; without, a missing one ends the walk with nothing found against it."""
    walk = _Walk(path, create=create)
    try:
        found = walk.run()
    except OSError as e:
        found = [Problem(f"{walk.here}: {e.strerror or e}")]
    if found is None:
        fd, walk.fd = walk.fd, -1
        return fd, []
    walk.close()
    return None, found


class _Walk:
    """One walk from `/` to a directory, a component at a time, each opened relative to
    its parent's descriptor (`fd`, the directory reached so far: `here`)."""

    def __init__(self, path: str, *, create: bool) -> None:
        self.uid = os.getuid()
        self.create = create
        self.todo = list(reversed(Path(os.path.abspath(path)).parts[1:]))  # next on top
        self.here, self.links, self.made = "/", 0, False
        self.fd = os.open("/", _DIR_FLAGS)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def run(self) -> list[Problem] | None:
        """None when `fd` is the directory, trusted; else why not ([] for missing)."""
        while self.todo:
            name = self.todo.pop()
            if name in ("", "."):
                continue
            step = os.path.dirname(self.here) if name == ".." else os.path.join(self.here, name)
            try:
                st = os.stat(name, dir_fd=self.fd, follow_symlinks=False)
            except FileNotFoundError:
                found = self._make(name, step)
            else:
                if stat.S_ISLNK(st.st_mode):
                    found = self._follow(name, step, st)
                elif stat.S_ISDIR(st.st_mode):
                    found = self._enter(name, step, st)
                else:
                    found = [Problem(f"{step} is not a directory")]
            if found is not None:
                return found
        return None

    def _make(self, name: str, step: str) -> list[Problem] | None:
        if not self.create:
            return []
        try:
            os.mkdir(name, 0o700, dir_fd=self.fd)
            self.made = True
        except FileExistsError:  # a concurrent process made it
            pass
        except OSError as e:
            return [Problem(f"{step} cannot be created ({e.strerror})")]
        self.todo.append(name)  # now enter it
        return None

    def _follow(self, name: str, step: str, st: os.stat_result) -> list[Problem] | None:
        if st.st_uid not in (self.uid, 0):
            return [Problem(f"{step} is a symbolic link another user (uid {st.st_uid}) made")]
        self.links += 1
        if self.links > _MAX_LINKS:
            return [Problem(f"{step}: too many levels of symbolic links")]
        target = Path(os.readlink(name, dir_fd=self.fd))
        if target.is_absolute():  # from the root again
            self.close()
            self.here, self.fd = "/", os.open("/", _DIR_FLAGS)
        self.todo.extend(reversed(target.parts[1:] if target.is_absolute() else target.parts))
        return None

    def _enter(self, name: str, step: str, st: os.stat_result) -> list[Problem] | None:
        child = os.open(name, _DIR_FLAGS, dir_fd=self.fd)
        self.close()
        self.fd, self.here = child, step
        if self.made:  # ours, just made: private whatever the umask
            os.fchmod(child, 0o700)
            self.made = False
        now = os.fstat(child)
        if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
            return [Problem(f"{step} was replaced while it was checked")]
        return _component_problems(now, step, self.uid, last=not self.todo) or None


def _component_problems(st: os.stat_result, here: str, uid: int, *, last: bool) -> list[Problem]:
    others_write = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    what = "world-writable" if st.st_mode & stat.S_IWOTH else "group-writable"
    if last:  # the cache directory itself: this user's, and no one else writes in it
        found = []
        if st.st_uid != uid:
            found.append(f"it is owned by another user (uid {st.st_uid})")
        if others_write:
            found.append(f"it is {what}")
        fix = f"chmod 700 {here}" if st.st_uid == uid else ""
        return [Problem(" and ".join(found), fix)] if found else []
    if st.st_uid not in (uid, 0):
        return [
            Problem(
                f"{here} is owned by another user (uid {st.st_uid}), who can replace "
                "the cache inside it"
            )
        ]
    if others_write and not st.st_mode & stat.S_ISVTX:
        fix = f"chmod go-w {here}" if st.st_uid == uid else ""
        return [Problem(f"{here} is {what}, so others can replace the cache inside it", fix)]
    return []


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
        fd, found = _open_dir(self._directory, create=False)
        if fd is None:
            found = found or [Problem("it was removed")]
            warn_not_used(self._directory, found, since_start=False)
        return fd

    def _refuse(self, fd: int, key: str, why: str) -> None:
        for name in (key + _ENTRY, key + _ATIME):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
        _say_once(
            ("entry", self._directory),
            f"jaxnitro refused an entry of the compilation cache {self._directory} "
            f"({key}{_ENTRY}): {why}. It could be a program someone planted there (anyone "
            "who can write to that directory, now or before it was made private, could "
            "have), so it was not loaded: it was removed and the program compiled again. "
            f"Only entries signed with your key ({KEY_FILE} in that directory) are loaded. "
            "This is said once per process; `jaxnitro cache clear` empties the cache.",
        )


def _entry_problem(dir_fd: int, key: str) -> str | None:
    """'' when there is no entry for `key`; why it must not be read; None: read it."""
    try:
        st = os.stat(key + _ENTRY, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return ""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    if st.st_uid != os.getuid():
        return f"it belongs to another user (uid {st.st_uid})"
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
