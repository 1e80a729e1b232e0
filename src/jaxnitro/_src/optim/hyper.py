"""The per-step hyperparameter vector: one layout, packed on the host, unpacked when traced.

Every learning rate, decay and scheduled optimizer hyperparameter (held in the optimizer state
by `optax.inject_hyperparams`) and every scalar float Device field travels to the train step
as one float32 vector per step. `HyperLayout` fixes the order once at setup; `pack` evaluates
the schedules for a step on the host; `unpack` and `write` run inside the traced step and put
the values into the optimizer state by name (`optax.tree_utils.tree_set`), never by position.
Scheduled or not, the program is the same: a schedule never recompiles.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxnitro._src.core.errors import ConfigError

#: A slot: ("opt", "opt.<group>.<hyperparameter>") or ("device", "<Device field>").
Slot = tuple[str, str]


@dataclasses.dataclass(frozen=True)
class HyperLayout:
    """The order of the per-step vector and what each slot holds.

    Attributes:
        slots: ("opt", "opt.<group>.<hp>") for each injected optimizer hyperparameter, then
            ("device", name) for each scalar float Device field.
        groups: optimizer key -> (group, hyperparameter), for writing into the state.
        dtypes: Device field -> its dtype (the vector is float32; unpack casts back).
        single_group: the optimizer has one parameter group (no `multi_transform` level).

    Example:
        >>> layout = HyperLayout.build(optimizer, device_values, schedules)
        >>> vec = layout.pack(0, schedules, layout.base(optimizer, device_values))
        >>> layout.unpack(vec)["opt"]["opt.default.learning_rate"]
    """

    slots: tuple[Slot, ...]
    groups: Mapping[str, tuple[str, str]]
    dtypes: Mapping[str, Any]
    single_group: bool

    @classmethod
    def build(cls, optimizer, device_values: Mapping[str, Any], schedules) -> HyperLayout:
        """The layout of a run; a schedule on a Device field that cannot travel is refused."""
        scalar = {
            k: v.dtype
            for k, v in device_values.items()
            if v.shape == () and jnp.issubdtype(v.dtype, jnp.floating)
        }
        slots = [("opt", k) for k in sorted(optimizer.hyper_paths)]
        slots += [("device", k) for k in sorted(scalar)]
        for key in schedules.fns:
            if key.startswith("device.") and key[len("device.") :] not in scalar:
                raise ConfigError(
                    f"schedule {key!r}: only scalar float Device fields can be scheduled; "
                    f"make the field a jn.Device[float], or drop the schedule."
                )
        return cls(tuple(slots), dict(optimizer.hyper_paths), scalar, optimizer.single_state)

    # -- on the host ------------------------------------------------------------------------
    def base(self, optimizer, device_values: Mapping[str, Any]) -> dict[str, np.float32]:
        """The unscheduled value of every slot (read back once, not every step)."""
        out = dict(host_values(optimizer))
        for kind, key in self.slots:
            if kind == "device":
                out[f"device.{key}"] = np.float32(np.asarray(device_values[key]))
        return out

    def pack(self, step: int, schedules, base: Mapping[str, np.float32]) -> np.ndarray:
        """The vector for optimizer step `step` (0-based): scheduled values win over `base`."""
        scheduled = schedules.values(step) if schedules.fns else {}
        out = np.empty(len(self.slots), np.float32)
        for i, (kind, key) in enumerate(self.slots):
            full = key if kind == "opt" else f"device.{key}"
            out[i] = scheduled[full] if full in scheduled else base[full]
        return out

    def learning_rates(self) -> list[tuple[int, str]]:
        """(slot index, group) of each group's learning rate, in slot order."""
        return [
            (i, self.groups[key][0])
            for i, (kind, key) in enumerate(self.slots)
            if kind == "opt" and key.endswith(".learning_rate")
        ]

    # -- inside the traced step -------------------------------------------------------------
    def unpack(self, vec) -> dict[str, dict[str, Any]]:
        """The vector back into {"opt": {key: value}, "device": {field: value}}."""
        out: dict[str, dict[str, Any]] = {"opt": {}, "device": {}}
        for i, (kind, key) in enumerate(self.slots):
            v = vec[i]
            out[kind][key] = v.astype(self.dtypes[key]) if kind == "device" else v
        return out

    def write(self, opt_state, values: Mapping[str, Any]):
        """`opt_state` with the given optimizer hyperparameters replaced, by name."""
        by_group: dict[str, dict[str, Any]] = {}
        for key, v in values.items():
            group, hp = self.groups[key]
            by_group.setdefault(group, {})[hp] = v
        for group, hps in by_group.items():
            current = read_group(opt_state, group, single=self.single_group)
            cast = {hp: jnp.asarray(v, current[hp].dtype) for hp, v in hps.items()}
            opt_state = optax.tree_utils.tree_set(
                opt_state, _group_filter(group, self.single_group), **cast
            )
        return opt_state


def rate_slots(rates: Mapping[str, float]) -> dict[str, np.float32]:
    """{group: learning rate} as the slots of the per-step vector ("opt.<group>.learning_rate").

    Example:
        >>> rate_slots({"default": 0.01})
        {'opt.default.learning_rate': np.float32(0.01)}
    """
    return {f"opt.{g}.learning_rate": np.float32(r) for g, r in rates.items()}


def _group_filter(group: str, single: bool):
    """Match the `hyperparams` of one group: under `multi_transform`'s `inner_states[group]`."""
    if single:
        return None

    def in_group(path, _value) -> bool:
        return any(
            isinstance(prev, optax.tree_utils.NamedTupleKey)
            and prev.name == "inner_states"
            and isinstance(k, jax.tree_util.DictKey)
            and k.key == group
            for prev, k in zip(path, path[1:], strict=False)
        )

    return in_group


def read_group(opt_state, group: str, *, single: bool) -> dict[str, Any]:
    """{hyperparameter: value} as stored in the optimizer state for one group."""
    found = optax.tree_utils.tree_get_all_with_path(
        opt_state, "hyperparams", _group_filter(group, single)
    )
    if len(found) != 1:
        raise ConfigError(
            f"found {len(found)} hyperparameter tables for group {group!r} in the optimizer "
            f"state, expected one; build the optimizer with jaxnitro's optim hooks (a ready "
            f"optax transformation holds its rates inside it)."
        )
    return dict(found[0][1])


def read(optimizer, opt_state) -> dict[str, Any]:
    """{"opt.<group>.<hp>": value} as stored in the optimizer state.

    Example:
        >>> float(hyper.read(n.optimizer, n.opt_state)["opt.default.learning_rate"])
        0.001
    """
    single = optimizer.single_state
    tables = {g: read_group(opt_state, g, single=single) for g, _ in optimizer.hyper_paths.values()}
    return {key: tables[g][hp] for key, (g, hp) in optimizer.hyper_paths.items()}


def host_values(optimizer) -> dict[str, np.float32]:
    """The unscheduled value of every optimizer hyperparameter, from the optim hooks."""
    from jaxnitro._src.optim.groups import factory_defaults

    out = {}
    for key, (g, hp) in optimizer.hyper_paths.items():
        spec = optimizer.groups[g]
        if hp == "learning_rate":
            out[key] = np.float32(spec.rate)
        elif hp == "weight_decay":
            out[key] = np.float32(spec.weight_decay)
        else:
            out[key] = np.float32(factory_defaults(spec.factory)[hp])
    return out
