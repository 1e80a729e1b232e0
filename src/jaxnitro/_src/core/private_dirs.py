"""Directories only this user controls: each component of the path checked, opened safely.

A file this process will trust (a compiled program, a parsed dataset) is only as safe as the
path to it: whoever can write to a directory on the way, or own one, can swap what lies
below. `open_private_dir` walks from `/` a component at a time, each opened relative to its
parent's descriptor with `O_NOFOLLOW`, and accepts a component owned by this user or root
and writable by no one else (on the way, a sticky directory such as `/tmp` is accepted: its
other users cannot rename what is ours; and so is one writable by the user's private group,
which has no one else in it); a symbolic link counts only when this user or root
made it, and is followed under the same rules. The directory itself must be this user's and
writable by no one else. With `create`, what is missing is made 0700 whatever the umask.
POSIX only (`SUPPORTED`); elsewhere `problems` finds none.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
from pathlib import Path

__all__ = ["SUPPORTED", "Problem", "make_private", "open_private_dir", "problems"]

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_MAX_LINKS = 40
SUPPORTED = os.name == "posix" and {os.open, os.stat, os.mkdir, os.readlink, os.unlink} <= (
    os.supports_dir_fd
)


@dataclasses.dataclass(frozen=True)
class Problem:
    """Why a directory is not private to this user, and the command that fixes it ('' when
    there is none but choosing another directory)."""

    why: str
    fix: str = ""


def problems(path: str | os.PathLike) -> list[Problem]:
    """Why others could change what the directory `path` holds (empty when they cannot). A
    path not created yet is checked as far as it exists (it is to be created private).

    Example:
        >>> problems("/tmp/share/xla")  # /tmp/share: another user's sticky directory
        [Problem(why='/tmp/share is owned by another user (uid 1001), who can replace ...')]
    """
    if not SUPPORTED:
        return []
    fd, found = open_private_dir(os.fspath(path), create=False)
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
    fd, found = open_private_dir(os.fspath(path), create=True)
    if fd is not None:
        os.close(fd)
    return found


def open_private_dir(path: str, *, create: bool) -> tuple[int | None, list[Problem]]:
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
    if last:  # the directory itself: this user's, and no one else writes in it
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
                "what is inside it"
            )
        ]
    if st.st_mode & stat.S_IWGRP and not st.st_mode & stat.S_IWOTH and _own_group(st.st_gid):
        others_write = 0  # a user-private group (umask 002 systems): no one else is in it
    if others_write and not st.st_mode & stat.S_ISVTX:
        fix = f"chmod go-w {here}" if st.st_uid == uid else ""
        return [Problem(f"{here} is {what}, so others can replace what is inside it", fix)]
    return []


@functools.cache
def _own_group(gid: int) -> bool:
    """Whether `gid` is this user's private group: the primary group, named as the user,
    with no other member (the convention of systems whose users' umask is 002). Never root's
    group: root is in too many."""
    uid = os.getuid()
    if uid == 0 or gid != os.getgid():
        return False
    try:
        import grp
        import pwd

        name = pwd.getpwuid(uid).pw_name
        group = grp.getgrgid(gid)
    except (ImportError, KeyError):
        return False
    return group.gr_name == name and set(group.gr_mem) <= {name}
