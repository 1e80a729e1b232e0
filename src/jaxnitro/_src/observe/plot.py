"""`jn.plot`: training and validation curves of one or several runs, from their logs.

One panel per metric; in each, a run's per-step training values (solid) and its validation
values (dashed, with markers) share a colour, and several runs overlay. `loss` pairs the train
loss with `val_loss`; `acc` pairs a train metric `acc` (if `train_metrics` logs one) with the
validation `acc`. Drawn with matplotlib's object API on the Agg canvas (a PNG): no pyplot, so a
notebook's backend is left alone. `jn.train` writes `run_dir/curves.png` at its end
(`JAXNITRO_NO_PLOT=1` skips it), while it holds the run's lock. Importing matplotlib costs
0.7-1.4 s on a small CPU, more than a short run's training: `preload` imports it in a
background thread while the run's first program compiles (XLA compiles without the GIL), so
the end of the run pays only the drawing (0.2-0.4 s).
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path, PosixPath
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from jaxnitro._src.core import background_imports
from jaxnitro._src.core.errors import ConfigError, did_you_mean, warn_user
from jaxnitro._src.observe.display import Display, each
from jaxnitro._src.observe.runs import LOG_NAME, run_rows

if TYPE_CHECKING:
    from jaxnitro._src.observe.loggers.base import Logger

_MAX_POINTS = 2000  # a long run's per-step curve is averaged into this many bins
# train-line keys shown only when asked for (the throughput: observe/throughput.py)
_HIDDEN = {"lr", "grad_norm", "skipped", "samples_per_s", "tokens_per_s", "tflops_per_s", "mfu"}
_NOT_METRICS = {"type", "context", "epoch", "step", "split", "time", "train_loss"}
_X = ("step", "epoch")


class Figure(PosixPath):
    """The PNG `jn.plot` wrote: a path, which a notebook shows inline as the image."""

    def _repr_png_(self) -> bytes | None:
        return self.read_bytes() if self.suffix == ".png" and self.is_file() else None


class PlotWarning(UserWarning):
    """The curves of a finished `jn.train` could not be drawn (the run is unaffected)."""


def plot(
    runs: Any,
    metrics: str | Sequence[str] | None = None,
    out: str | os.PathLike | None = None,
    x: str = "step",
    *,
    display: Display | None = None,
) -> Figure:
    """Draw the curves of one or several runs into a PNG; returns its path (a `Path` that a
    notebook shows as the image).

    Args:
        runs: a run directory (one holding `metrics.jsonl`), a `metrics.jsonl` path, a `Nitro`
            handle, or a list of them (overlaid).
        metrics: names like `["loss", "acc"]` or `"loss,acc"`; None: the loss and every
            validation metric logged.
        out: the PNG to write; None: `<run_dir>/curves.png` for one run, `curves.png` for several.
        x: "step" (optimizer steps) or "epoch" (train values averaged per epoch).
        display: shows a bar while the logs are read (`jaxnitro plot` passes one).

    Returns:
        A `Figure`: the PNG's `Path`, shown as the image in a notebook.

    Raises:
        ConfigError: no runs given, a run without a log, or `x` is neither "step" nor
            "epoch".

    Example:
        >>> jn.plot(["runs/a", "runs/b"], metrics="loss,acc", out="curves.png")
        PosixPath('curves.png')
    """
    if x not in _X:
        raise ConfigError(f"plot x={x!r}; use 'step' or 'epoch'." + did_you_mean(str(x), _X))
    logs = [_log_path(r) for r in ([runs] if _single(runs) else list(runs))]
    if not logs:
        raise ConfigError("jn.plot got no runs; pass a run directory or a list of them.")
    data = [run_rows(log) for log in each(logs, "reading runs", display)]
    names = _metric_names(data, metrics)
    target = Path(out) if out is not None else _default_out(logs)
    _draw(_labels(logs), data, names, x, target)
    return Figure(target)


_PRELOAD = "jaxnitro-plot-import"  # the background import of matplotlib, if started
_MATPLOTLIB = ("matplotlib.backends.backend_agg", "matplotlib.figure", "matplotlib.ticker")


def _enabled() -> bool:
    return os.environ.get("JAXNITRO_NO_PLOT", "").strip() in ("", "0")


def preload() -> None:
    """Import matplotlib in a background thread, ahead of the end-of-train drawing (once per
    process; nothing when drawing is off, matplotlib is missing or already imported)."""
    if background_imports.started(_PRELOAD) or not _enabled() or "matplotlib.figure" in sys.modules:
        return
    if importlib.util.find_spec("matplotlib") is None:
        return
    background_imports.start(_PRELOAD, _MATPLOTLIB)


def wait_preload() -> None:
    """Wait for `preload`'s import (a fork amid it could inherit its import locks)."""
    background_imports.wait()


class _Held(Protocol):
    @property
    def held(self) -> bool: ...


class _Lock(Protocol):
    @property
    def lock(self) -> _Held: ...


class Curves(Protocol):
    """What `write_curves` reads of a run (a `jn.Nitro` is one): where it writes, its logger
    (the JSONL log drawn) and whether it holds the run's lock (`services.lock.held`)."""

    @property
    def run_dir(self) -> str | os.PathLike: ...
    @property
    def logger(self) -> Logger: ...
    @property
    def services(self) -> _Lock: ...


def write_curves(n: Curves) -> Path | None:
    """`run_dir/curves.png` at the end of `jn.train`, while the run holds its lock.

    Skipped when `JAXNITRO_NO_PLOT=1`, without matplotlib, or with no JSONL log; a failure
    only warns (`PlotWarning`), never fails the run."""
    if not _enabled():
        return None
    out = Path(n.run_dir) / "curves.png"
    try:
        if not n.services.lock.held or importlib.util.find_spec("matplotlib") is None:
            return None
        log = _handle_log(n)
        if log is None or not log.is_file():
            return None
        wait_preload()
        return plot(log, out=out)
    except Exception as e:  # noqa: BLE001 - a drawing must never cost a finished run
        with contextlib.suppress(Exception):
            warn_user(
                f"could not write {out}: {e!r}. The run is unaffected; JAXNITRO_NO_PLOT=1 "
                f"skips the drawing.",
                PlotWarning,
            )
        return None


# -- inputs ------------------------------------------------------------------------------
def _single(runs) -> bool:
    return isinstance(runs, (str, os.PathLike)) or hasattr(runs, "run_dir")


def _log_path(run) -> Path:
    path = Path(run.run_dir) if hasattr(run, "run_dir") else Path(run)
    log = path / LOG_NAME if path.is_dir() else path
    if not log.is_file():
        raise ConfigError(
            f"{path} holds no {LOG_NAME}; pass a run directory (the run_dir of a jn.train) "
            f"or the path of its {LOG_NAME}."
        )
    return log


def _handle_log(n: Curves) -> Path | None:
    """The JSONL log a handle writes (a `JSONLogger`, alone or in a fan-out)."""
    from jaxnitro._src.observe.loggers.jsonl import JSONLogger

    stack = [n.logger]
    while stack:
        lg = stack.pop(0)
        if isinstance(lg, JSONLogger):
            return lg.path if lg.path is not None else Path(n.run_dir) / LOG_NAME
        stack.extend(getattr(lg, "loggers", []))
    return None


def _default_out(logs: list[Path]) -> Path:
    return logs[0].parent / "curves.png" if len(logs) == 1 else Path("curves.png")


def _labels(logs: list[Path]) -> list[str]:
    """Run directory names; paths (from their common parent) where names repeat."""
    names = [log.parent.name or str(log.parent) for log in logs]
    if len(set(names)) == len(names):
        return names
    common = Path(os.path.commonpath([str(log.parent.absolute()) for log in logs]))
    rel = [str(log.parent.absolute().relative_to(common)) for log in logs]
    return [
        r if r != "." and rel.count(r) == 1 else f"{names[i]} ({i + 1})" for i, r in enumerate(rel)
    ]


def _numeric(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _metric_names(data: list[list[dict]], metrics) -> list[str]:
    """The panels: the ones asked for (checked), else the loss and every logged metric."""
    seen: dict[str, None] = {}
    for rows in data:
        for r in rows:
            if r.get("type") != "metrics" or r.get("context") not in ("train", "validate"):
                continue
            if r.get("context") == "validate" and "split" in r:
                continue
            for k, v in r.items():
                if k not in _NOT_METRICS and _numeric(v):
                    seen[_base(k)] = None
    known = list(seen)
    if metrics is None:
        shown = [k for k in known if k not in _HIDDEN and not k.startswith("lr/")]
        return sorted(shown, key=lambda k: k != "loss")  # the loss first
    asked = [m.strip() for m in metrics.split(",")] if isinstance(metrics, str) else list(metrics)
    asked = [_base(m) for m in asked if m]
    for m in asked:
        if m not in seen:
            raise ConfigError(
                f"no run logged a metric {m!r}; logged: {sorted(known)}." + did_you_mean(m, known)
            )
    return asked


def _base(key: str) -> str:
    return key[4:] if key.startswith("val_") else key


# -- series ------------------------------------------------------------------------------
def _train_series(rows: list[dict], metric: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [
        (r.get(x), r[metric])
        for r in rows
        if r.get("type") == "metrics"
        and r.get("context") == "train"
        and _numeric(r.get(metric))
        and _numeric(r.get(x))
    ]
    xs, ys = _arrays(pts)
    if x == "epoch" and xs.size:  # one point per epoch: the mean of its steps
        keys = np.unique(xs)
        ys = np.array([np.nanmean(ys[xs == k]) for k in keys])
        xs = keys
    elif xs.size > _MAX_POINTS:  # bin means keep the shape, drop the cost
        edges = np.linspace(0, xs.size, _MAX_POINTS + 1).astype(int)
        xs = np.array([xs[a:b].mean() for a, b in zip(edges[:-1], edges[1:], strict=True)])
        ys = np.array([np.nanmean(ys[a:b]) for a, b in zip(edges[:-1], edges[1:], strict=True)])
    return xs, ys


def _val_series(rows: list[dict], metric: str, x: str) -> tuple[np.ndarray, np.ndarray]:
    keys = (f"val_{metric}", metric)
    pts = []
    for r in rows:
        if r.get("type") != "metrics" or r.get("context") != "validate" or "split" in r:
            continue
        key = next((k for k in keys if _numeric(r.get(k))), None)
        if key is not None and _numeric(r.get(x)):
            pts.append((r[x], r[key]))
    return _arrays(pts)


def _arrays(pts: Iterable[tuple]) -> tuple[np.ndarray, np.ndarray]:
    pts = [(float(a), float(b)) for a, b in pts]
    if not pts:
        return np.zeros(0), np.zeros(0)
    xs, ys = np.array(pts, dtype=float).T
    ys[~np.isfinite(ys)] = np.nan  # a NaN breaks the line instead of ruining the axis
    return xs, ys


# -- drawing -----------------------------------------------------------------------------
def _draw(labels: list[str], data: list[list[dict]], names: list[str], x: str, out: Path) -> None:
    try:
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ConfigError(
            "jn.plot needs matplotlib: pip install matplotlib (or jaxnitro[plot])."
        ) from e
    cols = min(len(names), 3) or 1
    rows = math.ceil(len(names) / cols) or 1
    w, h = 4.6 * cols, 3.3 * rows
    fig = Figure(figsize=(w, h))
    # Fixed margins in inches: a layout engine would cost more than the drawing itself.
    fig.subplots_adjust(
        left=0.75 / w, right=1 - 0.15 / w, bottom=0.5 / h, top=1 - 0.35 / h, wspace=0.35, hspace=0.5
    )
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    several = len(labels) > 1
    for ax, metric in zip(axes, names, strict=False):
        for i, (label, run) in enumerate(zip(labels, data, strict=True)):
            colour, prefix = f"C{i % 10}", f"{label} " if several else ""
            xs, ys = _train_series(run, metric, x)
            if xs.size:
                ax.plot(xs, ys, color=colour, lw=1.0, alpha=0.7, label=f"{prefix}train")
            xs, ys = _val_series(run, metric, x)
            if xs.size:
                ax.plot(xs, ys, "o--", color=colour, lw=1.4, ms=3.5, label=f"{prefix}val")
        ax.set_title(metric)
        ax.set_xlabel(x)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:  # written whole, then moved into place: never a half-written PNG
        fig.savefig(tmp, format="png", dpi=100)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


__all__ = ["PlotWarning", "plot", "preload", "write_curves"]
