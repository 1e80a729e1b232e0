"""Population training: N members of one experiment in ONE compiled program (`jax.vmap`).

`jn.Nitro(exp, population=N)` trains N members, member i from seed `seed + i` (its
initialisation, its dropout and, for a shuffled `jn.DataLoader` seeded by the run, its data
order); `population={"smoothing": [0.0, 0.05, 0.1]}` trains one member per value of Device
fields or learning rates (`"opt.learning_rate"`, `"opt.<group>.learning_rate"`), every member
with the run's seed, so members differ only in those values. Parameters, optimizer and model
states, RNG keys and Device values carry a leading member axis; the train and eval programs are
the single-member programs under `vmap`: one compile and one dispatch per step for all members.

Member i is the standalone run with the same seed and values. Validation reports every
member's metrics (`acc/0`, `acc/1`, ...) and, under the metric's plain name, the best member's
(`member` names it), so checkpoints, early stopping and the history follow the best member;
`jn.member(n, i)` returns a normal handle for one member (to predict, export, serve).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.experiment.markers import DEVICE

if TYPE_CHECKING:
    from jaxnitro._src.core.types import PyTree, Source
    from jaxnitro._src.optim.groups import Optimizer
    from jaxnitro._src.optim.hyper import HyperLayout
    from jaxnitro._src.optim.schedules import Schedules


@dataclasses.dataclass(frozen=True)
class Population:
    """The members of a population run.

    Attributes:
        size: the number of members.
        seeds: each member's seed (its init, RNG stream and derived data order).
        values: Device field -> one value per member (fields not named keep the experiment's).
        rates: "opt.<group>.learning_rate" -> one rate per member.
        labels: the user's rate keys ("learning_rate", "opt.learning_rate" or
            "opt.<group>.learning_rate") -> one rate per member, as the rows report them.
        own_data: members draw their own shuffled order of the train split (their seeds
            differ and the train loader is shuffled by the run's seed).
    """

    size: int
    seeds: tuple[int, ...]
    values: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    rates: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    own_data: bool = False
    loaders: tuple | None = None  # with own_data: each member's train loader
    schedules: tuple | None = None  # each member's resolved schedules (its rates)
    labels: Mapping[str, tuple] = dataclasses.field(default_factory=dict)

    def member_values(self, i: int) -> dict[str, Any]:
        """Member i's Device values (only the fields the population varies)."""
        return {k: v[i] for k, v in self.values.items()}

    def describe(self, i: int) -> dict[str, Any]:
        """What sets member i apart: its seed, values and rates (under the user's keys)."""
        return {"member": i, "seed": self.seeds[i], **self.member_values(i),
                **{k: v[i] for k, v in (self.labels or self.rates).items()}}  # fmt: skip

    def key(self) -> tuple:
        """What the compiled programs depend on: the member count and the data layout."""
        return (self.size, self.own_data)


def resolve(
    setting: Any, *, seed: int, device_fields: Mapping[str, str], rate_keys: Any
) -> Population:
    """The members of `setting` (as `options` checked it) for a run with this seed.

    Args:
        device_fields: every field of the experiment -> its marker (DEVICE, GRAPH, HOST).
        rate_keys: the "opt.<group>.learning_rate" keys the optimizer can take per step.
    """
    if isinstance(setting, int):
        return Population(setting, tuple(seed + i for i in range(setting)))
    sizes = set()
    values: dict[str, tuple] = {}
    rates: dict[str, tuple] = {}
    labels: dict[str, tuple] = {}  # the rates under the keys the user gave
    for key, seq in setting.items():
        if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or len(seq) == 0:
            raise ConfigError(
                f"population[{key!r}] must be a non-empty list of per-member values, got {seq!r}."
            )
        sizes.add(len(seq))
        if key in ("opt.learning_rate", "learning_rate"):
            for k in rate_keys:
                rates[k] = tuple(float(v) for v in seq)
            labels[key] = tuple(float(v) for v in seq)
            continue
        if key.startswith("opt."):
            if key not in rate_keys:
                raise ConfigError(
                    f"population key {key!r}: the per-member optimizer values are learning "
                    f"rates, {sorted(rate_keys) or 'none here (a ready optax transformation)'}."
                    + did_you_mean(key, rate_keys)
                )
            rates[key] = labels[key] = tuple(float(v) for v in seq)
            continue
        marker = device_fields.get(key)
        if marker != DEVICE:
            if key == "seed":
                why = "members that differ by seed come from population=N (seeds seed..seed+N-1)."
            elif marker is not None:
                why = (
                    f"it is a {marker} field: members share one compiled program, so only "
                    f"Device fields (traced inputs) and learning rates can differ."
                )
            else:
                why = "the experiment has no such field." + did_you_mean(key, device_fields)
            raise ConfigError(f"population key {key!r}: {why}")
        values[key] = tuple(seq)
    if len(sizes) != 1:
        raise ConfigError(
            f"population lists have different lengths "
            f"{ {k: len(v) for k, v in setting.items()} }; give every key one value per member."
        )
    size = sizes.pop()
    return Population(size, (seed,) * size, values, rates, labels=labels)


# -- trees with a member axis ----------------------------------------------------------------
def stack(trees: Sequence[Any]) -> PyTree:
    """One tree whose leaves stack the members' leaves on a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def broadcast(tree: PyTree, size: int) -> PyTree:
    """`tree` repeated for `size` members (a leading axis)."""
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (size, *jnp.shape(x))), tree)


def take(tree: PyTree, i: int) -> PyTree:
    """Member i's slice of a tree with a member axis."""
    return jax.tree.map(lambda x: x[i], tree)


def with_run(pop: Population, loader: Source, run_seed: int, schedules: Schedules) -> Population:
    """`pop` with each member's train loader and schedules.

    Members draw their own train order when their seeds differ and the train split is a
    shuffled `jn.DataLoader` seeded by the run (a standalone run with the member's seed
    would shuffle so); a scheduled learning rate follows each member's own rate.
    """
    from jaxnitro._src.data.loader import DataLoader

    own = (
        isinstance(loader, DataLoader)
        and loader.shuffle
        and loader.seed == run_seed
        and len(set(pop.seeds)) > 1
    )
    loaders = None
    if own and getattr(loader, "workers", None):
        raise ConfigError(
            f"population={pop.size}: each member draws its own shuffled order of the train "
            f"split (its seed), and with transform workers that would start a worker pool per "
            f"member. Give the train DataLoader a seed (DataLoader(..., seed=0)) so the members "
            f"share one order, or use workers=0."
        )
    if own:
        loaders = []
        for s in pop.seeds:
            mine = copy.copy(loader)  # the arrays are shared; only the shuffle seed differs
            mine.seed = s
            loaders.append(mine)
    member_schedules = tuple(
        dataclasses.replace(
            schedules,
            multiplier={
                **schedules.multiplier,
                **{k: v[i] for k, v in pop.rates.items() if k in schedules.multiplier},
            },
        )
        for i in range(pop.size)
    )
    return dataclasses.replace(
        pop,
        own_data=own,
        loaders=tuple(loaders) if loaders else None,
        schedules=member_schedules,
    )


def member_bases(
    pop: Population, layout: HyperLayout, optimizer: Optimizer, stacked: Mapping[str, Any]
) -> tuple:
    """Each member's unscheduled per-step hyperparameters: from its Device values (`stacked`
    holds them with a member axis) and its learning rates."""
    bases = []
    for i in range(pop.size):
        base = dict(layout.base(optimizer, {k: v[i] for k, v in stacked.items()}))
        base.update({k: np.float32(v[i]) for k, v in pop.rates.items()})
        bases.append(base)
    return tuple(bases)


# -- metrics of the members --------------------------------------------------------------
def member_metrics(values: Sequence[Mapping[str, Any]], *, metric: str | None, mode: str) -> Any:
    """Every member's scalar metrics as `name/i`, and the best member's under their names
    (best by `metric` and `mode`; a member without a finite value never wins)."""
    best = best_member(values, metric=metric, mode=mode)
    out: dict[str, Any] = dict(values[best])
    out["member"] = best
    for i, row in enumerate(values):
        for k, v in row.items():
            if isinstance(v, (int, float)) or v is None:
                out[f"{k}/{i}"] = v
    return out


def best_member(values: Sequence[Mapping[str, Any]], *, metric: str | None, mode: str) -> int:
    """The index of the best member by `metric` (member 0 when no member has it)."""
    if metric is None:
        metric = "val_loss" if "val_loss" in values[0] else None
        mode = "min"
    scored = [
        (float(row[metric]), i)
        for i, row in enumerate(values)
        if metric is not None
        and isinstance(row.get(metric), (int, float))
        and math.isfinite(float(row[metric]))
    ]
    if not scored:
        return 0
    return (min(scored) if mode == "min" else max(scored, key=lambda s: (s[0], -s[1])))[1]


def ranked(
    pop: Population, rows: Sequence[Mapping[str, Any]], *, metric: Any, mode: Any
) -> list[dict[str, Any]]:
    """The members best first (by the checkpointer's metric), each with its values."""
    out = [{**pop.describe(i), **dict(rows[i])} for i in range(pop.size)]
    key_metric = metric if metric is not None else "val_loss"

    def score(row: Any) -> float:
        v = row.get(key_metric)
        if not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            return math.inf
        return float(v) if mode == "min" or metric is None else -float(v)

    return sorted(out, key=lambda r: (score(r), r["member"]))


# -- one member as a normal handle ----------------------------------------------------------
class _PopulationSpec(Protocol):
    @property
    def population(self) -> Population | None: ...


class OneOrMany(Protocol):
    """What `refuse` reads of a run (a `jn.Nitro` is one): whether it trains a population."""

    @property
    def spec(self) -> _PopulationSpec: ...


def refuse(n: OneOrMany, what: str) -> None:
    """`what` works on one model: a population handle says how to pick a member."""
    pop = n.spec.population
    if pop is not None:
        raise ConfigError(
            f"{what} works on one model, and this handle trains a population of {pop.size}. "
            f"Pick a member: jn.{what.removeprefix('jn.')}(jn.member(n, i), ...) (jn.train(n)"
            f".members ranks them, best first)."
        )
