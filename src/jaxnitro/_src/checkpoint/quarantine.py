"""Checkpoints that fail verification: finding the newest one that verifies (`_first_valid`)
and moving the others aside as `<name>.corrupt-<n>` (`move_aside`), kept for inspection."""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

from jaxnitro._src.checkpoint.format import fsync_dir as _fsync_dir
from jaxnitro._src.checkpoint.loading import verify_checkpoint
from jaxnitro._src.checkpoint.messages import _short
from jaxnitro._src.core.errors import CheckpointError

_CORRUPT = (
    ".corrupt-"  # checkpoints that failed verification are moved aside as "<name>.corrupt-<n>"
)
_CORRUPT_RE = re.compile(r"\.corrupt-\d+$")


def _first_valid(root: Path, rows: list[dict]) -> tuple[Path | None, list[tuple[str, Path, str]]]:
    """The newest-written checkpoint of `rows` that verifies (or None), and the (name, path,
    why) of each newer one that did not."""
    # Newest written first, across every run in the directory: resuming continues the
    # run that wrote last, even if an older run reached a higher step.
    order = sorted(
        range(len(rows)), key=lambda i: (rows[i]["time"], rows[i]["step"], i), reverse=True
    )
    skipped: list[tuple[str, Path, str]] = []
    for i in order:
        path = root / rows[i]["path"]
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            why = str(exc).removeprefix(f"checkpoint {path} is ")  # the path is said below
            skipped.append((rows[i]["name"], path, _short(why, 300)))
            continue
        return path, skipped
    return None, skipped


def move_aside(root: Path, names: list[str]) -> dict[str, Path]:
    """Rename each of `names` (plain entries of `root`, already unlisted) to
    `<name>.corrupt-<n>`; return where each one went."""
    moved = {}
    for name in names:
        n = 0
        while (root / f"{name}{_CORRUPT}{n}").exists():
            n += 1
        with contextlib.suppress(OSError):
            os.replace(root / name, root / f"{name}{_CORRUPT}{n}")
            moved[name] = root / f"{name}{_CORRUPT}{n}"
    _fsync_dir(root)
    return moved
