"""The runs under a directory, read from their logs: what `jaxnitro runs` shows.

A run directory is any directory holding a `metrics.jsonl`. Its *run* is the last one logged
there (several runs may share a directory): the lines from the first `params` line carrying
the last run id on. Its status is the last `finish` line's, or `running` while a writer holds
the run lock (tested without taking it, so a trainer starting now is never refused), or
`killed` when the log just stops (the process died without writing its finish line; resume it
with `resume="auto"`), or `evaluated` when only evaluations logged to it.

Nothing here imports JAX or writes anything.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import socket
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from jaxnitro._src.checkpoint.runlock import LOCK_NAME
from jaxnitro._src.core.html_table import html_table
from jaxnitro._src.observe import timing
from jaxnitro._src.observe.display import Display, each
from jaxnitro._src.observe.loggers.jsonl import read_jsonl

LOG_NAME = "metrics.jsonl"
#: Metric names (substrings) where lower is better; any other metric is ranked higher-better.
_LOWER_IS_BETTER = ("loss", "err", "mse", "mae", "rmse", "nll", "ppl", "perplexity", "wer", "cer")


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """One row of `jaxnitro runs`.

    Example:
        >>> [(r.experiment, r.status, r.best) for r in list_runs("runs")]
        [('MnistMLP', 'completed', 0.912)]
    """

    run_dir: Path
    experiment: str | None
    status: str  # completed | early_stop | preempted | error | requested | running | killed | ...
    epoch: int | None
    step: int | None
    metric: str
    mode: str
    best: float | None
    updated: float  # the log's modification time (seconds since the epoch)
    run_id: str | None
    time_split: dict[str, float] | None = None  # the last epoch's (observe/timing.py)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`run_dir` as a string, `updated` as ISO 8601 local time)."""
        d = dataclasses.asdict(self)
        d["run_dir"] = str(self.run_dir)
        d["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.updated))
        return d


def find_runs(root: str | os.PathLike) -> Iterator[Path]:
    """Every directory under `root` (itself included) holding a `metrics.jsonl`.

    Hidden directories and checkpoint trees are not searched.

    Example:
        >>> sorted(p.name for p in find_runs("runs"))
        ['MnistMLP', 'sweep-0-width=64']
    """
    for here, dirs, files in os.walk(os.fspath(root)):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != "checkpoints")
        if LOG_NAME in files:
            yield Path(here)


class RunList(list):
    """The `RunInfo` rows of `list_runs`: a list, shown as a table in a notebook."""

    def _repr_html_(self) -> str:
        header = ("experiment", "status", "epoch", "step", "best", "updated", "run dir")
        rows = [
            (
                r.experiment or "?",
                r.status,
                r.epoch,
                r.step,
                f"{r.metric} {r.best:.4g}" if r.best is not None else None,
                time.strftime("%Y-%m-%d %H:%M", time.localtime(r.updated)),
                str(r.run_dir),
            )
            for r in self
        ]
        return html_table(header, rows, caption=f"{len(self)} run(s), newest first")


def list_runs(root: str | os.PathLike = "runs", *, display: Display | None = None) -> RunList:
    """The runs under `root`, newest first (by the time their log last changed).

    Args:
        root: the directory searched (itself included).
        display: shows a bar while the logs are read (`jaxnitro runs` passes one); None: none.

    Example:
        >>> rows = list_runs("runs")
        >>> rows[0].status
        'completed'
    """
    dirs = list(find_runs(root))
    infos = [run_info(d) for d in each(dirs, "reading runs", display)]
    return RunList(sorted(infos, key=lambda r: r.updated, reverse=True))


def run_info(run_dir: str | os.PathLike) -> RunInfo:
    """Summarize the last run logged in `run_dir` (see the module docstring)."""
    run_dir = Path(run_dir)
    log = run_dir / LOG_NAME
    rows = run_rows(log)
    params = next((r for r in rows if r.get("type") == "params"), {})
    metric, mode = checkpoint_metric(run_dir, params.get("run_id"))
    last_metrics: dict = next((r for r in reversed(rows) if r.get("type") == "metrics"), {})
    finish = _last_finish(rows)
    where = finish or last_metrics
    return RunInfo(
        run_dir=run_dir,
        experiment=params.get("experiment"),
        status=_status(run_dir, rows, finish),
        epoch=_int_or_none(where.get("epoch")),
        step=_int_or_none(where.get("step")),
        metric=metric,
        mode=mode,
        best=best_value(rows, metric, mode),
        updated=log.stat().st_mtime,
        run_id=params.get("run_id"),
        time_split=timing.last_split(rows),
    )


def run_rows(log: str | os.PathLike) -> list[dict]:
    """The lines of the last run in a `metrics.jsonl` (deduplicated across resumes).

    Example:
        >>> [r["type"] for r in run_rows("runs/MnistMLP/metrics.jsonl")][:2]
        ['params', 'other']
    """
    with warnings.catch_warnings():  # a cut line is expected after a kill; not news here
        warnings.simplefilter("ignore")
        rows = read_jsonl(log, dedupe=True)
    starts = [i for i, r in enumerate(rows) if r.get("type") == "params"]
    if not starts:
        return rows
    run_id = rows[starts[-1]].get("run_id")
    first = next(i for i in starts if rows[i].get("run_id") == run_id)
    return rows[first:]


def checkpoint_metric(run_dir: Path, run_id: str | None) -> tuple[str, str]:
    """(metric, mode) the run's checkpointer ranks by, from its manifest; else val_loss, min.

    The manifest names the metric, not the mode: a name containing loss, err, mse, ppl, ...
    ranks lower-better, any other higher-better."""
    metric = "val_loss"
    manifest = run_dir / "checkpoints" / "manifest.json"
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        rows = json.loads(manifest.read_text(encoding="utf-8")).get("checkpoints", [])
        mine = [r for r in rows if isinstance(r, dict) and r.get("run_id") == run_id] or rows
        named = [r["metric"] for r in mine if isinstance(r, dict) and r.get("metric")]
        if named:
            metric = str(named[-1])
    return metric, metric_mode(metric)


def metric_mode(metric: str) -> str:
    """'min' for a loss-like metric name, else 'max'.

    Example:
        >>> metric_mode("val_loss"), metric_mode("acc")
        ('min', 'max')
    """
    low = metric.lower()
    return "min" if any(word in low for word in _LOWER_IS_BETTER) else "max"


def best_value(rows: Iterable[dict], metric: str, mode: str) -> float | None:
    """The best finite `metric` of the run's validation lines (evaluations of other splits
    excluded), or None."""
    values = [
        float(r[metric])
        for r in rows
        if r.get("type") == "metrics"
        and r.get("context") == "validate"
        and "split" not in r
        and isinstance(r.get(metric), (int, float))
        and not isinstance(r.get(metric), bool)
        and math.isfinite(r[metric])
    ]
    if not values:
        return None
    return min(values) if mode == "min" else max(values)


def _last_finish(rows: list[dict]) -> dict | None:
    """The finish line of the last session, if it wrote one (a later start cancels it)."""
    for r in reversed(rows):
        kind = r.get("type")
        if kind == "finish":
            return r
        if kind == "params" or (kind == "other" and r.get("key") == "resumed"):
            return None
    return None


def _status(run_dir: Path, rows: list[dict], finish: dict | None) -> str:
    if finish is not None:
        return str(finish.get("status", "unknown"))
    if lock_held(run_dir):
        return "running"
    trained = any(r.get("type") == "metrics" and r.get("context") == "train" for r in rows)
    evaluated = any(r.get("type") == "metrics" and r.get("context") == "validate" for r in rows)
    return "evaluated" if evaluated and not trained else "killed"


def lock_held(run_dir: str | os.PathLike) -> bool:
    """Whether a writer holds `run_dir`'s run lock, tested without taking it.

    The lock file records its holder and marks a clean release. A lock not released is held
    if the kernel lists a `flock` on the file (Linux `/proc/locks`) or its holder's process
    is alive on this host; a holder on another host is taken at its word.
    """
    path = Path(run_dir) / LOCK_NAME
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
        st = path.stat()
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict) or info.get("released", True):
        return False
    if (os.major(st.st_dev), os.minor(st.st_dev), st.st_ino) in _flocked_inodes():
        return True
    if info.get("host") not in (None, socket.gethostname()):
        return True
    # Not listed (no /proc/locks, or a file system that reports other device numbers there):
    # a live holder process still counts.
    return _alive(info.get("pid"))


def _flocked_inodes() -> set[tuple[int, int, int]]:
    """(major, minor, inode) of every file with a FLOCK (empty where /proc/locks is not)."""
    out: set[tuple[int, int, int]] = set()
    try:
        text = Path("/proc/locks").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" ("->" marks a blocked waiter)
        if "->" in parts or len(parts) < 6 or parts[1] != "FLOCK":
            continue
        with contextlib.suppress(ValueError):
            major, minor, inode = parts[5].split(":")
            out.add((int(major, 16), int(minor, 16), int(inode)))
    return out


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


def _int_or_none(v) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


__all__ = ["RunInfo", "find_runs", "list_runs", "lock_held", "run_info", "run_rows"]
