"""Early stopping: stop when a validation metric has not improved for `patience` epochs.

Three pieces. `EarlyStopConfig` is the rule, frozen: the monitored metric, its mode, the
patience and the margin (the run keeps it in `RunSpec.early_stop`). `EarlyStopState` is where
the counting is, frozen too (the run keeps it in `Progress.early_stop`, and a checkpoint stores
it, so a resumed run continues counting where it stopped). `EarlyStopConfig.update` is the pure
step between them, `(state, epoch, metrics) -> (new_state, stop)`, called by the driver once per
*finished* epoch, after validation and before the checkpoint. `jn.EarlyStopping` is what a user
passes (`Nitro(early_stop=...)`): the rule, plus the state of a loop written by hand::

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

A population (`Nitro(exp, population=N)`) keeps one state per member (a tuple): a member
whose metric (`<metric>/<i>`) stops improving is frozen, and the run stops when every member
has stopped (`EarlyStopConfig.update_members`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import Any, TypeAlias

import numpy as np

from jaxnitro._src.core.errors import (
    ConfigArgumentError,
    ConfigError,
    MetricsError,
    check_int,
    check_mode,
    did_you_mean,
)

__all__ = ["EarlyStopConfig", "EarlyStopState", "EarlyStopping", "StopState"]

_STATE_VERSION = 1
_SAVED_KEYS = ("metric", "mode", "best", "best_epoch", "bad_epochs", "stopped_epoch")


@dataclasses.dataclass(frozen=True)
class EarlyStopState:
    """Where early stopping is: the best value and its epoch, the consecutive bad epochs, the
    epoch it first said stop (or None) and the last epoch it saw (or None).

    Example:
        >>> EarlyStopState().bad_epochs
        0
    """

    best: float | None = None
    best_epoch: int | None = None
    bad_epochs: int = 0
    stopped_epoch: int | None = None
    last_epoch: int | None = None


#: What `Progress.early_stop` holds: one state, or one per member of a population.
StopState: TypeAlias = EarlyStopState | tuple[EarlyStopState, ...]


@dataclasses.dataclass(frozen=True)
class EarlyStopConfig:
    """The early-stopping rule, validated: stop once ``metric`` has not improved by more than
    ``min_delta`` for ``patience`` consecutive epochs.

    Example:
        >>> rule = EarlyStopConfig(metric="acc", mode="max", patience=1)
        >>> state, stop = rule.update(EarlyStopState(), 1, {"acc": 0.8})
        >>> rule.update(state, 2, {"acc": 0.7})[1]
        True
    """

    metric: str = "val_loss"
    mode: str = "min"
    patience: int = 5
    min_delta: float = 1e-4

    def __post_init__(self) -> None:
        if not isinstance(self.metric, str) or not self.metric:
            raise ConfigError(
                f"EarlyStopping metric={self.metric!r} is invalid; pass the name of a "
                f"validation metric, e.g. metric='val_loss' or metric='acc'."
            )
        mode = check_mode("EarlyStopping mode", self.mode)
        patience = check_int(
            "EarlyStopping patience",
            self.patience,
            fix="pass how many epochs without improvement to allow before stopping, e.g. 5",
        )
        min_delta = self.min_delta
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
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "patience", patience)
        object.__setattr__(self, "min_delta", float(min_delta))

    # -- checks ----------------------------------------------------------------------------
    def check_metric(self, available: Iterable[str], *, has_val: bool = True) -> None:
        """Raise ConfigError (with a did-you-mean) unless ``metric`` is among ``available``.

        Setup calls this with the metric names the run produces (``has_val``: whether it has
        a 'val' split), so a metric the run never produces fails before training, not after
        the first epoch.

        Example:
            >>> EarlyStopConfig(metric="acc").check_metric(["train_loss", "acc", "val_loss"])
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

    # -- the step --------------------------------------------------------------------------
    def should_stop(self, state: EarlyStopState) -> bool:
        """True once ``state.bad_epochs`` has reached ``patience``."""
        return state.bad_epochs >= self.patience

    def improves(self, best: float | None, value: float | None) -> bool:
        """Whether ``value`` counts as an improvement over ``best``."""
        if value is None or not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def update(
        self, state: EarlyStopState, epoch: int, metrics: Mapping[str, Any]
    ) -> tuple[EarlyStopState, bool]:
        """One finished epoch's validation ``metrics`` on ``state``: (the new state, stop?).

        ``epoch`` must increase from call to call (once per finished epoch, not for an epoch a
        stop request cut short). A missing metric is a ConfigError naming the metrics given;
        a NaN/inf/None value counts as an epoch without improvement.

        Example:
            >>> rule = EarlyStopConfig(patience=1)
            >>> state, stop = rule.update(EarlyStopState(), 1, {"val_loss": 0.5})
            >>> stop, rule.update(state, 2, {"val_loss": 0.6})[1]
            (False, True)
        """
        if isinstance(epoch, bool) or not isinstance(epoch, int):
            raise ConfigArgumentError(
                f"EarlyStopping.update(epoch={epoch!r}): epoch must be an int; pass the number "
                f"of the epoch that just finished, e.g. update(3, metrics)."
            )
        if state.last_epoch is not None and epoch <= state.last_epoch:
            raise ConfigError(
                f"EarlyStopping.update(epoch={epoch}) after epoch {state.last_epoch}: call "
                f"update once per finished epoch, with increasing epochs (after a resume, "
                f"restore the saved state with load_state_dict instead of replaying epochs)."
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
        if self.improves(state.best, value):
            state = dataclasses.replace(state, best=value, best_epoch=epoch, bad_epochs=0)
        else:
            state = dataclasses.replace(state, bad_epochs=state.bad_epochs + 1)
        state = dataclasses.replace(state, last_epoch=epoch)
        if not self.should_stop(state):
            return state, False
        if state.stopped_epoch is None:
            state = dataclasses.replace(state, stopped_epoch=epoch)
        return state, True

    def update_members(
        self, states: tuple[EarlyStopState, ...], epoch: int, metrics: Mapping[str, Any]
    ) -> tuple[tuple[EarlyStopState, ...], bool]:
        """`update` for each member of a population, from its `<metric>/<i>` value (a member
        that stopped is left as it is): (the new states, whether every member has stopped).

        Example:
            >>> rule = EarlyStopConfig(patience=1)
            >>> states = (EarlyStopState(), EarlyStopState())
            >>> states, _ = rule.update_members(states, 1, {"val_loss/0": 1, "val_loss/1": 1})
            >>> states, stop = rule.update_members(states, 2, {"val_loss/0": 0.5, "val_loss/1": 2})
            >>> [s.bad_epochs for s in states], stop
            ([0, 1], False)
        """
        new = []
        for i, s in enumerate(states):
            if not self.should_stop(s):
                own = {**metrics, self.metric: metrics.get(f"{self.metric}/{i}")}
                s = self.update(s, epoch, own)[0]
            new.append(s)
        return tuple(new), all(self.should_stop(s) for s in new)

    def advance(
        self, state: StopState, epoch: int, metrics: Mapping[str, Any]
    ) -> tuple[StopState, bool]:
        """`update` or, for a population's tuple of states, `update_members`."""
        if isinstance(state, tuple):
            return self.update_members(state, epoch, metrics)
        return self.update(state, epoch, metrics)

    def active(self, states: tuple[EarlyStopState, ...]) -> np.ndarray:
        """Which members still train (a (members,) bool vector, an input of the program)."""
        return np.array([not self.should_stop(s) for s in states])

    # -- persistence -----------------------------------------------------------------------
    def to_json(self, state: StopState) -> dict[str, Any]:
        """A JSON-safe dict of the rule and the state (a checkpoint stores it); for a
        population ``{"members": [one per member]}``.

        Example:
            >>> EarlyStopConfig(metric="acc", mode="max").to_json(EarlyStopState())["bad_epochs"]
            0
        """
        if isinstance(state, tuple):
            return {"members": [self.to_json(s) for s in state]}
        return {
            "version": _STATE_VERSION,
            "metric": self.metric,
            "mode": self.mode,
            "patience": self.patience,
            "min_delta": self.min_delta,
            **dataclasses.asdict(state),
        }

    def from_json(self, saved: Any) -> EarlyStopState:
        """The state `to_json` saved (on resume). The monitored metric and mode must match (a
        best value of another metric or direction means nothing); ``patience`` and
        ``min_delta`` are this rule's, so a resumed run may change them.

        Example:
            >>> rule = EarlyStopConfig(metric="acc", mode="max")
            >>> rule.from_json(rule.to_json(EarlyStopState(best=0.9, best_epoch=2))).best
            0.9
        """
        if not isinstance(saved, Mapping):
            raise ConfigArgumentError(
                f"EarlyStopping.load_state_dict takes the dict state_dict() "
                f"returned, got {type(saved).__name__}; pass es.state_dict() (e.g. from the "
                f"checkpoint's meta)."
            )
        missing = [k for k in _SAVED_KEYS if k not in saved]
        if missing:
            raise ConfigError(
                f"EarlyStopping.load_state_dict: the state lacks {missing}; pass "
                f"what state_dict() returned."
            )
        if (saved["metric"], saved["mode"]) != (self.metric, self.mode):
            raise ConfigError(
                f"cannot restore early stopping: the checkpoint monitored {saved['metric']!r} "
                f"(mode {saved['mode']!r}) but this run monitors {self.metric!r} (mode "
                f"{self.mode!r}). Resume with the same EarlyStopping(metric=, mode=), or start "
                f"a new run_dir."
            )
        last = saved.get("last_epoch")
        return EarlyStopState(
            best=None if saved["best"] is None else float(saved["best"]),
            best_epoch=None if saved["best_epoch"] is None else int(saved["best_epoch"]),
            bad_epochs=int(saved["bad_epochs"]),
            stopped_epoch=None if saved["stopped_epoch"] is None else int(saved["stopped_epoch"]),
            last_epoch=None if last is None else int(last),
        )

    def members_from_json(self, saved: Any, size: int) -> tuple[EarlyStopState, ...]:
        """The per-member states of a population of `size` that `to_json` saved."""
        members = saved.get("members") if isinstance(saved, Mapping) else None
        if not isinstance(members, list) or len(members) != size:
            raise ConfigError(
                f"cannot restore per-member early stopping from {saved!r}: the checkpoint was "
                f"not written by a population of {size} with early stopping."
            )
        return tuple(self.from_json(s) for s in members)

    def start(self, saved: Any, *, members: int | None) -> StopState:
        """The state a run starts from: restored from a checkpoint's `saved` JSON, or fresh
        when there is none; one per member for a population of `members`."""
        if members is None:
            return EarlyStopState() if saved is None else self.from_json(saved)
        if saved is None:
            return (EarlyStopState(),) * members
        return self.members_from_json(saved, members)


class EarlyStopping:
    """Stop training when ``metric`` has not improved by more than ``min_delta`` for
    ``patience`` consecutive epochs.

    Pass it as ``jn.Nitro(exp, early_stop=...)``: the run keeps its rule (``config``) and counts
    in its own `Progress`, leaving this object as it is. In a loop of your own, ``update`` once
    per finished epoch.

    Args:
        metric: the validation metric to monitor (a key of the validation results, e.g.
            "val_loss" or "acc").
        mode: "min" (lower is better) or "max" (higher is better).
        patience: epochs without improvement after which training stops (an int >= 1).
        min_delta: the margin an epoch must beat the best value by to count as an
            improvement (a finite float >= 0).

    Attributes:
        config: the rule, a frozen `EarlyStopConfig`.
        state: the counters, a frozen `EarlyStopState`, replaced by each ``update``.
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
        self.config = EarlyStopConfig(metric, mode, patience, min_delta)
        self.state = EarlyStopState()

    # -- the rule and the state, read through ------------------------------------------------
    @property
    def metric(self) -> str:
        return self.config.metric

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def patience(self) -> int:
        return self.config.patience

    @property
    def min_delta(self) -> float:
        return self.config.min_delta

    @property
    def best(self) -> float | None:
        return self.state.best

    @property
    def best_epoch(self) -> int | None:
        return self.state.best_epoch

    @property
    def bad_epochs(self) -> int:
        return self.state.bad_epochs

    @property
    def stopped_epoch(self) -> int | None:
        return self.state.stopped_epoch

    @property
    def last_epoch(self) -> int | None:
        return self.state.last_epoch

    @property
    def should_stop(self) -> bool:
        """True once ``bad_epochs`` has reached ``patience``."""
        return self.config.should_stop(self.state)

    def reset(self) -> None:
        """Forget every epoch seen (a fresh run)."""
        self.state = EarlyStopState()

    def check_metric(self, available: Iterable[str], *, has_val: bool = True) -> None:
        """Raise ConfigError (with a did-you-mean) unless ``metric`` is among ``available``.

        Example:
            >>> jn.EarlyStopping(metric="acc").check_metric(["train_loss", "acc", "val_loss"])
        """
        self.config.check_metric(available, has_val=has_val)

    def improves(self, value: float | None) -> bool:
        """Whether ``value`` would count as an improvement over ``best`` (no state change)."""
        return self.config.improves(self.state.best, value)

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
        self.state, stop = self.config.update(self.state, epoch, metrics)
        return stop

    # -- persistence -----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """A JSON-safe dict of the settings and counters (store it in the checkpoint).

        Example:
            >>> jn.EarlyStopping(metric="acc", mode="max").state_dict()["bad_epochs"]
            0
        """
        return self.config.to_json(self.state)

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
        self.state = self.config.from_json(state)

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
