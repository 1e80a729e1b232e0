"""Schedules: the table of `schedules()` / `Nitro(schedules=...)` resolved to one host function
per target (an optimizer hyperparameter of a group, or a Device field), and the common
schedule factories `jn.schedules` offers. Their values are written into the optimizer
state's arrays each step, so no schedule recompiles."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import optax

from jaxnitro._src.core.errors import ConfigError, check_int, did_you_mean, warn_user

if TYPE_CHECKING:
    from jaxnitro._src.optim.groups import Optimizer


@dataclasses.dataclass
class Schedules:
    """Resolved schedules: target key -> (step -> value), plus which are learning rates."""

    fns: dict[str, Callable[[int], float]]
    total_steps: int
    multiplier: dict[str, float]  # opt.<g>.learning_rate -> the group's rate (schedule × rate)
    _warned: bool = False

    def values(self, step: int) -> dict[str, np.float32]:
        """Values for optimizer step `step` (0-based) as float32 host scalars."""
        if step >= self.total_steps and not self._warned and self.fns:
            self._warned = True
            warn_user(
                f"training past the schedule horizon ({self.total_steps} steps): "
                f"the last scheduled values hold.",
            )
        t = min(step, self.total_steps - 1)
        return {k: np.float32(f(t) * self.multiplier.get(k, 1.0)) for k, f in self.fns.items()}


def resolve_schedules(
    table: Mapping[str, Any], *, opt: Optimizer, device_fields: Mapping[str, str], total_steps: int
) -> Schedules:
    """Check keys and build per-step functions.

    Keys: "opt.learning_rate" (every group), "opt.<group>.learning_rate", "opt.<hp>",
    "opt.<group>.<hp>", "device.<Device field>". Values: a factory f(total_steps) ->
    (step -> value), a constant, or an optax schedule (step -> value).
    """
    fns: dict[str, Callable] = {}
    mult: dict[str, float] = {}
    groups = sorted(opt.groups)
    known_opt = set(opt.hyper_paths)
    for key, value in table.items():
        targets = _targets(key, groups, known_opt, device_fields)
        fn = _as_fn(key, value, total_steps)
        for t in targets:
            if t in fns:
                raise ConfigError(
                    f"schedule key {key!r} sets {t!r}, which another key sets too; "
                    f"give each target one schedule (drop one of the two keys)."
                )
            fns[t] = fn
            if t.endswith(".learning_rate") and t.startswith("opt."):
                mult[t] = opt.groups[opt.hyper_paths[t][0]].rate
    return Schedules(fns, total_steps, mult)


def _targets(key: str, groups, known_opt, device_fields) -> list[str]:
    if key.startswith("device."):
        name = key[len("device.") :]
        kind = device_fields.get(name)
        if kind == "Device":
            return [key]
        if kind is not None:
            raise ConfigError(
                f"schedule {key!r}: {name!r} is a {kind} field; only jn.Device "
                f"fields can be scheduled (a GraphConst would recompile each step)."
            )
        devices = sorted(k for k, v in device_fields.items() if v == "Device")
        raise ConfigError(
            f"schedule {key!r}: no field {name!r}; the jn.Device fields are {devices}."
            + did_you_mean(name, devices)
        )
    if key.startswith("opt."):
        rest = key[len("opt.") :]
        if rest.count(".") == 1:
            g, hp = rest.split(".")
            if f"opt.{g}.{hp}" in known_opt:
                return [f"opt.{g}.{hp}"]
        else:
            hits = [k for k in known_opt if k.endswith(f".{rest}")]
            if hits:
                return sorted(hits)
        valid = sorted({f"opt.{k.split('.')[2]}" for k in known_opt} | known_opt)
        raise ConfigError(
            f"unknown schedule key {key!r}; valid keys: {valid}." + did_you_mean(key, valid)
        )
    raise ConfigError(
        f"schedule key {key!r} must start with 'opt.' or 'device.'."
        + did_you_mean(key, ["opt.learning_rate"])
    )


def _as_fn(key: str, value, total_steps: int) -> Callable[[int], float]:
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        v = float(value)
        return lambda step: v
    if not callable(value):
        raise ConfigError(
            f"schedule {key!r} must be a factory f(total_steps) -> (step -> value), "
            f"a number, or an optax schedule; got {value!r}."
        )
    # A factory takes total_steps and returns a callable; an optax schedule returns a number.
    try:
        out = value(total_steps)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"schedule {key!r} failed when called with total_steps={total_steps}: {e}. A "
            f"schedule is a factory f(total_steps) -> (step -> value), e.g. "
            f"jn.schedules.warmup_cosine(), or an optax schedule step -> value."
        ) from e
    if callable(out):
        return lambda step: float(out(step))
    return lambda step: float(value(step))


# -- the common schedules (factories; values are multipliers of the group's rate) ------------
def warmup_cosine(warmup: float | int = 0.05, final: float = 0.0):
    """Linear warmup from 0 to 1 (a fraction of total steps, or a step count), then cosine
    decay to `final`.

    Example:
        >>> f = jn.schedules.warmup_cosine(warmup=0.1)(100)  # 100 steps, 10 of warmup
        >>> float(f(0)), float(f(5)), float(f(10)), round(float(f(99)), 3)
        (0.0, 0.5, 1.0, 0.0)
    """

    def factory(total):
        w = int(warmup * total) if isinstance(warmup, float) and warmup < 1 else int(warmup)
        return optax.warmup_cosine_decay_schedule(0.0, 1.0, max(w, 0), max(total, w + 1), final)

    return factory


def one_cycle(peak_fraction: float = 0.3, div: float = 25.0, final_div: float = 1e4):
    """The one-cycle policy as a multiplier: from 1/`div` up to 1 at `peak_fraction` of the
    run, then down to 1/(`div` * `final_div`).

    Example:
        >>> f = jn.schedules.one_cycle(peak_fraction=0.3)(100)
        >>> round(float(f(0)), 2), float(f(30))
        (0.04, 1.0)
    """

    def factory(total):
        return optax.cosine_onecycle_schedule(total, 1.0, peak_fraction, div, final_div)

    return factory


def linear(start: float = 1.0, end: float = 0.0):
    """Linear from `start` to `end` over the run.

    Example:
        >>> f = jn.schedules.linear(1.0, 0.0)(11)
        >>> float(f(0)), float(f(5)), float(f(10))
        (1.0, 0.5, 0.0)
    """

    def factory(total):
        return optax.linear_schedule(start, end, max(total - 1, 1))

    return factory


def step_decay(every: int, factor: float = 0.1):
    """Multiply by `factor` every `every` steps.

    Example:
        >>> f = jn.schedules.step_decay(every=100, factor=0.5)(1000)
        >>> f(99), f(100), f(250)
        (1.0, 0.5, 0.25)
    """
    every = check_int(
        "schedules.step_decay every", every, fix="pass the steps between decays, e.g. every=1000"
    )

    def factory(total):
        return lambda step: factor ** (step // every)

    return factory


def constant(value: float = 1.0):
    """A constant value (switching to or from it never recompiles).

    Example:
        >>> jn.schedules.constant(0.5)(1000)(7)
        0.5
    """
    return lambda total: lambda step: value
