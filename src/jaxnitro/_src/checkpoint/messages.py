"""How a checkpoint failure is told: the first line of an error without TensorStore's spec
JSON, and the one error for a write that failed (with the free space where it went)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from jaxnitro._src.checkpoint.format import Unverified as _Unverified
from jaxnitro._src.core.errors import CheckpointError
from jaxnitro._src.core.units import format_bytes


def _short(exc: BaseException | str, limit: int = 200, *, within: Path | None = None) -> str:
    """First line of an error, without TensorStore's multi-KB spec JSON, at most `limit` chars
    (paths `within` the checkpoint are shortened to "./...": the message names it already)."""
    text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", str(exc), flags=re.S).strip()
    text = text.replace(f"{within}/", "./") if within is not None else text
    text = text.splitlines()[0] if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _write_failed(path: Path, exc: BaseException) -> CheckpointError:
    why = _short(exc) if isinstance(exc, _Unverified) else f"{type(exc).__name__}: {_short(exc)}"
    try:
        free = f"{format_bytes(shutil.disk_usage(path.parent).free)} free"
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"cannot write checkpoint {path} ({why}); {free} on "
        f"{path.parent}. Nothing half-written was kept. Free disk space (or raise the quota), "
        "or pass TopKCheckpointer(dir=) on a larger disk."
    )
