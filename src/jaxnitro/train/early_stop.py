"""Early stopping: stop when a validation metric has not improved for `patience` epochs.

The driver calls `update(epoch, metrics)` once per *finished* epoch, after validation and
before the checkpoint, and stores `state_dict()` in the checkpoint so that a resumed run
continues counting where it stopped::

    es = jn.EarlyStopping(metric="acc", mode="max", patience=3)
    for epoch in range(1, max_epochs + 1):
        ...
        if es.update(epoch, {"acc": 0.91, "val_loss": 0.3}):
            break                       # es.stopped_epoch == epoch

Rules:

- an epoch *improves* when its value beats the best so far by more than ``min_delta``
  (``value < best - min_delta`` for ``mode="min"``, ``value > best + min_delta`` for "max");
  the first finite value always improves;
- an epoch that does not improve (including a NaN/inf/None value) is a *bad* epoch;
  ``bad_epochs`` counts consecutive bad epochs and resets to 0 on an improvement;
- ``update`` returns True (stop) once ``bad_epochs >= patience``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from jaxnitro.core.errors import (
    ConfigArgumentError,
    ConfigError,
    MetricsError,
    check_int,
    check_mode,
    did_you_mean,
)

__all__ = ["EarlyStopping"]

_STATE_VERSION = 1


class EarlyStopping:
    """Stop training when ``metric`` has not improved by more than ``min_delta`` for
    ``patience`` consecutive epochs.

    Args:
        metric: the validation metric to monitor (a key of the validation results, e.g.
            "val_loss" or "acc").
        mode: "min" (lower is better) or "max" (higher is better).
        patience: epochs without improvement after which training stops (an int >= 1).
        min_delta: the margin an epoch must beat the best value by to count as an
            improvement (a finite float >= 0).

    Attributes:
        best: the best value seen so far (None before the first finite value).
        best_epoch: the epoch that produced ``best`` (None before it).
        bad_epochs: consecutive epochs without improvement.
        stopped_epoch: the epoch at which ``update`` first returned True, or None.
        last_epoch: the last epoch passed to ``update``, or None.

    Example:
        >>> es = jn.EarlyStopping(metric="acc", mode="max", patience=3)
        >>> es.update(1, {"acc": 0.80})
        False
    """

    def __init__(
        self,
        metric: str = "val_loss",
        mode: str = "min",
        patience: int = 5,
        min_delta: float = 1e-4,
    ) -> None:
        if not isinstance(metric, str) or not metric:
            raise ConfigError(
                f"EarlyStopping metric={metric!r} is invalid; pass the name of a "
                f"validation metric, e.g. metric='val_loss' or metric='acc'."
            )
        mode = check_mode("EarlyStopping mode", mode)
        patience = check_int(
            "EarlyStopping patience",
            patience,
            fix="pass how many epochs without improvement to allow before stopping, e.g. 5",
        )
        if (
            isinstance(min_delta, bool)
            or not isinstance(min_delta, int | float)
            or not math.isfinite(min_delta)
            or min_delta < 0
        ):
            raise ConfigError(
                f"EarlyStopping min_delta={min_delta!r} is invalid; pass a finite "
                f"number >= 0 (the margin an epoch must beat the best value by)."
            )
        self.metric, self.mode = metric, mode
        self.patience, self.min_delta = patience, float(min_delta)
        self.reset()

    # -- state ---------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget every epoch seen (a fresh run)."""
        self.best: float | None = None
        self.best_epoch: int | None = None
        self.bad_epochs = 0
        self.stopped_epoch: int | None = None
        self.last_epoch: int | None = None

    @property
    def should_stop(self) -> bool:
        """True once ``bad_epochs`` has reached ``patience``."""
        return self.bad_epochs >= self.patience

    def check_metric(self, available: Iterable[str], *, has_val: bool = True) -> None:
        """Raise ConfigError (with a did-you-mean) unless ``metric`` is among ``available``.

        The driver calls this at setup with the metric names the run produces (``has_val``:
        whether it has a 'val' split), so a metric the run never produces fails before
        training, not after the first epoch.

        Example:
            >>> jn.EarlyStopping(metric="acc").check_metric(["train_loss", "acc", "val_loss"])
        """
        names = sorted(available)
        if self.metric not in names:
            no_val = "" if has_val else " Add a 'val' split for validation metrics."
            raise self._missing(
                f"which this run never produces; it produces {names}", names, no_val
            )

    def _missing(self, found: str, names: list[str], extra: str = "") -> ConfigError:
        """The error for a monitored metric absent from ``names``: what is there, the closest
        name, and the fix."""
        return ConfigError(
            f"early stopping monitors {self.metric!r}, {found}."
            f"{did_you_mean(self.metric, names)} Pass EarlyStopping(metric=...) with one of "
            f"these.{extra}"
        )

    def improves(self, value: float | None) -> bool:
        """Whether ``value`` would count as an improvement over ``best`` (no state change)."""
        if value is None or not math.isfinite(value):
            return False
        if self.best is None:
            return True
        if self.mode == "min":
            return value < self.best - self.min_delta
        return value > self.best + self.min_delta

    def update(self, epoch: int, metrics: Mapping[str, Any]) -> bool:
        """Record one finished epoch's validation ``metrics``; return True to stop training.

        ``epoch`` must increase from call to call (call once per finished epoch, not for an
        epoch a stop request cut short). A missing metric is a ConfigError naming the metrics
        given; a NaN/inf/None value counts as an epoch without improvement.

        Example:
            >>> es = jn.EarlyStopping(metric="val_loss", patience=1)
            >>> es.update(1, {"val_loss": 0.5}), es.update(2, {"val_loss": 0.6})
            (False, True)
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ConfigArgumentError(
                f"EarlyStopping.update(epoch={epoch!r}): epoch must be an int; pass the number "
                f"of the epoch that just finished, e.g. update(3, metrics)."
            )
        if self.last_epoch is not None and epoch <= self.last_epoch:
            raise ConfigError(
                f"EarlyStopping.update(epoch={epoch}) after epoch {self.last_epoch}: call update "
                f"once per finished epoch, with increasing epochs (after a resume, restore the "
                f"saved state with load_state_dict instead of replaying epochs)."
            )
        if not isinstance(metrics, Mapping):
            raise ConfigArgumentError(
                f"EarlyStopping.update(metrics=...) takes a dict name -> value, got "
                f"{type(metrics).__name__}; pass the epoch's validation results, e.g. "
                f"{{'val_loss': 0.3}}."
            )
        if self.metric not in metrics:
            names = sorted(map(str, metrics))
            raise self._missing(f"but epoch {epoch}'s metrics are {names}", names)
        value = _as_float(self.metric, metrics[self.metric])
        self.last_epoch = epoch
        if self.improves(value):
            self.best, self.best_epoch, self.bad_epochs = value, epoch, 0
        else:
            self.bad_epochs += 1
        if self.should_stop:
            if self.stopped_epoch is None:
                self.stopped_epoch = epoch
            return True
        return False

    # -- persistence -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the settings and counters (store it in the checkpoint).

        Example:
            >>> jn.EarlyStopping(metric="acc", mode="max").state_dict()["bad_epochs"]
            0
        """
        return {
            "version": _STATE_VERSION,
            "metric": self.metric,
            "mode": self.mode,
            "patience": self.patience,
            "min_delta": self.min_delta,
            "best": self.best,
            "best_epoch": self.best_epoch,
            "bad_epochs": self.bad_epochs,
            "stopped_epoch": self.stopped_epoch,
            "last_epoch": self.last_epoch,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the counters saved by ``state_dict`` (on resume).

        The monitored metric and mode must match (a best value of another metric or
        direction means nothing); ``patience`` and ``min_delta`` come from this object, so a
        resumed run may change them.

        Example:
            >>> saved = jn.EarlyStopping(metric="acc", mode="max").state_dict()
            >>> resumed = jn.EarlyStopping(metric="acc", mode="max", patience=10)
            >>> resumed.load_state_dict(saved)
        """
        if not isinstance(state, Mapping):
            raise ConfigArgumentError(
                f"EarlyStopping.load_state_dict takes the dict state_dict() "
                f"returned, got {type(state).__name__}; pass es.state_dict() (e.g. from the "
                f"checkpoint's meta)."
            )
        missing = [
            k
            for k in ("metric", "mode", "best", "best_epoch", "bad_epochs", "stopped_epoch")
            if k not in state
        ]
        if missing:
            raise ConfigError(
                f"EarlyStopping.load_state_dict: the state lacks {missing}; pass "
                f"what state_dict() returned."
            )
        if (state["metric"], state["mode"]) != (self.metric, self.mode):
            raise ConfigError(
                f"cannot restore early stopping: the checkpoint monitored {state['metric']!r} "
                f"(mode {state['mode']!r}) but this run monitors {self.metric!r} (mode "
                f"{self.mode!r}). Resume with the same EarlyStopping(metric=, mode=), or start "
                f"a new run_dir."
            )
        best = state["best"]
        self.best = None if best is None else float(best)
        self.best_epoch = None if state["best_epoch"] is None else int(state["best_epoch"])
        self.bad_epochs = int(state["bad_epochs"])
        self.stopped_epoch = None if state["stopped_epoch"] is None else int(state["stopped_epoch"])
        last = state.get("last_epoch")
        self.last_epoch = None if last is None else int(last)

    def __repr__(self) -> str:
        return (
            f"EarlyStopping(metric={self.metric!r}, mode={self.mode!r}, "
            f"patience={self.patience}, min_delta={self.min_delta:g}; best={self.best}, "
            f"best_epoch={self.best_epoch}, bad_epochs={self.bad_epochs})"
        )


def _as_float(name: str, value: Any) -> float | None:
    if value is None:
        return None
    shape = getattr(value, "shape", ())
    if shape not in ((), (1,)):
        raise MetricsError(
            f"early stopping monitors {name!r}, whose value has shape {shape}; "
            f"it needs a scalar metric (sum, count) pair, not a per-class array. Monitor a "
            f"scalar metric, or reduce this one in finalize_metrics."
        )
    try:
        return float(value[0] if shape == (1,) else value)
    except (TypeError, ValueError):
        raise MetricsError(
            f"early stopping monitors {name!r}, whose value {value!r} is not a number; "
            f"return a number (or a 0-d array) for it."
        ) from None
