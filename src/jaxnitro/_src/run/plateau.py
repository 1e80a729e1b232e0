"""Reduce the learning rate on a plateau: `Nitro(reduce_lr_on_plateau="val_loss:3:0.5")`.

The rule counts as early stopping does (`early_stop.EarlyStopConfig`, whose counting it
reuses: the same improvement, margin and NaN rules, once per *finished* epoch, after
validation): once `patience` epochs in a row have not improved the metric, every group's
learning rate is multiplied by `factor` (not below `min_lr`) from the next epoch's first step,
and the count starts again. The new rates reach the step as its inputs (`run/rates.py`), so
nothing recompiles; the step lines' `lr` column shows them, and an `other` line
{"key": "reduce_lr_on_plateau", ...} says when and why.

Why not `optax.contrib.reduce_on_plateau`: it is a transformation whose state is updated
by the loss passed to each optimizer update, inside the compiled step. The validation metric
is known on the host, once per epoch, after the step's program ran: feeding it to the step
would add an input to the program, and its counting would run per update, not per
validation. The host rule drives the same learning-rate input the schedules and `jn.set_lr`
drive, and keeps its counters on the host.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from jaxnitro._src.core.errors import MODES, ConfigError, did_you_mean
from jaxnitro._src.run.early_stop import EarlyStopConfig, EarlyStopState

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import RunSpec

_FIX = "write METRIC:PATIENCE:FACTOR[:min|max], e.g. 'val_loss:3:0.5' or 'acc:2:0.1:max'"


@dataclasses.dataclass(frozen=True)
class PlateauRule:
    """Multiply the learning rates by `factor` once `metric` has not improved for `patience`
    finished epochs; never below `min_lr`.

    Example:
        >>> rule = PlateauRule.parse("val_loss:1:0.5")
        >>> state, drop = rule.update(EarlyStopState(), 1, {"val_loss": 0.4})
        >>> rule.update(state, 2, {"val_loss": 0.5})[1]
        True
    """

    metric: str = "val_loss"
    mode: str = "min"
    patience: int = 3
    factor: float = 0.5
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        counter = self.counter  # the metric, mode and patience checked as early_stop's are
        object.__setattr__(self, "mode", counter.mode)
        factor = self.factor
        if isinstance(factor, bool) or not isinstance(factor, int | float) or not 0 < factor < 1:
            raise ConfigError(
                f"reduce_lr_on_plateau factor={factor!r}; pass a number in (0, 1), the "
                f"multiplier of the learning rate on a plateau, e.g. 0.5."
            )
        if not math.isfinite(self.min_lr) or self.min_lr < 0:
            raise ConfigError(f"reduce_lr_on_plateau min_lr={self.min_lr!r}; pass a number >= 0.")

    @property
    def counter(self) -> EarlyStopConfig:
        """The counting: early stopping's rule over the same metric and patience."""
        return EarlyStopConfig(metric=self.metric, mode=self.mode, patience=self.patience)

    @classmethod
    def parse(cls, value: Any) -> PlateauRule | None:
        """The option's value: None, a PlateauRule, or 'METRIC:PATIENCE:FACTOR[:min|max]'
        (the mode defaults as early_stop's does: max for acc-like names, min otherwise)."""
        if value is None or isinstance(value, PlateauRule):
            return value
        if not isinstance(value, str):
            raise ConfigError(f"reduce_lr_on_plateau={value!r}; {_FIX}.")
        from jaxnitro._src.observe.runs import metric_mode

        parts = [p.strip() for p in value.split(":")]
        if len(parts) not in (3, 4) or not parts[0]:
            raise ConfigError(f"reduce_lr_on_plateau={value!r}; {_FIX}.")
        try:
            patience, factor = int(parts[1]), float(parts[2])
        except ValueError:
            raise ConfigError(
                f"reduce_lr_on_plateau={value!r}: patience and factor must be numbers; {_FIX}."
            ) from None
        mode = parts[3] if len(parts) == 4 else metric_mode(parts[0])
        if mode not in MODES:
            raise ConfigError(
                f"reduce_lr_on_plateau={value!r}: mode {mode!r}; {_FIX}."
                + did_you_mean(mode, MODES)
            )
        return cls(metric=parts[0], mode=mode, patience=patience, factor=factor)

    def update(
        self, state: EarlyStopState, epoch: int, metrics: Mapping[str, Any]
    ) -> tuple[EarlyStopState, bool]:
        """One finished epoch's validation `metrics`: (the new state, drop the rate now?).
        A drop starts the count again (the best value is kept)."""
        state, drop = self.counter.update(state, epoch, metrics)
        if drop:
            state = dataclasses.replace(state, bad_epochs=0, stopped_epoch=None)
        return state, drop

    def lowered(self, rates: Mapping[str, float]) -> dict[str, float]:
        """`rates` after a plateau: times `factor`, not below `min_lr` (nor raised to it)."""
        return {g: min(r, max(r * self.factor, self.min_lr)) for g, r in rates.items()}

    def check(self, spec: RunSpec, metrics: Iterable[str], *, has_val: bool) -> None:
        """At setup: the metric is one the run produces, and the rates can move (one run, no
        schedule on the learning rate)."""
        names = sorted(metrics)
        if self.metric not in names:
            extra = "" if has_val else " Add a 'val' split for validation metrics."
            raise ConfigError(
                f"reduce_lr_on_plateau monitors {self.metric!r}, which this run never produces; "
                f"it produces {names}.{did_you_mean(self.metric, names)} Pass "
                f"reduce_lr_on_plateau='METRIC:PATIENCE:FACTOR' with one of these.{extra}"
            )
        if spec.population is not None:
            raise ConfigError(
                "reduce_lr_on_plateau with population=: members' rates are their own; train "
                "the members one by one, or schedule the rate (schedules={'opt.learning_rate': "
                "...})."
            )
        if any(k.endswith("learning_rate") and k.startswith("opt.") for k in spec.schedules.fns):
            raise ConfigError(
                "reduce_lr_on_plateau and a learning-rate schedule both drive the rate; drop "
                "one (the schedule's key 'opt.learning_rate' in schedules(), or the option)."
            )
        if not spec.hyper.learning_rates():
            raise ConfigError(
                "reduce_lr_on_plateau: no learning rate of this run is an input of the step (a "
                "ready optax transformation, or every group frozen); give the rate with the "
                "learning_rate hook."
            )


def after_epoch(n: Nitro, epoch: int, row: Mapping[str, Any]) -> None:
    """The driver's call after finished epoch `epoch`'s (1-based) validation: count (in
    `Progress.plateau`), and on a plateau lower the rates the next epoch takes."""
    from jaxnitro._src.run.rates import learning_rates, with_rates

    rule = n.spec.reduce_lr_on_plateau
    assert rule is not None
    state, drop = rule.update(n.progress.plateau or EarlyStopState(), epoch, row)
    n.take(progress=n.progress.replace(plateau=state))
    if drop:
        before = learning_rates(n)
        after = rule.lowered(before)
        n.take(device=with_rates(n.device, after))
        n.services.log_other(
            {
                "key": "reduce_lr_on_plateau",
                "epoch": epoch,
                "from_step": n.step + 1,
                "metric": rule.metric,
                "best": state.best,
                "rates": after,
                "was": before,
            }
        )
