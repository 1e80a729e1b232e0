"""Background runs: `jn.start(n)` trains on a thread and returns a `jn.RunHandle` at once.

A thread, not a process: the handle, its compiled programs and the process's compile cache
stay where the caller is (a second run of the same shapes compiles nothing), `set_device`
and `checkpoint` reach the running loop directly (`run/commands.py`), and an error re-raises
in `wait()` as the object it was. The device work runs in XLA, which releases the GIL, so the
caller's thread stays responsive. A background run installs no signal handlers (signal
handlers belong to the main thread; Ctrl-C and SIGTERM keep their meaning for a foreground
`jn.train`), and a live terminal bar becomes plain lines (a bar redrawn from a thread would
fight the caller's prompt).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import CancelledError, Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.core.html_table import html_table
from jaxnitro._src.observe.display import Display
from jaxnitro._src.observe.events.phases import on_phase
from jaxnitro._src.observe.runs import LOG_NAME
from jaxnitro._src.run import commands
from jaxnitro._src.train.driver import TrainResult, train

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro

_handles: list[RunHandle] = []
_lock = threading.Lock()
#: How long the end of the script waits for a background run to stop at its next step and
#: write its checkpoint (`_stop_at_exit`).
EXIT_WAIT_S = 120.0
_exit_hooked = False


def _stop_at_exit() -> None:
    """The script (or the kernel) is ending while runs train in the background: each stops
    at its next step as `stop()` stops it (its checkpoint written: resumable), is waited for,
    and says so in one line. Left alone, the interpreter would cut it mid-step at shutdown,
    silently, and sometimes in the middle of writing its checkpoint.

    Runs from `threading`'s exit hooks, before `concurrent.futures` shuts its executors
    down (the checkpoint writer needs them) and before the interpreter finalizes."""
    with _lock:
        live = [h for h in _handles if not h.done]
    for h in live:
        h.stop()
    for h in live:
        h._thread.join(EXIT_WAIT_S)
        n = h.nitro
        if h.done:
            where = n.checkpointer.latest()  # what resume="auto" continues from
            said = f"it stopped at step {n.step}" + (
                f" with a checkpoint at {where}; continue it with resume='auto' in a new handle"
                if where
                else ""
            )
        else:
            said = f"it did not stop within {EXIT_WAIT_S:.0f} s (step {n.step}) and is cut"
        with contextlib.suppress(Exception):
            sys.stderr.write(
                f"jaxnitro: the script ended while run {h.id} trained in the background "
                f"(jn.start); {said}. Call handle.wait() before the end to train it to the "
                f"end.\n"
            )
            sys.stderr.flush()


def _hook_exit() -> None:
    """Register `_stop_at_exit` once, with `threading`'s exit hooks (run in reverse order of
    registration at interpreter shutdown: this one, registered after `concurrent.futures`
    was imported, runs before its executors are shut down)."""
    global _exit_hooked
    if _exit_hooked:
        return
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # another Python: at least before the interpreter finalizes
        import atexit

        atexit.register(_stop_at_exit)
    else:
        register(_stop_at_exit)
    _exit_hooked = True


def run_id(n: Nitro) -> str:
    """A run's id: `<Experiment>-<run id>` (the run id its logs and checkpoints carry)."""
    return f"{n.spec.cls.__name__}-{n.spec.run_id or format(id(n), 'x')}"


class RunHandle:
    """A run training in the background (`jn.start`): poll it, steer it, wait for it.

    Attributes:
        id: unique in this process and stable (`<Experiment>-<run id>`; the run's
            `metrics.jsonl` carries the same run id).
        nitro: the run's `jn.Nitro` handle.

    Example:
        >>> h = jn.start(jn.Nitro(MnistMLP(), run_dir="runs/a"))
        >>> h.status()["phase"]
        'Training'
        >>> h.set_device(smoothing=0.1)  # from the next step on, no recompile
        >>> h.stop(); h.wait().stop_reason
        'requested'
    """

    def __init__(self, n: Nitro) -> None:
        self.nitro = n
        self.id = run_id(n)
        self._future: Future = Future()
        self._commands = commands.register(n)
        self._started = time.monotonic()
        self._training: tuple[float, int] | None = None  # (time, step) training began at
        on_phase(self._on_phase, nitro=n)
        self._thread = threading.Thread(target=self._run, name=f"jaxnitro-{self.id}", daemon=True)

    # -- the run ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._future.set_result(train(self.nitro))
        except BaseException as e:  # noqa: BLE001 - handed to wait(), never lost
            self._future.set_exception(e)
        finally:
            commands.unregister(self.nitro)

    def _on_phase(self, phase: str, step: int, epoch: int, info: dict) -> None:
        if phase == "Training" and self._training is None:
            self._training = (time.monotonic(), step)

    # -- looking at it ----------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._future.done()

    def status(self) -> dict[str, Any]:
        """Where the run is, as a plain dict (JSON-ready).

        Keys: `id`, `phase`, `epoch` (that of the last step taken, 1-based: 0 before the
        first; docs/training.md, "Counting"), `max_epochs`, `step`, `total_steps`,
        `steps_per_second` (since training began, compiles included), `eta_seconds`,
        `train` and `validation` (the latest metrics), `best_checkpoint`, `run_dir`,
        `stop_reason` and `error` once it ended.
        """
        n = self.nitro
        step, total = n.step, n.spec.total_steps
        rate = None
        if self._training is not None:
            t0, s0 = self._training
            elapsed = time.monotonic() - t0
            rate = (step - s0) / elapsed if elapsed > 0 and step > s0 else None
        eta = (total - step) / rate if rate and total and not self.done else None
        out: dict[str, Any] = {
            "id": self.id,
            "phase": n.phase,
            "epoch": n.progress.epoch_number,  # as checkpoint names and logs count it
            "max_epochs": n.max_epochs,
            "step": step,
            "total_steps": total,
            "steps_per_second": rate,
            "eta_seconds": eta,
            "train": _last_train(n.run_dir / LOG_NAME),
            "validation": _last_validation(n),
            "best_checkpoint": _path(n.checkpointer.best() or n.checkpointer.latest()),
            "run_dir": str(n.run_dir),
            "stop_reason": None,
            "error": None,
        }
        if self.done:
            error = self._future.exception()
            if error is None:
                out["stop_reason"] = self._future.result().stop_reason
            else:
                out["stop_reason"] = "error"
                out["error"] = f"{type(error).__name__}: {error}"
        return out

    def wait(self, timeout: float | None = None) -> TrainResult:
        """The run's `TrainResult` once it ends; re-raises the run's error (a `TimeoutError`
        when `timeout` seconds pass first)."""
        try:
            return self._future.result(timeout)
        except TimeoutError:
            raise TimeoutError(
                f"run {self.id} is still {self.nitro.phase.lower()} after {timeout}s (step "
                f"{self.nitro.step}); wait longer, or handle.stop() first."
            ) from None

    # -- steering it ------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop gracefully: the step finishes, then validation and a checkpoint;
        `stop_reason="requested"`. Returns at once (`wait()` for the end)."""
        self.nitro.services.control.request()

    def checkpoint(self, *, wait: bool = False, timeout: float | None = None) -> Path | None:
        """Write a checkpoint at the next step boundary without stopping. With `wait=True`,
        returns its path once written (None: the run writes no checkpoints).

        Top-K retention keeps a checkpoint asked for this way, whatever its score, until you
        delete its directory (its manifest row says `"requested": true`)."""
        future = self._commands.checkpoint()
        if not wait and not future.cancelled():
            return None
        try:
            return future.result(timeout)
        except CancelledError:
            raise ConfigError(
                f"run {self.id} ended before a step boundary took the checkpoint request; "
                f"its checkpoints are in {self.nitro.run_dir} (status()['best_checkpoint'])."
            ) from None

    def set_device(self, **values: Any) -> None:
        """Change Device fields from the next step boundary on (checked now; no recompile)."""
        self._commands.set_device(self.nitro, values)

    def set_lr(self, rate: float | Mapping[str, float]) -> None:
        """Set the learning rate from the next step boundary on (checked now; no recompile):
        one rate, or {group: rate} with several parameter groups (`jn.set_lr`). The step logs'
        `lr` column shows it from the step it applies to."""
        self._commands.set_lr(self.nitro, rate)

    def __repr__(self) -> str:
        s = self.status()
        return f"RunHandle({self.id}, {s['phase']}, epoch {s['epoch']}, step {s['step']})"


def start(n: Nitro) -> RunHandle:
    """Train `n` in the background; returns a `jn.RunHandle` at once.

    Ctrl-C and SIGTERM keep their meaning only for a foreground `jn.train`: a background run
    installs no handlers (stop it with `handle.stop()`).

    Args:
        n: the run (`jn.Nitro`) to train, as `jn.train(n)` would.

    Returns:
        A `jn.RunHandle`: its status, `wait()` for the `TrainResult`, `stop()`.

    Raises:
        ConfigError: `n` is already training in the background.

    Example:
        >>> h = jn.start(jn.Nitro(MnistMLP()))
        >>> result = h.wait()
    """
    with _lock:
        for h in _handles:
            if h.nitro is n and not h.done:
                raise ConfigError(
                    f"this handle is already training in the background as run {h.id}; "
                    f"wait for it (jn.runs()[i].wait()) or stop it before starting it again."
                )
        display = n.services.display
        if getattr(display, "mode", None) == "rich":  # no live bar redrawn from a thread
            n.services.display = Display("plain", file=display.file)
        handle = RunHandle(n)
        _handles.append(handle)
        _hook_exit()
    handle._thread.start()
    return handle


class RunTable(list):
    """`jn.runs()`: a list of `jn.RunHandle`s that prints as a table (HTML in a notebook)."""

    _HEADER = ("id", "phase", "stop reason", "epoch", "step", "steps/s", "latest metrics")

    def rows(self) -> list[tuple]:
        out = []
        for h in self:
            s = h.status()
            latest = {**(s["train"] or {}), **(s["validation"] or {})}
            metrics = ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in latest.items()
            )
            rate = s["steps_per_second"]
            out.append(
                (
                    s["id"],
                    s["phase"],
                    s["stop_reason"] or "",
                    s["epoch"],
                    s["step"],
                    "" if rate is None else f"{rate:.1f}",
                    metrics,
                )
            )
        return out

    def __repr__(self) -> str:
        if not self:
            return "no background runs in this process (jn.start(n) starts one)"
        rows = [self._HEADER, *[tuple(map(str, r)) for r in self.rows()]]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self._HEADER))]
        return "\n".join(
            "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows
        )

    def _repr_html_(self) -> str:
        return html_table(self._HEADER, self.rows(), caption=f"{len(self)} background run(s)")


def runs() -> RunTable:
    """This process's background runs (`jn.start`), oldest first.

    Returns:
        A `RunTable`: a list of `jn.RunHandle` that prints as a table (phase, epoch, step,
        speed, latest metrics).

    Example:
        >>> jn.runs()
        id              phase     epoch  step  steps/s  latest metrics
        MnistMLP-3f2a…  Training  1      420   812.5    loss 0.31
    """
    with _lock:
        return RunTable(_handles)


def find(run_id: str) -> RunHandle:
    """The background run `run_id`; a ConfigError naming the known ids."""
    from jaxnitro._src.core.errors import did_you_mean

    with _lock:
        known = {h.id: h for h in _handles}
    if run_id not in known:
        raise ConfigError(
            f"no run {run_id!r} in this process; runs: {sorted(known) or 'none'}."
            + did_you_mean(run_id, known)
        )
    return known[run_id]


def tail_rows(log: Path | BinaryIO, count: int, *, context: str | None = None) -> list[dict]:
    """The last `count` lines of a run's `metrics.jsonl` (of one `context`: train, validate,
    ...), read from the file's end: a long run's log is never read whole. `log` is its path
    or the file already open (binary; `jaxnitro mcp` opens it without following links)."""
    if not isinstance(log, Path):
        return _tail(log, os.fstat(log.fileno()).st_size, count, context)
    if not log.is_file():
        return []
    with log.open("rb") as f:
        return _tail(f, os.fstat(f.fileno()).st_size, count, context)


def _tail(f: BinaryIO, size: int, count: int, context: str | None) -> list[dict]:
    chunk = 1 << 16
    while True:
        start = max(0, size - chunk)
        f.seek(start)
        lines = f.read(size - start).splitlines()[1 if start else 0 :]
        rows = []
        for raw in lines:
            with contextlib.suppress(ValueError):  # a line being written
                row = json.loads(raw)
                if isinstance(row, dict) and (context is None or row.get("context") == context):
                    rows.append(row)
        if len(rows) >= count or start == 0:
            return rows[-count:] if count else []
        chunk *= 4


def _last_train(log: Path) -> dict[str, Any] | None:
    """The newest train row of the run's log (its metrics only)."""
    rows = tail_rows(log, 1, context="train")
    if not rows:
        return None
    skip = ("type", "context", "epoch", "step")
    return {k: v for k, v in rows[-1].items() if k not in skip}


def _last_validation(n: Nitro) -> dict[str, Any] | None:
    history = n.progress.history
    if not history:
        return None
    return {k: v for k, v in history[-1].items() if isinstance(v, int | float)}


def _path(p: Path | None) -> str | None:
    return None if p is None else str(p)
