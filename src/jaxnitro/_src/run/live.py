"""A live handle: change its Device values, read them, ask a run to stop, read its history."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.dist.sharding import to_sharding
from jaxnitro._src.experiment.markers import DEVICE, GRAPH, fields, replace
from jaxnitro._src.optim.groups import live_optimizer
from jaxnitro._src.optim.hyper import rate_slots
from jaxnitro._src.run.history import History
from jaxnitro._src.run.setup import device_array
from jaxnitro._src.steps import population

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Experiment
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import DeviceValues


def set_device(n: Nitro, **values: Any) -> None:
    """Change Device fields of a live handle; no recompile.

    Args:
        n: the run (`jn.Nitro`), idle or training in the background.
        **values: new values by field name, e.g. ``smoothing=0.1``.

    Returns:
        None; the next step uses the new values, and `n.experiment` holds them.

    Raises:
        ConfigError: a name is not a Device field, or a value does not fit its field (shape,
            dtype).

    Example:
        >>> jn.set_device(n, smoothing=0.1)
    """
    arrays = checked_device(n, values)
    experiment = replace(n.experiment, **values)
    n.take(device=with_values(n, arrays, experiment), experiment=experiment)


def with_values(n: Nitro, arrays: dict[str, Any], experiment: Experiment) -> DeviceValues:
    """The handle's Device values with `arrays` (checked by `checked_device`) in, and the
    hyperparameters' base as `experiment` (showing them) gives it now: a learning_rate or
    weight_decay hook that reads a Device field travels with the step's hyperparameters."""
    merged = {**n.device.values, **arrays}
    spec = n.spec
    optimizer = live_optimizer(experiment, spec.optimizer)
    base: Mapping[str, Any] | tuple[Mapping[str, Any], ...]
    if spec.population is None:
        base = spec.hyper.base(optimizer, merged)
        base = {**base, **rate_slots(n.device.rates)}  # jn.set_lr's rates stay
    else:  # (the values carry a member axis)
        base = population.member_bases(spec.population, spec.hyper, optimizer, merged)
    return dataclasses.replace(n.device, values=merged, hyper_base=base)


def checked_device(n: Nitro, values: dict) -> dict:
    """The new Device values as the programs take them (arrays of the old shapes and dtypes);
    a ConfigError for a name that is no Device field or a value that would need a recompile.
    Changes nothing (`jn.RunHandle.set_device` checks at once and applies at a step boundary).
    """
    spec, current = n.spec, n.device.values
    known = {f.name: f for f in fields(n.experiment)}
    new = {}
    for name, value in values.items():
        info = known.get(name)
        if info is None:
            raise ConfigError(
                f"{spec.cls.__name__} has no field {name!r}." + did_you_mean(name, known)
            )
        if info.marker != DEVICE:
            why = (
                "it is baked into the compiled program; build a new Nitro (one recompile)"
                if info.marker == GRAPH
                else "it is driver-only; use dataclasses.replace on the experiment"
            )
            raise ConfigError(
                f"set_device cannot change {info.marker} field {name!r}: {why}. "
                f"Only jn.Device fields are live inputs."
            )
        arr, old = device_array(name, value, spec.replicated), current[name]
        pop = spec.population
        if pop is not None:  # every member takes the value (the ones the population varies: no)
            if name in pop.values:
                raise ConfigError(
                    f"set_device cannot change {name!r} here: the population gives each member "
                    f"its own value ({list(pop.values[name])}). Set it on one member's handle "
                    f"(jn.member(n, i)), or start a population with other values."
                )
            host = np.asarray(jax.device_get(arr))
            if host.shape != old.shape[1:] and host.shape != old.shape:
                raise ConfigError(
                    f"set_device({name}=...) on a population of {pop.size}: pass one value of "
                    f"shape {old.shape[1:]} (every member) or {old.shape} (one per member)."
                )
            arr = to_sharding(np.broadcast_to(host, old.shape), spec.replicated)
        if arr.shape != old.shape or arr.dtype != old.dtype:
            raise ConfigError(
                f"set_device({name}=...) would change its shape/dtype from {old.shape}/"
                f"{old.dtype} to {arr.shape}/{arr.dtype}, which needs a new program. Pass a "
                f"value of the same shape and dtype."
            )
        if f"device.{name}" in spec.schedules.fns:
            raise ConfigError(
                f"set_device cannot change {name!r}: a schedule drives it "
                f"(schedule key 'device.{name}'). Change the schedule instead."
            )
        new[name] = arr
    if values and spec.optimizer is not None:  # a rate hook reading the field: refused here
        live_optimizer(replace(n.experiment, **values), spec.optimizer)
    return new


def device_value(n: Nitro, name: str) -> Any:
    """The current host value of a Device field.

    Args:
        n: the run (`jn.Nitro`).
        name: the Device field's name.

    Returns:
        A Python scalar for a scalar field, else a numpy array.

    Raises:
        ConfigError: `name` is not a Device field of the experiment (close names suggested).

    Example:
        >>> jn.device_value(n, "smoothing")
        0.1
    """
    values = n.device.values
    if name not in values:
        raise ConfigError(
            f"{name!r} is not a Device field; Device fields: {sorted(values)}."
            + did_you_mean(name, values)
        )
    arr = np.asarray(jax.device_get(values[name]))
    return arr.item() if arr.ndim == 0 else arr


def request_stop(n: Nitro) -> None:
    """Ask a running `train` to stop after the current step (validates and checkpoints).

    Args:
        n: the run (`jn.Nitro`) being trained, in this thread (from a callback) or another.

    Returns:
        None; `jn.train` returns at the next step boundary with the stop reason
        ``"requested"``.

    Example:
        >>> jn.every(500, lambda record: jn.request_stop(n), nitro=n)
    """
    n.services.control.request()


def history(n: Nitro) -> History:
    """A row per validation (epoch, step, val metrics; at an epoch's end also train_loss),
    best row by the checkpointer's metric.

    Args:
        n: the run (`jn.Nitro`).

    Returns:
        A `History`: `.rows` in order, `.best` (the best row by the checkpointer's metric).

    Example:
        >>> jn.history(n).best["acc"]
    """
    ck = n.checkpointer
    return History([dict(r) for r in n.progress.history], metric=ck.metric, mode=ck.mode)
