"""What `jaxnitro mcp` trusts: paths under its root, and code from the root or from places
only the server's user (or root) can write.

A client of the server is not trusted with the filesystem: every path it sends (an option, an
experiment field, a TARGET) is resolved and must stay under the root (`confine`), a file it
makes the server read is opened one component at a time without following a link
(`open_inside`, so a link planted after the check is refused too), and a module it names is
imported only from the root or from a place other users cannot write (`vet_module`): never
from the server's working directory, never from a world-writable directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import stat
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from jaxnitro._src.core.errors import ConfigError, clip


class PathError(ConfigError):
    """A path that leaves the server's root (`..`, an absolute path elsewhere, a symlink), or
    code from a place the server does not trust."""


def confine(root: Path, value: str | os.PathLike, *, what: str) -> Path:
    """`value` (relative to `root`, or absolute inside it) resolved; a `PathError` when it
    leaves the root: `..`, an absolute path elsewhere, a symlink pointing out."""
    given = Path(value)
    shown = clip(repr(str(value)))
    if ".." in given.parts:
        raise PathError(
            f"{what} {shown} contains '..'; paths stay under the root {root}. Pass a path "
            f"relative to the root, e.g. 'runs/a'."
        )
    full = given if given.is_absolute() else root / given
    resolved = full.resolve()
    if not resolved.is_relative_to(root):
        why = (
            "is absolute and outside it"
            if given.is_absolute() and not full.is_relative_to(root)
            else f"leads through a symlink to {resolved}"
        )
        raise PathError(
            f"{what} {shown} {why}; every path stays under the root {root} (jaxnitro mcp "
            f"--root DIR). Pass a path relative to the root."
        )
    return resolved


def open_inside(root: Path, value: str | os.PathLike, *, what: str) -> BinaryIO:
    """The regular file `value` under `root`, open for reading. Each component is opened
    relative to its directory with `O_NOFOLLOW`, so a symlink (swapped in after `confine`
    checked the path, or planted to lead out) is refused with a `PathError`, as is anything
    but a regular file (a FIFO would block the server)."""
    parts = confine(root, value, what=what).relative_to(root).parts
    if not parts:
        raise PathError(f"{what} {root} is the root directory, not a file.")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    with _directory(root, parts[:-1], what) as dir_fd:
        try:
            fd = os.open(parts[-1], flags, dir_fd=dir_fd)
        except OSError as e:
            raise PathError(
                f"{what} {Path(value)} cannot be read inside the root {root}: {e.strerror} "
                f"(a symlink is not followed there)."
            ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise PathError(f"{what} {Path(value)} is not a regular file; it is not read.")
    return os.fdopen(fd, "rb")


@contextlib.contextmanager
def _directory(root: Path, parts: tuple[str, ...], what: str) -> Iterator[int]:
    """A descriptor of root/parts..., each step opened without following a link."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            try:
                step = os.open(
                    part, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0), dir_fd=fd
                )
            except OSError as e:
                raise PathError(
                    f"{what}: {part!r} under the root {root} cannot be opened as a directory "
                    f"({e.strerror}; a symlink is not followed there)."
                ) from None
            os.close(fd)
            fd = step
        yield fd
    finally:
        os.close(fd)


def vet_module(root: Path, module_name: str) -> None:
    """Refuse (a `PathError`) to import `module_name` unless its top-level package comes
    from under `root` or from a place only this user or root can write (an installed package,
    the standard library). The server's working directory is never such a place."""
    top = module_name.partition(".")[0]
    if not top.isidentifier():
        return  # the import fails with the usual "no module" message
    if str(root) not in sys.path:
        sys.path.append(str(root))  # after installed packages: a root module shadows none
    module = sys.modules.get(top)
    if module is not None:
        origin = getattr(module, "__file__", None)
        places = [origin] if origin else list(getattr(module, "__path__", []))
    else:
        spec = importlib.util.find_spec(top)  # a top-level name: nothing is imported
        if spec is None:  # the import fails with "no module", unless the cwd has it: say so
            cwd = Path.cwd()
            here = [p for p in (cwd / f"{top}.py", cwd / top / "__init__.py") if p.is_file()]
            places = [str(p) for p in here[:1]]
        else:
            places = list(spec.submodule_search_locations or [])
            if spec.origin and spec.has_location:
                places.append(spec.origin)
    for place in places:
        why = _untrusted(Path(place).resolve(), root)
        if why:
            raise PathError(
                f"module {clip(repr(module_name))} is found at {place}, which {why}. "
                f"jaxnitro mcp imports a module TARGET only from under its root {root} or from "
                f"installed packages; put the module under the root (or pass it as "
                f"path/under/root/file.py:Class)."
            )


def _untrusted(place: Path, root: Path) -> str:
    """Why code at `place` is not to be imported ('' when it may be)."""
    if place.is_relative_to(root):
        return ""
    cwd = Path.cwd().resolve()
    entry = place.parent.parent if place.name == "__init__.py" else place.parent
    if entry == cwd:  # what `python -m` would find first; a shared directory, maybe
        return f"is in the server's working directory {cwd}, outside the root"
    mine = {0, os.geteuid()}
    groups = {0, os.getegid()}
    for i, step in enumerate((place, *place.parents)):
        try:
            st = os.stat(step)
        except OSError:
            continue
        # Above the module's own directory a sticky one (/tmp) is fine: nobody else can
        # rename what is ours in it. The module's directory itself must be ours alone (in a
        # shared one another user could add a package that wins over the module).
        shared_ok = i >= 2 and stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        mode = stat.filemode(st.st_mode)
        if st.st_uid not in mine:
            return f"is owned by another user (uid {st.st_uid}: {step})"
        if st.st_mode & stat.S_IWOTH and not shared_ok:
            return f"other users can write ({step} has mode {mode})"
        if st.st_mode & stat.S_IWGRP and st.st_gid not in groups and not shared_ok:
            return f"the group {st.st_gid} can write ({step} has mode {mode})"
    return ""
