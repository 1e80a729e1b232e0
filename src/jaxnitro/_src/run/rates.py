"""The learning rate of a live handle, steered by hand (`jn.set_lr`, `RunHandle.set_lr`, the
MCP tool `set_lr`) or by the plateau rule (`Nitro(reduce_lr_on_plateau=...)`), compiling
nothing.

Each group's learning rate is already an input of the train step: it travels in the per-step
hyperparameter vector (`optim/hyper.py`), packed on the host from `DeviceValues.hyper_base`
unless a schedule gives it. A new rate replaces its slot there, and is kept in
`DeviceValues.rates` so that a later `jn.set_device` (which re-reads the rate hooks) does not
undo it. A checkpoint stores them (and the plateau rule's counters), and a resume continues
with them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxnitro._src.core.errors import CheckpointError, ConfigError, did_you_mean
from jaxnitro._src.optim.hyper import rate_slots
from jaxnitro._src.run.early_stop import EarlyStopState

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.progress import Progress
    from jaxnitro._src.run.spec import DeviceValues


def set_lr(n: Nitro, rate: float | Mapping[str, float]) -> None:
    """Set the learning rate the train step takes from its next step on; no recompile.

    Args:
        n: the handle, idle or training in this thread (from a step callback: the run's
            next call takes the rate); a `jn.start` run is steered with `RunHandle.set_lr`.
        rate: the new rate, or {group: rate} for a run with several parameter groups
            (groups not named keep theirs).

    The rate replaces what the `learning_rate` hook gives for the rest of this handle's life
    (its checkpoints store it: a resume continues with it). A group whose rate a schedule
    drives is refused: change the schedule instead.

    Raises:
        ConfigError: a population, a frozen group, a group a schedule drives, an unknown
            group or a rate that is not a positive number (each message names the fix).

    Example:
        >>> jn.set_lr(n, 3e-4)
        >>> jn.learning_rates(n)
        {'default': 0.0003}
    """
    n.take(device=with_rates(n.device, checked_rates(n, rate)))


def learning_rates(n: Nitro) -> dict[str, float]:
    """Each parameter group's unscheduled learning rate, as the next step takes it.

    Args:
        n: the handle.

    Returns:
        {group: rate}, e.g. {'default': 0.001} for a run with one parameter group.

    Raises:
        ConfigError: for a population, whose members each have their own rates.

    Example:
        >>> jn.learning_rates(n)
        {'default': 0.001}
    """
    base = n.device.hyper_base
    if not isinstance(base, Mapping):  # a population: one per member
        raise ConfigError(
            "learning_rates(n) of a population: each member has its own; read a member's "
            "with jn.learning_rates(jn.member(n, i))."
        )
    return {g: float(base[f"opt.{g}.learning_rate"]) for _, g in n.spec.hyper.learning_rates()}


def checked_rates(n: Nitro, rate: float | Mapping[str, float]) -> dict[str, float]:
    """{group: rate} as `set_lr` applies it; a ConfigError naming the fix for a rate the
    running step cannot take without another program. Changes nothing."""
    spec = n.spec
    if spec.population is not None:
        raise ConfigError(
            "set_lr on a population: its members' rates differ (population={'learning_rate': "
            "[...]} or their hooks); set a member's with jn.set_lr(jn.member(n, i), rate)."
        )
    live = [g for _, g in spec.hyper.learning_rates()]
    groups = sorted(spec.optimizer.groups) if spec.optimizer is not None else live
    if not isinstance(rate, Mapping):
        if len(groups) != 1:
            raise ConfigError(
                f"set_lr({rate!r}): this run has {len(groups)} parameter groups {groups}; "
                f"pass one rate per group to change, e.g. set_lr({{{groups[0]!r}: {rate!r}}})."
            )
        rate = {groups[0]: rate}
    out = {}
    for group, value in rate.items():
        if group not in groups:
            raise ConfigError(
                f"set_lr: no parameter group {group!r}; groups: {groups}."
                + did_you_mean(str(group), groups)
            )
        if group not in live:
            raise ConfigError(
                f"set_lr: group {group!r} takes no learning rate as an input of the step (it is "
                f"frozen with rate 0, or its optimizer is a ready optax transformation): build "
                f"a new Nitro with its learning_rate hook giving the rate (one recompile)."
            )
        if f"opt.{group}.learning_rate" in spec.schedules.fns or (
            "opt.learning_rate" in spec.schedules.fns
        ):
            raise ConfigError(
                f"set_lr: a schedule drives the learning rate of group {group!r} (schedules() "
                f"key 'opt.learning_rate'); change the schedule instead."
            )
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
            raise ConfigError(f"set_lr: rate {value!r} of group {group!r} is no number.")
        if not math.isfinite(value) or value < 0:
            raise ConfigError(
                f"set_lr: rate {value!r} of group {group!r}; pass a finite number >= 0."
            )
        out[group] = float(value)
    return out


def with_rates(device: DeviceValues, rates: Mapping[str, float]) -> DeviceValues:
    """`device` with new learning rates {group: rate} (checked by `checked_rates`): the step
    takes them as inputs from the next dispatch on, and they outlive a later `set_device`."""
    assert isinstance(device.hyper_base, Mapping)  # one run (set_lr refuses a population)
    base = {**device.hyper_base, **rate_slots(rates)}
    return dataclasses.replace(device, hyper_base=base, rates={**device.rates, **rates})


def saved_rates(device: DeviceValues, progress: Progress) -> dict[str, Any]:
    """The checkpoint meta entries of the rates set mid-run and the plateau rule's counters."""
    plateau = progress.plateau
    return {
        "rates": dict(device.rates) or None,
        "plateau": dataclasses.asdict(plateau) if plateau is not None else None,
    }


def resumed_rates(
    device: DeviceValues, progress: Progress, meta: Mapping[str, Any], path: Path
) -> tuple[DeviceValues, Progress]:
    """A resume continues with the rates and the plateau counters its checkpoint saved."""
    rates, plateau = meta.get("rates") or {}, meta.get("plateau")
    ok = isinstance(rates, dict) and all(
        isinstance(v, int | float) and math.isfinite(v) and v >= 0 for v in rates.values()
    )
    if not ok or not isinstance(plateau, dict | None):
        raise CheckpointError(
            f"checkpoint {path}: meta fields 'rates'/'plateau' are damaged ({rates!r}, "
            f"{plateau!r}). Resume from another checkpoint."
        )
    if rates and isinstance(device.hyper_base, Mapping):
        base = {**device.hyper_base, **rate_slots(rates)}
        device = dataclasses.replace(device, hyper_base=base, rates=dict(rates))
    if plateau is not None:
        progress = progress.replace(plateau=EarlyStopState(**plateau))
    return device, progress
