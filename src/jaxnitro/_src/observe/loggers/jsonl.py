"""The JSONL logger every run gets by default: `run_dir/metrics.jsonl`, and reading it back."""

from __future__ import annotations

import errno
import itertools
import json
import math
import os
import shutil
import stat
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxnitro._src.core.errors import ConfigError, JaxnitroError, warn_user
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.observe.loggers.rows import step_rows

try:  # a dependency: the step lines of a read-back chunk encode ~20x faster than with json
    import orjson as _orjson
except ImportError:  # pragma: no cover - the json module writes the same content
    _orjson = None  # type: ignore[assignment]


class LogWriteError(JaxnitroError, OSError):
    """The metrics log could not be opened or written (disk full, read-only, ...).

    `open()` raises it; a failed write during training is not raised but kept as
    `JSONLogger.error` and reported once as a `LogWarning` (losing log lines is better than
    losing the run). `errno` is the original error's, `path` the log's path."""

    def __init__(self, message: str, *, path: Path | None = None, cause: OSError | None = None):
        super().__init__(message)
        self.path = path
        if cause is not None:
            self.errno = cause.errno  # str() stays `message`: strerror and filename stay unset


class LogWarning(UserWarning):
    """A metrics log line could not be written (the run goes on), or could not be read back."""


#: The `type` of every line jaxnitro writes; a file whose first line has one is a jaxnitro log.
LINE_TYPES = ("params", "metrics", "other", "finish")
# "type" comes first in every line jaxnitro writes: a cut first line still shows it (json.dumps
# writes `"type": `, orjson, which writes the step lines when installed, `"type":`).
_PREFIXES = tuple(f'{{"type":{sep}"{t}"'.encode() for t in LINE_TYPES for sep in (" ", ""))
# json.dumps(allow_nan=False) builds an encoder per call: the step lines reuse one
_ENCODE = json.JSONEncoder(allow_nan=False).encode
_HEAD_BYTES = 1 << 20  # how much of an existing file's start is read to recognise it
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class JSONLogger:
    """One JSON object per line, appended and flushed per line (`run_dir/metrics.jsonl`).

    Line types: `params`, `metrics` (with `context` = train | validate | data | epoch, `epoch`,
    `step`), `other` (`log_resumed` writes one with `"key": "resumed"`), `finish` (with
    `status`). Non-finite numbers are written as `null`.

    Safety rules:
    - The log is never written through a symbolic link (`O_NOFOLLOW`): a link is a
      `ConfigError`.
    - An existing non-empty file is appended to only if it is a jaxnitro log (its first
      line is one of `LINE_TYPES`); anything else is a `ConfigError`. Nothing is ever
      truncated or rewritten: when the file's last line was cut by a kill, `open()` appends a
      newline first, so the fragment stays a line of its own that `read_jsonl` skips.
    - A failed write (disk full, ...) never stops training: the first one is warned about
      once (`LogWarning`, naming the path and the free space) and kept as `self.error` (a
      `LogWriteError`); later lines are dropped until the logger is opened again.
      `finish()` and `close()` never raise.

    `finish()` does not close the file (a run can train again); `close()` does, and may be
    called any number of times; `open()` after `close()` appends again. As a context
    manager the logger is closed on exit (and opened on entry when it was given a `path`).

    Example:
        >>> with jn.JSONLogger("/tmp/run/metrics.jsonl") as log:
        ...     log.log_metrics({"loss": 0.5}, context="train", epoch=1, step=10)
        >>> jn.read_jsonl("/tmp/run/metrics.jsonl")[-1]["loss"]
        0.5
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path is not None else None
        self._fh = None
        self.error: LogWriteError | None = None

    # -- lifecycle ---------------------------------------------------------------------
    def open(self, run_dir: Path, *, resume: bool) -> None:
        if self._fh is not None:  # already open: a second open() is a no-op
            return
        if self.path is None:
            self.path = Path(run_dir) / "metrics.jsonl"
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = _open_append(self.path)  # append: a resumed run continues
        except OSError as e:
            raise LogWriteError(
                f"cannot open the metrics log {self.path}: {e} ({_free(self.path)}). Pass "
                "JSONLogger(path=) a writable location, or another run_dir.",
                path=self.path,
                cause=e,
            ) from e
        self.error = None

    def close(self) -> None:
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            fh.close()  # unbuffered: nothing is left to flush, the descriptor is released
        except OSError as e:
            self._failed(e)

    def __enter__(self) -> JSONLogger:
        if self._fh is None and self.path is not None:
            self.open(self.path.parent, resume=True)
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- writing -----------------------------------------------------------------------
    def _emit(self, text: str | bytes) -> None:
        fh = self._fh
        if fh is None:  # not open, closed, or broken by a failed write
            return
        data = text if isinstance(text, bytes) else text.encode()
        try:
            n = fh.write(data)
            while n is not None and n < len(data):  # a short write: the disk is nearly full
                k = fh.write(memoryview(data)[n:])
                if not k:
                    raise OSError(errno.EIO, "the write made no progress")
                n += k
        except OSError as e:
            self._failed(e)

    def _failed(self, e: OSError) -> None:
        """Drop the handle and warn once; the run goes on without its log."""
        fh, self._fh = self._fh, None
        if fh is not None:
            try:
                fh.close()
            except OSError:
                pass
        if self.error is not None:
            return
        self.error = LogWriteError(
            f"could not write the metrics log {self.path}: {e!r} ({_free(self.path)}). "
            "Training goes on; later log lines are not written. Free some space and resume "
            "(or call logger.open() again) to log again.",
            path=self.path,
            cause=e,
        )
        warn_user(str(self.error), LogWarning)

    def _write(self, obj: dict) -> None:
        if self._fh is None:
            return
        self._emit(json.dumps(jsonable(obj), allow_nan=False) + "\n")

    def log_params(self, params: dict[str, Any]) -> None:
        self._write({"type": "params", "time": time.time(), **params})

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        line = {"type": "metrics", "context": context, "epoch": epoch, "step": step, **metrics}
        if (
            type(step) is int
            and type(epoch) is int
            and all(type(v) is float for v in metrics.values())
        ):  # per-step train line
            if self._fh is not None:
                for k, v in metrics.items():
                    if not math.isfinite(v):
                        line[k] = None
                self._emit(json.dumps(line, allow_nan=False) + "\n")
            return
        self._write(line)

    def log_step_columns(
        self,
        names: Sequence[str],
        lists: Sequence[Sequence[Any]],
        extra: Mapping[str, Any],
        *,
        context: str,
        epoch: int,
        steps: Sequence[int],
    ) -> None:
        """The lines `log_step_rows(step_rows(names, lists, extra), ...)` would write, byte
        for byte, encoded from the columns (the training loop's chunks without a schedule):
        no row dict per step. Anything but float values takes `log_step_rows`."""
        if self._fh is None or not steps:
            return
        if type(epoch) is int and all(type(s) is int for s in steps):
            data = _encode_columns(context, epoch, steps, names, lists, extra)
            if data is not None:
                self._emit(data)
                return
        rows = step_rows(names, lists, extra)
        self.log_step_rows(rows, context=context, epoch=epoch, steps=steps)

    def log_step_rows(
        self,
        rows: Sequence[Mapping[str, float]],
        *,
        context: str,
        epoch: int,
        steps: Sequence[int],
    ) -> None:
        """The lines `log_metrics(rows[i], context=context, epoch=epoch, step=steps[i])` would
        write, in one encode and one write: the training loop logs a read-back chunk's steps
        this way. Rows of float values (what a step returns) take the fast path; anything
        else is written line by line, as `log_metrics` writes it.

        Example:
            >>> log.log_step_rows([{"loss": 0.5}, {"loss": 0.4}], context="train", epoch=1,
            ...                   steps=[1, 2])
        """
        if self._fh is None or not rows:
            return
        if type(epoch) is int and all(type(s) is int for s in steps):
            data = _encode_rows(context, epoch, steps, rows)
            if data is None:
                lines = [
                    {"type": "metrics", "context": context, "epoch": epoch, "step": step, **row}
                    for row, step in zip(rows, steps, strict=True)
                ]
                data = _encode_lines(lines, rows)
            if data is not None:
                self._emit(data)
                return
        for row, step in zip(rows, steps, strict=True):
            self.log_metrics(row, context=context, epoch=epoch, step=step)

    def log_other(self, values: dict[str, Any]) -> None:
        self._write({"type": "other", **values})

    def log_resumed(self, from_step: int, checkpoint: str | os.PathLike) -> None:
        """Mark a resume: the lines after this one continue from `from_step` (the restored
        checkpoint's step). `read_jsonl(..., dedupe=True)` uses it to drop the lost timeline.

        Example:
            >>> log.log_resumed(400, "runs/mnist/checkpoints/epoch-0002-step-000400")
        """
        self.log_other(
            {
                "key": "resumed",
                "from_step": int(from_step),
                "from_checkpoint": str(checkpoint),
                "time": time.time(),
            }
        )

    def flush(self) -> None:
        """Nothing to do: every line is written unbuffered, as it is logged."""

    def finish(self, status: str, **info) -> None:
        """Write the `finish` line. Best-effort: never raises (the driver calls it inside its
        error handler), and does not close the file."""
        try:
            self._write({"type": "finish", "status": status, "time": time.time(), **info})
        except Exception as e:  # e.g. an info value whose repr() raises
            try:
                warn_user(
                    f"could not write the finish line to {self.path}: {e!r}",
                    LogWarning,
                )
            except Exception:  # warnings turned into errors: still never raise here
                pass


_HEAD_KEYS = frozenset(("type", "context", "epoch", "step"))


def _line_head(context: str, epoch: int) -> bytes:
    """A step line's JSON up to its step's value, as orjson writes the line dict."""
    return b'{"type":"metrics","context":' + _orjson.dumps(context) + b',"epoch":%d,"step":' % epoch


def _encode_rows(
    context: str, epoch: int, steps: Sequence[int], rows: Sequence[Mapping[str, Any]]
) -> bytes | None:
    """With orjson, the step lines of `rows` as `_encode_lines` writes them, byte for byte,
    from one encoded line head (no line dict built per row); None without orjson, for a
    row that names a key of the head, or a value orjson does not encode."""
    if _orjson is None or len(steps) != len(rows):
        return None
    head = _line_head(context, epoch)
    parts = []
    try:
        for row, step in zip(rows, steps, strict=True):
            if not _HEAD_KEYS.isdisjoint(row):
                return None
            body = _orjson.dumps(row)
            parts.append(head + b"%d" % step + (b"," + body[1:] if len(body) > 2 else b"}"))
    except (_orjson.JSONEncodeError, TypeError):  # numpy, jax, a huge int, a non-str key
        return None
    parts.append(b"")
    return b"\n".join(parts)


def _encode_columns(
    context: str,
    epoch: int,
    steps: Sequence[int],
    names: Sequence[str],
    lists: Sequence[Sequence[Any]],
    extra: Mapping[str, Any],
) -> bytes | None:
    """With orjson, the step lines of `step_rows(names, lists, extra)` as `_encode_rows`
    writes them, byte for byte, from one line template (the head and the keys encoded once
    per line shape, the shared values once per call, each column in one encode): no row
    dict and no Python work per line. None without orjson, for a key of the head, or a
    value that is not a float."""
    if _orjson is None:
        return None
    count = len(steps)
    if any(len(column) != count for column in lists):
        return None
    if any(type(v) is not float for v in extra.values()):
        return None
    shape = _column_shape(context, epoch, tuple(names), tuple(extra))
    if shape is None:
        return None
    template, own, shared = shape
    columns = [lists[j] for j in own]
    if any(set(map(type, column)) - {float} for column in columns):
        return None
    dumps = _orjson.dumps
    # First the shared values (a float encodes without "%"), leaving a line template of
    # the step (%d) and the columns' values (%s); then the whole chunk in one format.
    line = template % tuple(b"%s" if k is None else dumps(extra[k]) for k in shared)
    values = [dumps(column)[1:-1].split(b",") for column in columns]
    flat = tuple(itertools.chain.from_iterable(zip(steps, *values, strict=True)))
    return (line * count) % flat


def _column_shape(
    context: str, epoch: int, names: tuple[str, ...], extra_keys: tuple[str, ...]
) -> tuple[bytes, list[int], list[str | None]] | None:
    """How a step line with these keys is encoded: its template (for two formats: the first
    fills in the shared values, the second the step and the columns'), the indices of the
    names that are columns (a shared value wins over a column of its name), and per key in
    line order its shared value's name (None: a column). None for a key of the head, a
    repeated name, or a key orjson does not encode. Kept for up to 16 shapes (a run logs one
    or two an epoch)."""
    key = (context, epoch, names, extra_keys)
    if key in _shapes:
        return _shapes[key]
    shape = None
    keys = [*names, *(k for k in extra_keys if k not in names)]
    if _HEAD_KEYS.isdisjoint(keys) and len(set(names)) == len(names):
        try:
            twice = [_orjson.dumps(k).replace(b"%", b"%%%%") for k in keys]
            head = _line_head(context, epoch).replace(b"%", b"%%%%") + b"%%d"
        except (_orjson.JSONEncodeError, TypeError):  # a key that is not a str
            twice = None
        if twice is not None:
            body = b"".join(b"," + k + b":%s" for k in twice)
            shared = [k if k in extra_keys else None for k in keys]
            own = [j for j, k in enumerate(names) if k not in extra_keys]
            shape = (head + body + b"}\n", own, shared)
    if len(_shapes) >= 16:  # (cleared whole: one call, safe beside another thread's logging)
        _shapes.clear()
    _shapes[key] = shape
    return shape


_shapes: dict[tuple, tuple[bytes, list[int], list[str | None]] | None] = {}


def _encode_lines(lines: list[dict], rows: Sequence[Mapping[str, Any]]) -> bytes | None:
    """`lines` (each a line header and its row of metrics) as JSON lines, non-finite values
    as null: what `log_metrics` writes, up to spacing. None for a value only `jsonable`
    converts (with orjson), or any value not a float (without)."""
    if _orjson is not None:  # writes NaN and the infinities as null itself
        try:
            return b"".join([_orjson.dumps(line) + b"\n" for line in lines])
        except _orjson.JSONEncodeError:  # numpy, jax, a huge int: what jsonable converts
            return None
    if {type(v) for row in rows for v in row.values()} - {float}:
        return None
    for line, row in zip(lines, rows, strict=True):
        for k, v in row.items():
            if not math.isfinite(v):
                line[k] = None
    return ("\n".join(map(_ENCODE, lines)) + "\n").encode()


def _free(path: Path | None) -> str:
    """'<n> free on <dir>', for error messages."""
    if path is None:
        return "free space unknown"
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return f"free space on {path.parent} unknown"
    size = float(free)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            break
        size /= 1024
    return f"{free} bytes ({size:.1f} {unit}) free on {path.parent}"


def _symlink_error(path: Path) -> ConfigError:
    return ConfigError(
        f"{path} is a symbolic link; jaxnitro never writes a log through a link (it could "
        "point at a file that is not a jaxnitro log). Remove the link, or pass "
        "JSONLogger(path=) a regular file path."
    )


def _open_append(path: Path):
    """Open `path` to append, refusing links, non-files and files that are not jaxnitro
    logs. A cut last line gets a newline (nothing is ever truncated). Returns an unbuffered
    binary file: one write() per line, no buffer left to flush on a failed write."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise _symlink_error(path)
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise ConfigError(
            f"{path} exists and is not a regular file; pass JSONLogger(path=) a regular file path."
        )
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:  # became a link since lstat
            raise _symlink_error(path) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{path} exists and is not a regular file; pass "
                "JSONLogger(path=) a regular file path."
            )
        if st.st_size > 0:
            head, ends_with_newline = _read_ends(path, st)
            if not _is_jaxnitro_log(head):
                raise ConfigError(
                    f"{path} exists and is not a jaxnitro metrics log; pass another path "
                    "(JSONLogger(path=...) or another run_dir). jaxnitro only appends to its "
                    "own logs and never rewrites a file it did not create."
                )
            if not ends_with_newline:  # a kill cut the last line: keep it, as its own line
                os.write(fd, b"\n")
        return os.fdopen(fd, "ab", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _read_ends(path: Path, st: os.stat_result) -> tuple[bytes, bool]:
    """The first bytes of the file open as `st`, and whether it ends with a newline."""
    rfd = os.open(path, os.O_RDONLY | _O_NOFOLLOW)
    try:
        rst = os.fstat(rfd)
        if (rst.st_dev, rst.st_ino) != (st.st_dev, st.st_ino):
            raise ConfigError(f"{path} was replaced while jaxnitro opened it; open it again.")
        head = os.pread(rfd, _HEAD_BYTES, 0)
        last = os.pread(rfd, 1, rst.st_size - 1) if rst.st_size else b"\n"
        return head, last == b"\n"
    finally:
        os.close(rfd)


def _is_jaxnitro_log(head: bytes) -> bool:
    if not head.strip():
        return True  # only whitespace: nothing to lose
    first = head.lstrip().partition(b"\n")[0]
    if first.startswith(_PREFIXES):  # also when a kill cut the first line short
        return True
    try:
        obj = json.loads(first)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("type") in LINE_TYPES


def read_jsonl(path: str | os.PathLike, *, dedupe: bool = False) -> list[dict]:
    """Read a JSONL log back: one dict per line, in file order.

    A line that does not parse as a JSON object (e.g. the fragment a process killed
    mid-write leaves) is skipped; one `LogWarning` names the skipped line numbers.

    With `dedupe=True`, `metrics` lines are reduced to one per (context, step) timeline
    entry, for logs of runs that were killed and resumed:

    1. A resume marker (`{"type": "other", "key": "resumed", "from_step": N, ...}`, written
       by `JSONLogger.log_resumed`) drops every `metrics` line before it whose step is
       greater than N, in any context: those steps belong to the timeline the kill lost,
       whether or not the resumed run logged them again.
    2. Of the `metrics` lines left, one per (context, step, split) is kept: the last one
       written, at the position of its last occurrence (`split` is the line's "split"
       field, None when absent).

    Lines of other types (params, other, finish, the markers) are all kept, in place.
    Without markers (older logs), rule 2 alone applies.

    Args:
        path: the log, e.g. `runs/mnist/metrics.jsonl`.
        dedupe: reduce the `metrics` lines as above.

    Returns:
        One dict per line kept, in file order.

    Example:
        >>> rows = jn.read_jsonl("runs/mnist/metrics.jsonl", dedupe=True)
        >>> [r["step"] for r in rows if r["type"] == "metrics" and r["context"] == "validate"]
        [100, 200, 300]
    """
    rows: list[dict] = []
    bad: list[int] = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                obj = None
            if isinstance(obj, dict):
                rows.append(obj)
            else:
                bad.append(lineno)
    if bad:
        listed = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        warn_user(
            f"{path}: skipped {len(bad)} unreadable line(s) (line {listed}); a "
            "process killed mid-write leaves a partial line.",
            LogWarning,
        )
    return _dedupe(rows) if dedupe else rows


def _is_step(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _dedupe(rows: list[dict]) -> list[dict]:
    kept: list[dict] = []
    seen: set = set()
    cut = math.inf  # the smallest from_step of the resume markers after the current row
    for row in reversed(rows):
        kind = row.get("type")
        if kind == "other" and row.get("key") == "resumed" and _is_step(row.get("from_step")):
            cut = min(cut, row["from_step"])
        elif kind == "metrics":
            step = row.get("step")
            if _is_step(step) and step > cut:
                continue  # the lost timeline of a killed run
            key = (row.get("context"), repr(step), repr(row.get("split")))
            if key in seen:
                continue  # superseded by a later line
            seen.add(key)
        kept.append(row)
    kept.reverse()
    return kept
