"""The commit a run directory's git work tree is at, read without running anything the
repository chooses.

A repository's own files can name programs that git runs: `core.fsmonitor` on every index
read, clean/smudge filters (`filter.<name>.*`, picked by `.gitattributes`) when a file is
hashed, `diff.external`, `core.pager`, hooks, and any of these through `include.path`. A run
directory inside an unpacked archive or a shared checkout must not get to run them when a
bundle is exported, so:

- the commit is read from the files under `.git` directly (HEAD, loose refs,
  `packed-refs`, worktree and submodule `gitdir:` links); no git process is started for it;
- whether tracked files changed is asked of git, but of a private shadow repository: a
  temporary git directory with our own config (no program in it), that HEAD as a detached
  commit, a copy of the index and the repository's objects as an alternate. The system and
  global configs are off (`GIT_CONFIG_NOSYSTEM`, `GIT_CONFIG_GLOBAL`), the environment holds
  only PATH and git's own settings, and submodules are ignored (git would run `git status`
  inside each one, with that repository's config). The repository's own config, hooks
  and `info/` are never read; a `.gitattributes` that names a filter finds none defined;
- a repository not owned by the current user is not read at all (git's `safe.directory`
  rule), and provenance says so.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

_HEX = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")
_MAX_LINKS = 5  # symbolic refs followed before giving up (git allows 5 too)
_SMALL = 1 << 16  # HEAD, a loose ref, a gitdir link: far less than this
_LARGE = 1 << 28  # packed-refs and the index of a big repository
TIMEOUT_S = 10


def git_state(where: Path) -> dict | None:
    """{"commit", "dirty"} when ``where`` is inside a git work tree, else None.

    ``dirty`` counts tracked files only (run directories are usually untracked), and is None
    when it cannot be told. A repository owned by another user is not read: the result then
    has ``"unread"`` (why) and a None commit.

    Example:
        >>> git_state(Path("runs/MnistMLP"))
        {'commit': '6bb24dc0...', 'dirty': False}
    """
    probe = Path(os.path.abspath(where))
    if not probe.is_dir():
        probe = probe.parent
    found = _discover(probe)
    if found is None:
        return None
    top, gitdir = found
    foreign = _foreign(top, gitdir)
    if foreign is not None:
        return {
            "commit": None,
            "dirty": None,
            "unread": f"{foreign} is owned by another user; its repository was not read "
            f"(git's safe.directory rule)",
        }
    common = _common_dir(gitdir)
    commit = _head_commit(gitdir, common)
    dirty = _dirty(top, gitdir, common, commit) if commit is not None else None
    return {"commit": commit, "dirty": dirty}


# -- finding the repository ---------------------------------------------------------------------
def _discover(start: Path) -> tuple[Path, Path] | None:
    """(work tree top, git dir) of the nearest ``.git`` above ``start``, as git finds it:
    upwards, not across a file-system boundary."""
    try:
        device = start.stat().st_dev
    except OSError:
        return None
    for d in (start, *start.parents):
        try:
            if d.stat().st_dev != device:
                return None
            st = os.lstat(d / ".git")
        except FileNotFoundError:
            continue
        except OSError:
            return None
        if stat.S_ISDIR(st.st_mode):
            gitdir: Path | None = d / ".git"
        elif stat.S_ISREG(st.st_mode):  # a worktree or submodule: "gitdir: <path>"
            gitdir = _gitdir_link(d)
        else:
            gitdir = None
        if gitdir is None or _read(gitdir / "HEAD", _SMALL) is None:
            return None  # not a repository git would use either
        return d, gitdir
    return None


def _gitdir_link(top: Path) -> Path | None:
    text = _read(top / ".git", _SMALL)
    if text is None or not text.startswith("gitdir: "):
        return None
    target = Path(text[len("gitdir: ") :].strip())
    return target if target.is_absolute() else top / target


def _common_dir(gitdir: Path) -> Path:
    """Where the shared refs and objects are (a linked worktree's main git dir)."""
    text = _read(gitdir / "commondir", _SMALL)
    if text is None or not text.strip():
        return gitdir
    target = Path(text.strip())
    return target if target.is_absolute() else gitdir / target


def _foreign(top: Path, gitdir: Path) -> Path | None:
    """The first of the work tree, git dir and common git dir not owned by this user."""
    uid = getattr(os, "geteuid", lambda: None)()
    if uid is None:  # no owners to compare (Windows)
        return None
    for path in (top, gitdir, _common_dir(gitdir)):
        try:
            if path.stat().st_uid != uid:
                return path
        except OSError:
            return path
    return None


# -- the commit ---------------------------------------------------------------------------------
def _head_commit(gitdir: Path, common: Path) -> str | None:
    """The commit HEAD names (following symbolic refs), or None (unborn, reftable, damaged)."""
    text = _read(gitdir / "HEAD", _SMALL)
    for _ in range(_MAX_LINKS):
        if text is None:
            return None
        text = text.strip()
        if _HEX.fullmatch(text):
            return text
        if not text.startswith("ref: "):
            return None
        ref = text[len("ref: ") :].strip()
        if not _safe_ref(ref):
            return None
        # per-worktree refs (HEAD, refs/bisect, refs/worktree) live in the worktree's git dir
        loose = _read(gitdir / ref, _SMALL) or _read(common / ref, _SMALL)
        text = loose if loose is not None else _packed(common, ref)
    return None


def _safe_ref(ref: str) -> bool:
    parts = ref.split("/")
    return (
        ref.startswith("refs/")
        and "\x00" not in ref
        and "\\" not in ref
        and all(p and p not in (".", "..") for p in parts)
    )


def _packed(common: Path, ref: str) -> str | None:
    text = _read(common / "packed-refs", _LARGE)
    for line in (text or "").splitlines():
        if line.startswith(("#", "^")):
            continue
        sha, _, name = line.partition(" ")
        if name == ref:
            return sha
    return None


def _read(path: Path, limit: int) -> str | None:
    """The text of a regular file of at most ``limit`` bytes, or None."""
    data = _read_bytes(path, limit)
    return None if data is None else data.decode("utf-8", "replace")


# -- dirty or not -------------------------------------------------------------------------------
_CONFIG = "[core]\n\trepositoryformatversion = {version}\n\tbare = false\n{extensions}"


def _dirty(top: Path, gitdir: Path, common: Path, commit: str) -> bool | None:
    """Whether a tracked file differs from ``commit``, asked of a shadow repository that holds
    none of the repository's config, hooks or attributes files (see the module doc)."""
    git = shutil.which("git")
    index = gitdir / "index"
    objects = common / "objects"
    if git is None or not objects.is_dir():
        return None
    with tempfile.TemporaryDirectory(prefix="jaxnitro-git-") as tmp:
        shadow = Path(tmp) / "git"
        (shadow / "refs").mkdir(parents=True)
        (shadow / "objects" / "info").mkdir(parents=True)
        (shadow / "objects" / "info" / "alternates").write_text(f"{objects.absolute()}\n")
        (shadow / "HEAD").write_text(f"{commit}\n")
        sha256 = len(commit) == 64
        (shadow / "config").write_text(
            _CONFIG.format(
                version=1 if sha256 else 0,
                extensions="[extensions]\n\tobjectformat = sha256\n" if sha256 else "",
            )
        )
        data = _read_bytes(index, _LARGE)
        if data is None:  # no index (or not a file): git would call every file deleted
            return None
        (shadow / "index").write_bytes(data)
        env = {
            "PATH": os.environ.get("PATH", os.defpath),
            "HOME": tmp,
            "GIT_CONFIG_NOSYSTEM": "1",
            "GIT_CONFIG_GLOBAL": os.devnull,
            "GIT_OPTIONAL_LOCKS": "0",
            "GIT_TERMINAL_PROMPT": "0",
            "LC_ALL": "C",
        }
        argv = [
            git,
            f"--git-dir={shadow}",
            f"--work-tree={top}",
            "-c",
            "core.fsmonitor=false",
            "-c",
            f"core.hooksPath={os.devnull}",
            "status",
            "--porcelain",
            "--untracked-files=no",
            "--ignore-submodules=all",
            "--no-renames",
        ]
        try:
            out = subprocess.run(
                argv,
                cwd=tmp,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                timeout=TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError):
            return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def _read_bytes(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file of at most ``limit`` bytes, or None; never blocks on a
    FIFO or a device planted where a git file should be."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) <= limit else None
