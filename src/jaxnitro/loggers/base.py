"""The logger protocol the driver calls, and the loggers built from others: none, several."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import ConfigError

METHODS = ("open", "log_params", "log_metrics", "log_other", "finish", "close")


@runtime_checkable
class Logger(Protocol):
    """What the driver calls, in this order: `open` once per writing session (the start of
    `jn.train`, or an evaluation that logs), `log_params` once per handle, `log_metrics` /
    `log_other` while it runs, `finish` with the status (completed, early_stop, requested,
    preempted, error), then `close`. Implement these six to send a run somewhere else.

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

    def log_other(self, values: dict[str, Any]) -> None:
        pass

    def finish(self, status: str, **info: Any) -> None:
        pass

    def close(self) -> None:
        pass


class FanoutLogger:
    """`logger=[a, b]`: every call goes to each logger in order. `finish` and `close` reach
    every logger even if one raises (each failure is warned once, then the first re-raised by
    `close`), so one broken logger never leaves another's file open."""

    def __init__(self, loggers: list[Any]):
        self.loggers = list(loggers)

    def open(self, run_dir: Path, *, resume: bool) -> None:
        for lg in self.loggers:
            lg.open(run_dir, resume=resume)

    def log_params(self, params: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_params(params)

    def log_metrics(self, metrics, *, context: str, epoch: int, step: int) -> None:
        for lg in self.loggers:
            lg.log_metrics(metrics, context=context, epoch=epoch, step=step)

    def log_other(self, values: dict[str, Any]) -> None:
        for lg in self.loggers:
            lg.log_other(values)

    def finish(self, status: str, **info: Any) -> None:
        for lg in self.loggers:
            try:
                lg.finish(status, **info)
            except Exception as e:  # noqa: BLE001 - the others must still finish
                warnings.warn(f"logger {type(lg).__name__}.finish raised {e!r}", stacklevel=2)

    def close(self) -> None:
        errors = []
        for lg in self.loggers:
            try:
                lg.close()
            except Exception as e:  # noqa: BLE001 - close the rest first
                errors.append(e)
        if errors:
            raise errors[0]


def make_logger(value, default) -> Any:
    """The logger a run uses: None → `default()`, False → none, a list → all of them,
    anything else must implement the `jn.Logger` methods (checked here, at setup).

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
    return check_logger(value)


def check_logger(value) -> Any:
    """`value` if it has every `jn.Logger` method, else a ConfigError naming the missing ones.

    Example:
        >>> check_logger(NullLogger()).__class__.__name__
        'NullLogger'
    """
    missing = [m for m in METHODS if not callable(getattr(value, m, None))]
    if missing:
        raise ConfigError(
            f"logger {type(value).__name__} lacks the jn.Logger method(s) {missing}; "
            f"implement open, log_params, log_metrics, log_other, finish and close "
            f"(see jn.Logger), or pass logger=False to log nothing."
        )
    return value


__all__ = ["FanoutLogger", "Logger", "NullLogger", "check_logger", "make_logger"]
