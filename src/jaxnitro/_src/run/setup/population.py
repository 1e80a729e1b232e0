"""Setup of a population (`Nitro(exp, population=...)`): its members' seeds or Device values,
their trees and their Device values, all in one program."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.dist import sharding as sharding_mod
from jaxnitro._src.experiment.markers import fields
from jaxnitro._src.run.settings import Settings
from jaxnitro._src.run.setup.data import device_array
from jaxnitro._src.run.setup.model import build_model
from jaxnitro._src.run.spec import DeviceValues
from jaxnitro._src.steps import population as population_mod

if TYPE_CHECKING:
    from typing import Any

    from jax.sharding import NamedSharding

    from jaxnitro._src.core.types import Experiment, PyTree, Source
    from jaxnitro._src.optim.groups import Optimizer
    from jaxnitro._src.optim.hyper import HyperLayout
    from jaxnitro._src.optim.schedules import Schedules
    from jaxnitro._src.steps.population import Population


def population_of(
    s: Settings,
    exp: Experiment,
    seed: int,
    optimizer: Optimizer,
    train: Source,
    schedules: Schedules,
) -> Population | None:
    """`population=`: the members (seeds, per-member values and rates), or None."""
    if s.population is None:
        return None
    if s.sharding.fsdp or s.sharding.rules:
        raise ConfigError(
            "population= trains small models side by side on replicated parameters; it does "
            "not combine with sharding='fsdp' or sharding rules. Use sharding='dp'."
        )
    markers = {f.name: f.marker for f in fields(exp)}
    rate_keys = [k for k in optimizer.hyper_paths if k.endswith(".learning_rate")]
    pop = population_mod.resolve(
        s.population, seed=seed, device_fields=markers, rate_keys=rate_keys
    )
    return population_mod.with_run(pop, train, seed, schedules)


def member_trees(exp: Experiment, pop: Population, rep: NamedSharding, first: tuple) -> tuple:
    """(params, model state, RNG key) with a member axis: member i built from its seed (the
    first from the run's seed, as built already); one build repeated when seeds are equal."""
    if len(set(pop.seeds)) == 1:
        stacked = population_mod.broadcast(first, pop.size)
    else:
        init: dict = {}  # the members' init program, compiled once
        built = [first] + [build_model(exp, sd, rep, init=init)[1:] for sd in pop.seeds[1:]]
        stacked = population_mod.stack(built)
    return jax.tree.map(lambda x: sharding_mod.to_sharding(x, rep), stacked)


def member_device_values(
    pop: Population, layout: HyperLayout, optimizer: Optimizer, values: Mapping, rep: NamedSharding
) -> DeviceValues:
    """Every Device value with a member axis (a population's own per member), and each
    member's unscheduled hyperparameters (its Device values and learning rates)."""
    per_member = []
    for i in range(pop.size):
        mine = dict(values)
        for k, v in pop.member_values(i).items():
            arr = device_array(k, v, rep)
            if np.can_cast(arr.dtype, values[k].dtype, casting="same_kind"):  # 0 for 0.0
                arr = arr.astype(values[k].dtype)
            mine[k] = arr
        for k, v in mine.items():
            if v.shape != values[k].shape or v.dtype != values[k].dtype:
                raise ConfigError(
                    f"population[{k!r}][{i}] is {v.dtype}{list(v.shape)}, but the field holds "
                    f"{values[k].dtype}{list(values[k].shape)}; give every member a value of "
                    f"the field's type and shape."
                )
        per_member.append(mine)
    stacked = {
        k: sharding_mod.to_sharding(np.stack([np.asarray(m[k]) for m in per_member]), rep)
        for k in values
    }
    return DeviceValues(stacked, population_mod.member_bases(pop, layout, optimizer, stacked))


def on_targets(tree: PyTree, like: Any) -> PyTree:
    """A restored host tree placed like `like` (this run's shardings: a checkpoint from
    another device count or sharding lands on this run's)."""
    return jax.tree.map(lambda x, t: sharding_mod.to_sharding(x, t.sharding), tree, like)
