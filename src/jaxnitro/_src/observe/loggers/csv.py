"""`jn.CSVLogger`: every metrics line as a row of `run_dir/metrics.csv` (stdlib csv)."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.core.jsonable import jsonable

#: The first columns of every jaxnitro CSV log; the metrics follow in first-seen order.
COLUMNS = ("context", "epoch", "step")


class CSVLogger:
    """One row per `log_metrics` call in `path` (default `run_dir/metrics.csv`): `context`
    (train | validate | data), `epoch`, `step`, then one column per metric name, in the order
    the names first appeared (a `jn.evaluate` row also fills `split`). Read it with
    `csv.DictReader` or `pandas.read_csv`.

    Cells: numbers as written by Python, None and non-finite numbers empty, anything else
    (an array such as a confusion matrix) as JSON text. A metric name that appears later
    (the validation columns after the first train rows) adds a column: the file is rewritten
    once with the wider header (atomically, via a temporary file). A resume appends, and
    first drops the rows a killed run wrote after the checkpoint it resumes from, so the file
    reads as one straight run. A file at `path` that is not a jaxnitro CSV log is refused
    (`ConfigError`), never overwritten.

    Example:
        >>> n = jn.Nitro(MnistMLP(), logger=[jn.JSONLogger(), jn.CSVLogger()])
        >>> rows = list(csv.DictReader(open("runs/MnistMLP/metrics.csv")))
        >>> rows[0]["context"], rows[0]["loss"]
        ('train', '2.2915')
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self._named = path is not None  # else the run dir's, at each open
        self._fh: Any = None
        self._writer: Any = None
        self.columns: list[str] = []

    def open(self, run_dir: Path, *, resume: bool) -> None:
        if self._fh is not None:
            return
        path = self.path if self.path is not None and self._named else None
        self.path = path = path or Path(run_dir) / "metrics.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or (path.exists() and not path.is_file()):
            raise ConfigError(
                f"{path} is a link or not a regular file; pass CSVLogger(path=) a file path."
            )
        self.columns = self._header()
        self._append()

    def _header(self) -> list[str]:
        """The columns of an existing log ([] for a new or empty file)."""
        assert self.path is not None
        if not self.path.exists() or self.path.stat().st_size == 0:
            return []
        with open(self.path, newline="", encoding="utf-8") as fh:
            header = next(csv.reader(fh), [])
        if tuple(header[: len(COLUMNS)]) != COLUMNS:
            raise ConfigError(
                f"{self.path} exists and is not a jaxnitro CSV log (its header does not start "
                f"with {','.join(COLUMNS)}); pass CSVLogger(path=) another path. jaxnitro never "
                f"overwrites a file it did not write."
            )
        return header

    def _append(self) -> None:
        assert self.path is not None
        self._fh = open(self.path, "a", newline="", encoding="utf-8")
        if self._fh.tell() > 0:
            with open(self.path, "rb") as raw:  # a kill cut the last row: end it
                raw.seek(-1, os.SEEK_END)
                if raw.read(1) != b"\n":
                    self._fh.write("\n")
        self._writer = csv.DictWriter(self._fh, fieldnames=self.columns, restval="")
        if not self.columns:
            self.columns[:] = COLUMNS
            self._writer.writeheader()
        self._fh.flush()

    def _rewrite(self, columns: list[str], keep=lambda row: True) -> None:
        """The file again with `columns` as its header, keeping the rows `keep` accepts."""
        assert self.path is not None
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(self.path, newline="", encoding="utf-8") as src:
            with open(tmp, "w", newline="", encoding="utf-8") as dst:
                writer = csv.DictWriter(dst, fieldnames=columns, restval="", extrasaction="ignore")
                writer.writeheader()
                writer.writerows(row for row in csv.DictReader(src) if keep(row))
                dst.flush()
                os.fsync(dst.fileno())
        os.replace(tmp, self.path)
        self.columns = list(columns)
        self._append()

    def log_params(self, params: dict[str, Any]) -> None:
        pass  # metrics only: the params line is in metrics.jsonl

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        if self._fh is None:
            return
        new = [k for k in map(str, metrics) if k not in self.columns and k not in COLUMNS]
        if new:
            self._rewrite(self.columns + new)
        row = {str(k): _cell(v) for k, v in metrics.items() if str(k) not in COLUMNS}
        self._writer.writerow({"context": context, "epoch": epoch, "step": step, **row})
        self._fh.flush()

    def log_other(self, values: dict[str, Any]) -> None:
        cut = values.get("from_step")
        if self._fh is not None and values.get("key") == "resumed" and isinstance(cut, int):
            self._rewrite(self.columns, keep=lambda row: _step(row) <= cut)

    def flush(self) -> None:
        """Hand the rows written so far to the OS (each row already is, as it is written)."""
        if self._fh is not None:
            self._fh.flush()

    def finish(self, status: str, **info: Any) -> None:
        self.flush()

    def close(self) -> None:
        fh, self._fh, self._writer = self._fh, None, None
        if fh is not None:
            fh.close()


def _cell(value: Any) -> Any:
    """A metric's CSV cell: a number as is, None and NaN/inf empty, other values JSON text."""
    if isinstance(value, str):
        return value
    plain = jsonable(value)  # 0-d arrays as numbers, non-finite floats as None
    if plain is None:
        return ""
    if isinstance(plain, (bool, int, float)):
        return plain
    return json.dumps(plain, allow_nan=False)


def _step(row: dict) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0
