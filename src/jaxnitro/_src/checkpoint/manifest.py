"""`manifest.json`, the list of a directory's complete checkpoints: read with every row checked
(a row may only name a plain entry of the directory)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from jaxnitro._src.checkpoint.format import MANIFEST
from jaxnitro._src.checkpoint.messages import _short
from jaxnitro._src.checkpoint.record import _is_int
from jaxnitro._src.core.errors import (
    CheckpointError,
    CheckpointWarning,
    warn_user,
)
from jaxnitro._src.core.jsonable import parse_json


class _BadManifest(Exception):
    """manifest.json cannot be used as it is (the reason is the message)."""


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a row is of type {type(row).__name__!r}, not an object"
    for key in ("epoch", "step"):
        if not _is_int(row.get(key)):
            return f"row {row.get('name')!r}: {key} is {row.get(key)!r}, not an int >= 0"
    metrics = row.get("metrics")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        return f"row {row.get('name')!r}: metrics is not a dict"
    if not isinstance(row.get("time"), str):
        return f"row {row.get('name')!r}: time is not a str"
    return None


def _plain_name(name: Any) -> bool:
    """One ordinary path component: no separators, not '.'/'..', not absolute, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and not any(sep in name for sep in {"/", "\\", os.sep, os.altsep or "/"})
    )


def _is_symlink(path: Path) -> bool:
    try:
        return path.is_symlink()
    except OSError:  # a name too long for the filesystem, say: not a usable entry either
        return True


def _read_rows(root: Path, *, quiet: bool = False) -> tuple[list[dict], int]:
    """(valid rows, number dropped); raises _BadManifest when the file cannot be used at all."""
    path = root / MANIFEST
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError) as exc:
        raise _BadManifest(_short(exc)) from exc
    rows = data.get("checkpoints") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise _BadManifest("no 'checkpoints' list")
    for row in rows:
        if problem := _row_problem(row):
            raise _BadManifest(problem)
    # A row may only name a plain entry of this directory: retention deletes and quarantine
    # renames `root / path`, so '../x', '/abs' or a symlink would reach outside it.
    good: list[dict] = []
    dropped: list[dict] = []
    for r in rows:
        (
            good
            if _plain_name(r.get("name"))
            and r.get("path") == r["name"]
            and not _is_symlink(root / r["name"])
            else dropped
        ).append(r)
    if dropped and not quiet:
        warn_user(
            f"checkpoint manifest {path}: ignoring {len(dropped)} row(s) whose name/path "
            f"is not a plain entry of {root} (e.g. {dropped[0].get('path')!r})",
            CheckpointWarning,
        )
    return good, len(dropped)


def read_manifest(dir: str | os.PathLike) -> list[dict]:
    """Rows of ``<dir>/manifest.json``, oldest first, without loading any array; [] if none.

    Rows that do not name a plain entry of ``dir`` are dropped with a CheckpointWarning.

    Args:
        dir: a checkpointer's directory (`ck.dir`).

    Returns:
        One dict per checkpoint (``name``, ``score``, ``epoch``, ``step``, ``metrics``, ...).

    Raises:
        CheckpointError: the manifest is not of the expected shape.

    Example:
        >>> [(row["name"], row["score"]) for row in jn.read_manifest(ck.dir)]
        [('epoch-0001-step-000100-acc=0.91', 0.91)]
    """
    try:
        return _read_rows(Path(dir))[0]
    except _BadManifest as exc:
        raise CheckpointError(
            f"checkpoint manifest {Path(dir) / MANIFEST} is unreadable ({exc}); "
            "delete it and call TopKCheckpointer.bind(), which rebuilds it from "
            "meta.json files"
        ) from exc
