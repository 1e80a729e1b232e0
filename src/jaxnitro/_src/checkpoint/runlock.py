"""One writer per run directory: an exclusive `flock` on `<dir>/.jaxnitro.lock`.

A run writes its log, checkpoints and manifest only while it holds the lock: from the start
of `jn.train` to its end, and around an evaluation that logs. Readers (a handle that loads a
checkpoint and evaluates while a trainer runs) never take it and never write the writer's
files. The lock file holds the holder's pid, host, purpose and start time, so a refusal can
say who holds it. `flock` is released by the kernel when its process dies, so a lock file
left by a killed run is simply taken over (with a warning naming the dead holder).

Locks are per open file description: two handles in one process on the same run directory
(a notebook, a sweep) exclude each other exactly as two processes do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from jaxnitro._src.core.errors import ConfigError, RunLockedError, warn_user

LOCK_NAME = ".jaxnitro.lock"


class RunLock:
    """A re-entrant (per handle) exclusive lock on one directory.

    Example:
        >>> lock = RunLock("runs/mnist")
        >>> lock.acquire("train", what="run directory runs/mnist")
        >>> lock.held
        True
        >>> lock.release()
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._fd: int | None = None
        self._depth = 0

    @property
    def held(self) -> bool:
        return self._fd is not None

    def holder(self) -> dict:
        """What the lock file says about its holder ({} if unreadable)."""
        try:
            info = json.loads(self.path.read_text(encoding="utf-8") or "{}")
        except (OSError, ValueError):
            return {}
        return info if isinstance(info, dict) else {}

    def describe(self) -> str:
        """'process 1234 on host (train, since ...)': who holds (or last held) the lock."""
        return _describe(self.holder())

    def try_acquire(self, purpose: str) -> bool:
        """Take the lock if free; False if another writer holds it. Re-entrant."""
        if self._fd is not None:
            self._depth += 1
            return True
        self.path.parent.mkdir(parents=True, exist_ok=True)
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(
                    f"{self.path} is a symlink; jaxnitro never follows links for "
                    f"files it writes. Remove it."
                ) from e
            raise ConfigError(
                f"cannot open the run lock {self.path}: {e}. Pick a writable run_dir."
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        previous = self.holder()
        if previous.get("pid") is not None and not previous.get("released"):
            who = _describe(previous)
            warn_user(
                f"taking over the run lock {self.path} left by {who}, which is no "
                f"longer running (it did not finish cleanly).",
            )
        info = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "purpose": purpose,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "released": False,
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
        self._fd, self._depth = fd, 1
        return True

    def acquire(self, purpose: str, *, what: str) -> None:
        """Take the lock or raise `RunLockedError` naming the holder and the fixes."""
        if not self.try_acquire(purpose):
            who = _describe(self.holder())
            raise RunLockedError(
                f"{what} is in use by {who}: one writer per run directory, or the logs "
                f"interleave and each run's retention deletes the other's checkpoints. Use "
                f"another run_dir (jn.Nitro(exp, run_dir='runs/other')), or wait for it to "
                f"finish. To evaluate while it trains, load its checkpoint from another "
                f"run_dir: jn.Nitro(exp, run_dir='runs/eval', checkpoint=path)."
            )

    def release(self) -> None:
        if self._fd is None:
            return
        self._depth -= 1
        if self._depth > 0:
            return
        fd, self._fd = self._fd, None
        with contextlib.suppress(OSError):  # mark a clean release: no takeover warning later
            info = self.holder()
            info["released"] = True
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(info).encode(), 0)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _describe(info: dict) -> str:
    if not info.get("pid"):
        return "another writer"
    here = info.get("host") == socket.gethostname() and info.get("pid") == os.getpid()
    who = "another handle in this process" if here else f"process {info['pid']}"
    host = f" on {info['host']}" if info.get("host") and not here else ""
    what = f" ({info['purpose']}, since {info.get('started', '?')})" if info.get("purpose") else ""
    return f"{who}{host}{what}"


class FollowerLock(RunLock):
    """The lock of a process other than 0 in a multi-process run: process 0 holds the real
    one and writes the run's files; this one never touches the directory (`held` stays
    False, so nothing that requires the lock writes)."""

    def try_acquire(self, purpose: str) -> bool:
        return True

    def acquire(self, purpose: str, *, what: str) -> None:
        return None

    def release(self) -> None:
        return None
