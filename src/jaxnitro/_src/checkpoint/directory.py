"""The checkpoint directory itself: created writable, refused when it holds what jaxnitro did
not put there, and cleared of the temp entries of writers that are gone."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from jaxnitro._src.checkpoint.format import LOCK, MANIFEST, META
from jaxnitro._src.checkpoint.format import TMP as _TMP
from jaxnitro._src.checkpoint.format import WRITING as _WRITING
from jaxnitro._src.checkpoint.manifest import _BadManifest, _read_rows
from jaxnitro._src.checkpoint.quarantine import _CORRUPT, _CORRUPT_RE
from jaxnitro._src.core.errors import CheckpointError

_TMP_RE = re.compile(r"\.tmp-(\d+)$")


def _pid_alive(pid: int) -> bool:
    if os.name != "posix" or pid <= 0:
        return True  # unknown: keep (os.kill(pid, 0) would terminate a process on Windows)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: alive, owned by another user
        return True
    return True


def _is_stale_temp(entry: Path) -> bool:
    """A `<name>.tmp-<pid>` entry whose writer is gone (dead process, or an earlier one of ours)."""
    m = _TMP_RE.search(entry.name)
    if not m:
        return False
    pid = int(m.group(1))
    if pid == os.getpid():  # a previous process with our pid (a restarted container)
        return str(entry) not in _WRITING
    return not _pid_alive(pid)


def _complete_dirs(root: Path) -> list[Path]:
    """Finished checkpoint directories on disk (no temp entry, none moved aside, no symlink)."""
    if not root.is_dir():
        return []
    return [
        p
        for p in sorted(root.iterdir())
        if _TMP not in p.name
        and _CORRUPT not in p.name
        and not p.is_symlink()
        and (p / META).is_file()
    ]


def _allowed_entry(entry: Path, listed: set[str]) -> bool:
    """Whether `entry` is something jaxnitro puts in a checkpoint directory."""
    name = entry.name
    if name in (MANIFEST, LOCK) or _TMP_RE.search(name) or _CORRUPT_RE.search(name):
        return True
    if name.startswith(".nfs"):  # NFS keeps deleted-but-open files of ours under this name
        return True
    return (
        not entry.is_symlink() and entry.is_dir() and (name in listed or (entry / META).is_file())
    )


def _prepare_dir(d: Path) -> None:
    """Create the checkpoint directory `d` writable, refuse foreign content in it, and drop
    the temp entries of writers that are gone (live writers' entries stay)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"cannot create checkpoint directory {d} ({exc}); pass a writable dir="
        ) from exc
    if not os.access(d, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint directory {d} is not writable; fix its permissions or pass dir="
        )
    try:
        listed = {r["name"] for r in _read_rows(d, quiet=True)[0]}
    except _BadManifest:
        listed = set()
    foreign = sorted(
        e.name + "/" * e.is_dir() for e in d.iterdir() if not _allowed_entry(e, listed)
    )
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise CheckpointError(
            f"checkpoint directory {d} holds entries jaxnitro did not create: "
            f"{', '.join(map(repr, foreign[:3]))}{more}. Retention deletes inside it, so "
            f"pass an empty or new dir= (e.g. {d / 'checkpoints'}) or a run's checkpoints "
            "directory."
        )
    for entry in d.iterdir():  # leftovers of killed writers
        if _is_stale_temp(entry):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
