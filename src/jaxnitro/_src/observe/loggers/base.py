"""The logger protocol the driver calls, and the loggers built from others: none, several."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from jaxnitro._src.core.errors import ConfigError, warn_user
from jaxnitro._src.observe.loggers.jsonl import JSONLogger, LogWarning
from jaxnitro._src.observe.loggers.rows import step_rows

METHODS = ("open", "log_params", "log_metrics", "log_other", "finish", "close")


@runtime_checkable
class Logger(Protocol):
    """What the driver calls, in this order: `open` once per writing session (the start of
    `jn.train`, or an evaluation that logs), `log_params` once per handle, `log_metrics` /
    `log_other` while it runs, `finish` with the status (completed, early_stop, requested,
    preempted, error), then `close`. Implement these six to send a run somewhere else.

    Optional: `state_dict() -> dict` (JSON-able; saved in every checkpoint) and
    `load_state_dict(d)` (called at setup on a resume, before `open`), for a logger that
    should continue the same remote run after a resume; `flush()`, called before each
    checkpoint is written, for a logger that holds metrics back (a batch for a server, a
    file buffer): it must write or send them all before it returns, since a resume from that
    checkpoint replays only the steps after it. A logger that raises is warned about once
    and dropped (see `FanoutLogger`).

    Example:
        >>> class Printer:
        ...     def open(self, run_dir, *, resume): pass
        ...     def log_params(self, params): print(params["experiment"])
        ...     def log_metrics(self, metrics, *, context, epoch, step): print(step, metrics)
        ...     def log_other(self, values): pass
        ...     def finish(self, status, **info): print(status)
        ...     def close(self): pass
        >>> n = jn.Nitro(MnistMLP(), logger=[jn.JSONLogger(), Printer()])
    """

    def open(self, run_dir: Path, *, resume: bool) -> None: ...
    def log_params(self, params: dict[str, Any]) -> None: ...
    def log_metrics(
        self, metrics: dict[str, Any], *, context: str, epoch: int, step: int
    ) -> None: ...
    def log_other(self, values: dict[str, Any]) -> None: ...
    def finish(self, status: str, **info: Any) -> None: ...
    def close(self) -> None: ...


class NullLogger:
    """`logger=False`: logs nothing."""

    def open(self, run_dir: Path, *, resume: bool) -> None:
        pass

    def log_params(self, params: dict[str, Any]) -> None:
        pass

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        pass

    def log_step_rows(self, rows, *, context: str, epoch: int, steps) -> None:
        pass

    def log_step_columns(self, names, lists, extra, *, context: str, epoch: int, steps) -> None:
        pass

    def log_other(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, status: str, **info: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def flush(self) -> None:
        pass


class FanoutLogger:
    """`logger=[a, b]`: every call goes to each logger in order.

    A logger that fails (any Exception from one of its methods: an MLflow server gone, a full
    disk) is warned about once (`LogWarning`, naming the logger and the error), closed as far
    as it can be, and dropped: training and the other loggers go on. A `JSONLogger` is the
    exception: it handles its own write failures, so what it raises (a log it refuses to
    open) reaches the caller as before. Alone, a logger other than the `JSONLogger` is
    wrapped in a fan-out of one, so the same rule holds.

    `state_dict()` holds each logger's own `state_dict()` (where it has one), keyed by class
    name; checkpoints save it and a resume hands it back to `load_state_dict()`, so the
    loggers reattach to their runs (a TensorBoard dir, an MLflow or W&B run).

    Example:
        >>> n = jn.Nitro(MnistMLP(), logger=[jn.JSONLogger(), jn.TensorBoardLogger()])
    """

    def __init__(self, loggers: list[Any]):
        self.loggers = list(loggers)
        self._all = list(loggers)  # dropped ones too: a resume reattaches them
        self.dropped: list[tuple[Any, Exception]] = []

    def _call(self, method: str, *args: Any, **kwargs: Any) -> None:
        for lg in list(self.loggers):
            if _hardened(lg):
                getattr(lg, method)(*args, **kwargs)
                continue
            try:
                getattr(lg, method)(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - one broken logger must not stop the run
                self._drop(lg, method, e)

    def _drop(self, lg: Any, method: str, e: Exception) -> None:
        self.loggers.remove(lg)
        self.dropped.append((lg, e))
        if method != "close":
            with contextlib.suppress(Exception):  # release what it holds, if it can
                lg.close()
        with contextlib.suppress(Exception):  # a warning filter set to "error" stops here
            warn_user(
                f"logger {type(lg).__name__} failed in {method}(): {e!r}. It is dropped: "
                f"training and the other loggers go on without it.",
                LogWarning,
            )

    def open(self, run_dir: Path, *, resume: bool) -> None:
        opened = []
        try:
            for lg in list(self.loggers):
                if _hardened(lg):
                    lg.open(run_dir, resume=resume)
                else:
                    try:
                        lg.open(run_dir, resume=resume)
                    except Exception as e:  # noqa: BLE001
                        self._drop(lg, "open", e)
                        continue
                opened.append(lg)
        except BaseException:  # a log that cannot be opened: close the ones opened so far
            for lg in opened:
                with contextlib.suppress(Exception):
                    lg.close()
            raise

    def log_params(self, params: dict[str, Any]) -> None:
        self._call("log_params", params)

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        self._call("log_metrics", metrics, context=context, epoch=epoch, step=step)

    def log_step_rows(
        self,
        rows: Sequence[Mapping[str, Any]],
        *,
        context: str,
        epoch: int,
        steps: Sequence[int],
    ) -> None:
        """Each logger takes the rows at once where it can (`log_step_rows`), else one
        `log_metrics` call per row, in order."""
        for lg in list(self.loggers):
            if _hardened(lg):
                log_step_rows(lg, rows, context=context, epoch=epoch, steps=steps)
                continue
            try:
                log_step_rows(lg, rows, context=context, epoch=epoch, steps=steps)
            except Exception as e:  # noqa: BLE001 - one broken logger must not stop the run
                self._drop(lg, "log_metrics", e)

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
        """Each logger takes the columns where it can (`log_step_columns`), else the rows
        they make (`step_rows`, built once for all of them), as `log_step_rows` gives them."""
        rows: list[dict[str, Any]] | None = None
        for lg in list(self.loggers):
            try:
                many = getattr(lg, "log_step_columns", None)
                if callable(many):
                    many(names, lists, extra, context=context, epoch=epoch, steps=steps)
                    continue
                if rows is None:
                    rows = step_rows(names, lists, extra)
                log_step_rows(lg, rows, context=context, epoch=epoch, steps=steps)
            except Exception as e:  # noqa: BLE001 - one broken logger must not stop the run
                if _hardened(lg):
                    raise
                self._drop(lg, "log_metrics", e)

    def log_other(self, values: dict[str, Any]) -> None:
        self._call("log_other", values)

    def log_images(self, images: dict[str, Path], *, step: int) -> None:
        """PNG files (name -> path) to the loggers that take images (`log_images`)."""
        for lg in list(self.loggers):
            send = getattr(lg, "log_images", None)
            if not callable(send):
                continue
            try:
                send(images, step=step)
            except Exception as e:  # noqa: BLE001 - one broken logger must not stop the run
                self._drop(lg, "log_images", e)

    def flush(self) -> None:
        """Every logger that has a `flush()` writes or sends what it holds (before a
        checkpoint is written)."""
        for lg in list(self.loggers):
            if callable(getattr(lg, "flush", None)):
                self._call_one(lg, "flush")

    def _call_one(self, lg: Any, method: str) -> None:
        if _hardened(lg):
            getattr(lg, method)()
            return
        try:
            getattr(lg, method)()
        except Exception as e:  # noqa: BLE001 - one broken logger must not stop the run
            self._drop(lg, method, e)

    def finish(self, status: str, **info: Any) -> None:
        """Reaches every logger; never raises (the driver calls it in its error handler)."""
        for lg in list(self.loggers):
            try:
                lg.finish(status, **info)
            except Exception as e:  # noqa: BLE001 - the others must still finish
                self._drop(lg, "finish", e)

    def close(self) -> None:
        """Reaches every logger; only a `JSONLogger`'s error is re-raised (none is expected)."""
        errors = []
        for lg in list(self.loggers):
            try:
                lg.close()
            except Exception as e:  # noqa: BLE001 - close the rest first
                if _hardened(lg):
                    errors.append(e)
                else:
                    self._drop(lg, "close", e)
        if errors:
            raise errors[0]

    def state_dict(self) -> dict[str, Any]:
        """{class name: that logger's state} for the loggers that have a `state_dict()`."""
        out: dict[str, Any] = {}
        for key, lg in _keyed(self._all):
            fn = getattr(lg, "state_dict", None)
            if not callable(fn):
                continue
            try:
                out[key] = fn()
            except Exception as e:  # noqa: BLE001 - a checkpoint must not fail for a logger
                with contextlib.suppress(Exception):
                    warn_user(
                        f"logger {key}.state_dict() raised {e!r}; a resume starts it afresh.",
                        LogWarning,
                    )
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Hand each logger its saved state (as `state_dict()` keyed it)."""
        if not isinstance(state, dict):
            return
        for key, lg in _keyed(self._all):
            fn = getattr(lg, "load_state_dict", None)
            if key not in state or not callable(fn):
                continue
            try:
                fn(state[key])
            except Exception as e:  # noqa: BLE001
                with contextlib.suppress(Exception):
                    warn_user(
                        f"logger {key}.load_state_dict() raised {e!r}; it starts afresh.",
                        LogWarning,
                    )


def log_step_rows(
    logger: Any,
    rows: Sequence[Mapping[str, Any]],
    *,
    context: str,
    epoch: int,
    steps: Sequence[int],
) -> None:
    """Step lines to `logger`: at once where it has `log_step_rows`, else one `log_metrics`
    call per row (what every `jn.Logger` has).

    Example:
        >>> log_step_rows(NullLogger(), [{"loss": 0.5}], context="train", epoch=1, steps=[1])
    """
    many = getattr(logger, "log_step_rows", None)
    if callable(many):
        many(rows, context=context, epoch=epoch, steps=steps)
        return
    for row, step in zip(rows, steps, strict=True):
        logger.log_metrics(row, context=context, epoch=epoch, step=step)


def log_step_columns(
    logger: Any,
    names: Sequence[str],
    lists: Sequence[Sequence[Any]],
    extra: Mapping[str, Any],
    *,
    context: str,
    epoch: int,
    steps: Sequence[int],
) -> None:
    """Step lines given as columns (`lists[i]`: output `names[i]` per step) with the values
    every line shares (`extra`): as they are where `logger` has `log_step_columns`, else as
    the rows `step_rows` makes (`log_step_rows`).

    Example:
        >>> log_step_columns(NullLogger(), ["loss"], [[0.5]], {"lr": 0.1}, context="train",
        ...                  epoch=1, steps=[1])
    """
    many = getattr(logger, "log_step_columns", None)
    if callable(many):
        many(names, lists, extra, context=context, epoch=epoch, steps=steps)
        return
    rows = step_rows(names, lists, extra)
    log_step_rows(logger, rows, context=context, epoch=epoch, steps=steps)


def flush_logger(logger: Any) -> None:
    """`logger.flush()` where it has one (a user's logger may not): before a checkpoint."""
    flush = getattr(logger, "flush", None)
    if callable(flush):
        flush()


def _hardened(lg: Any) -> bool:
    """The JSONLogger handles its own write failures; what it raises is meant for the user."""
    return isinstance(lg, JSONLogger)


def _keyed(loggers: list[Any]) -> list[tuple[str, Any]]:
    """(class name, logger); a second logger of one class is `<name>#2`, and so on."""
    seen: dict[str, int] = {}
    out = []
    for lg in loggers:
        name = type(lg).__name__
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name}#{seen[name]}", lg))
    return out


def make_logger(value, default) -> Any:
    """The logger a run uses: None → `default()`, False → none, a list → all of them,
    anything else must implement the `jn.Logger` methods (checked here, at setup). Every
    logger but a `JSONLogger` ends up in a `FanoutLogger`, which drops one that fails.

    Example:
        >>> type(make_logger(False, JSONLogger)).__name__
        'NullLogger'
    """
    if value is None:
        return default()
    if value is False:
        return NullLogger()
    if isinstance(value, (list, tuple)):
        if not value:
            raise ConfigError("logger=[] lists no logger; pass logger=False to log nothing.")
        return FanoutLogger([check_logger(v) for v in value])
    logger = check_logger(value)
    if isinstance(logger, (NullLogger, FanoutLogger)) or _hardened(logger):
        return logger
    return FanoutLogger([logger])  # a failing logger is dropped, as in a list


def check_logger(value) -> Any:
    """`value` if it has every `jn.Logger` method, else a ConfigError naming the missing ones.

    Example:
        >>> check_logger(NullLogger()).__class__.__name__
        'NullLogger'
    """
    if isinstance(value, type):
        raise ConfigError(
            f"logger={value.__name__} is the class; pass an instance: "
            f"logger={value.__name__}() (or a list of instances)."
        )
    missing = [m for m in METHODS if not callable(getattr(value, m, None))]
    if missing:
        raise ConfigError(
            f"logger {type(value).__name__} lacks the jn.Logger method(s) {missing}; "
            f"implement open, log_params, log_metrics, log_other, finish and close "
            f"(see jn.Logger), or pass logger=False to log nothing."
        )
    return value


__all__ = [
    "FanoutLogger",
    "Logger",
    "NullLogger",
    "check_logger",
    "flush_logger",
    "log_step_columns",
    "log_step_rows",
    "make_logger",
]
