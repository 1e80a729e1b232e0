"""Loggers: a small protocol, and the JSONL logger every run gets by default."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class Logger(Protocol):
    """What the driver calls. Implement these to send a run somewhere else."""

    def open(self, run_dir: Path, *, resume: bool) -> None: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, Any], *, context: str, epoch: int, step: int) -> None: ...
    def log_other(self, values: dict[str, Any]) -> None: ...
    def finish(self, status: str, **info: Any) -> None: ...
    def close(self) -> None: ...


def _clean(value):
    """JSON-safe values: numpy/jax scalars to Python, non-finite floats to null."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if hasattr(value, "__array__") and not isinstance(value, (str, bytes)):
        arr = np.asarray(value)
        return _clean(arr.item() if arr.ndim == 0 else arr.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (int, str, bool)) or value is None:
        return value
    return repr(value)


class JSONLogger:
    """One JSON object per line, appended and flushed per line (`run_dir/metrics.jsonl`).

    Line types: `params`, `metrics` (with `context` = train | validate | data, `epoch`,
    `step`), `other`, `finish` (with `status`). Non-finite numbers are written as `null`.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self._fh = None

    def open(self, run_dir: Path, *, resume: bool) -> None:
        if self.path is None:
            self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_line(self.path)
        self._fh = open(self.path, "a", encoding="utf-8")  # append: a resumed run continues

    def _write(self, obj: dict) -> None:
        if self._fh is None:
            return
        self._fh.write(json.dumps(_clean(obj), allow_nan=False) + "\n")
        self._fh.flush()

    def log_params(self, params: dict[str, Any]) -> None:
        self._write({"type": "params", "time": time.time(), **params})

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        line = {"type": "metrics", "context": context, "epoch": epoch, "step": step, **metrics}
        if all(type(v) is float for v in metrics.values()):  # the per-step train line: fast
            if self._fh is not None:
                for k, v in metrics.items():
                    if not math.isfinite(v):
                        line[k] = None
                self._fh.write(json.dumps(line, allow_nan=False) + "\n")
                self._fh.flush()
            return
        self._write(line)

    def log_other(self, values: dict[str, Any]) -> None:
        self._write({"type": "other", **values})

    def finish(self, status: str, **info) -> None:
        self._write({"type": "finish", "status": status, "time": time.time(), **info})

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _drop_partial_line(path: Path) -> None:
    """A process killed mid-write can leave a last line without its newline; appending to it
    would glue the next record onto the fragment. Cut the fragment off (it is unreadable)."""
    try:
        with open(path, "rb+") as fh:
            size = fh.seek(0, os.SEEK_END)
            if size == 0:
                return
            fh.seek(size - 1)
            if fh.read(1) == b"\n":
                return
            pos, keep = size, 0
            while pos > 0 and not keep:  # find the last newline, reading backwards in blocks
                start = max(0, pos - 65536)
                fh.seek(start)
                block = fh.read(pos - start)
                i = block.rfind(b"\n")
                if i >= 0:
                    keep = start + i + 1
                pos = start
            fh.truncate(keep)
    except FileNotFoundError:
        return


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Read a JSONL log back (one dict per line)."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]
