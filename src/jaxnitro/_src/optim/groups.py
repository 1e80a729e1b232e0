"""Param groups, decoupled weight decay and clipping, built from optax pieces.

Each group's rule is an optax *factory* (`optax.radam`, `partial(optax.sgd, momentum=0.9)`):
its update at unit rate is followed by decoupled decay and the group's learning rate, all
wrapped in `optax.inject_hyperparams` so that every rate and hyperparameter lives in the
optimizer state as a strongly typed array. Schedules are evaluated on the host and written into
those arrays each step: a schedule never recompiles, and neither does switching a key between a
constant and a schedule (`schedules`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxnitro._src.core.errors import ConfigError

DEFAULT_GROUP = "default"


# -- the hooks' defaults -----------------------------------------------------------------
def path_str(path) -> str:
    """'hidden/kernel' for a key path (NNX's trailing `.value` dropped)."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            if k.name != "value":
                parts.append(k.name)
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    return "/".join(parts)


def _hook(exp, name: str):
    fn = getattr(type(exp), name, None)
    return None if fn is None else functools.partial(fn, exp)


# -- decoupled decay toward zero or toward the initial weights -----------------------------
class DecayState(NamedTuple):
    anchor: Any  # the initial weights for decay_anchor="w0"; an empty tuple for "zero"


def decoupled_decay(weight_decay, *, toward_initial: bool) -> optax.GradientTransformation:
    """Add −λ·(p − anchor) to unit-rate updates (they are −direction: the sign matches).

    optax's `add_decayed_weights` decays toward zero only; the anchor variant keeps the
    initial weights in the optimizer state so checkpoints carry them. Wrap it in
    `optax.masked` to leave out the `no_decay` leaves.
    """

    def init(params):
        return DecayState(jax.tree.map(jnp.copy, params) if toward_initial else ())

    def update(updates, state, params):
        if params is None:
            raise ConfigError(
                "decoupled_decay needs the params to decay; call "
                "tx.update(updates, opt_state, params)"
            )
        if toward_initial:
            updates = jax.tree.map(
                lambda u, p, a: u - weight_decay * (p - a), updates, params, state.anchor
            )
        else:
            updates = jax.tree.map(lambda u, p: u - weight_decay * p, updates, params)
        return updates, state

    return optax.GradientTransformation(init, update)


# -- building the optimizer ---------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupSpec:
    name: str
    factory: Callable | None  # None: a ready GradientTransformation (`transform`) used as is
    transform: optax.GradientTransformation | None
    rate: float
    weight_decay: float
    count: int  # parameters in the group


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """The built optax transformation plus what schedules and `jn.inspect` need to know.

    For a custom `train_step` each group has its own optimizer (`parts`, applied one at a time
    by `jn.optimizer_step`), and the state is a dict group -> that optimizer's state.
    """

    tx: optax.GradientTransformation
    groups: dict[str, GroupSpec]
    labels: Any
    hyper_paths: dict[str, tuple[str, str]]  # "opt.<group>.<hp>" -> (group, hp)
    clip: float
    parts: Mapping[str, optax.GradientTransformation] | None = None

    @property
    def single_state(self) -> bool:
        """One group in one optimizer state: no `multi_transform` level to look under."""
        return len(self.groups) == 1 and self.parts is None


def _group_rule(factory, decay_mask, toward_initial, hp_names):
    """factory at unit rate, then decoupled decay, then the group's rate (AdamW's order)."""

    # A factory's own decay (optax.adamw's weight_decay=1e-4) would hit every leaf, biases
    # included, on top of ours: weight_decay(self, group) with its no_decay mask is the one.
    own_decay = {"weight_decay": 0.0} if "weight_decay" in factory_defaults(factory) else {}

    def rule(learning_rate, weight_decay, **hps):  # (inject_hyperparams reads __signature__)
        return optax.chain(
            factory(learning_rate=1.0, **own_decay, **hps),
            optax.masked(decoupled_decay(weight_decay, toward_initial=toward_initial), decay_mask),
            optax.scale(learning_rate),
        )

    # inject_hyperparams binds by signature: name every injected hyperparameter explicitly.
    kw = inspect.Parameter.POSITIONAL_OR_KEYWORD
    signed: Any = rule
    signed.__signature__ = inspect.Signature(
        [inspect.Parameter(n, kw) for n in ("learning_rate", "weight_decay", *hp_names)]
    )
    return rule


def _factory_hparams(factory) -> list[str]:
    """Float hyperparameters a factory accepts by keyword (schedulable as opt.<name>)."""
    try:
        sig = inspect.signature(factory)
    except (TypeError, ValueError):
        return []
    out = []
    for p in sig.parameters.values():
        if p.name == "learning_rate" or p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            continue
        if isinstance(p.default, float):
            out.append(p.name)
    return out


@dataclasses.dataclass(frozen=True)
class _Hooks:
    """The experiment's optimization hooks, each with its default."""

    group_of: Callable
    no_decay: Callable
    rule_of: Callable
    rate_of: Callable
    anchor_of: Callable
    decay_of: Callable
    clip: float
    rule_hook: str = "optimizer({g!r})"  # how errors name the hook that gives a group's rule

    @classmethod
    def of(cls, exp, decay_anchor: str, *, separate: bool = False) -> _Hooks:
        if decay_anchor not in ("zero", "w0"):
            raise ConfigError(
                f"decay_anchor={decay_anchor!r} is invalid; use 'zero' (decay toward 0) or "
                f"'w0' (toward the initial weights)."
            )
        clip_hook = _hook(exp, "gradient_clip_norm")
        clip = float(clip_hook()) if clip_hook is not None else 0.0
        if clip < 0 or not math.isfinite(clip):
            raise ConfigError(
                f"gradient_clip_norm() returned {clip}; return a finite number >= 0 (0 turns "
                f"clipping off), e.g. `return 1.0`."
            )
        group_of = _hook(exp, "param_group")
        rule_of = _hook(exp, "optimizer")
        table = _optimizer_table(exp, separate, rule_of)
        if table is not None:
            rule_of = table.__getitem__
            group_of = group_of or _top_level(table)
        return cls(
            group_of=group_of or (lambda path, leaf: DEFAULT_GROUP),
            no_decay=_hook(exp, "no_decay") or (lambda path, leaf: jnp.ndim(leaf) <= 1),
            rule_of=rule_of or (lambda group: optax.radam),
            rule_hook="optimizers() for {g!r}" if table is not None else "optimizer({g!r})",
            rate_of=_hook(exp, "learning_rate") or (lambda group: 1e-3),
            anchor_of=_hook(exp, "decay_anchor") or (lambda group: decay_anchor),
            decay_of=_hook(exp, "weight_decay") or (lambda group: 0.0),
            clip=clip,
        )


def _optimizer_table(exp, separate: bool, rule_of) -> dict[str, Any] | None:
    """`optimizers(self)`: {name: optax factory or transformation}, one per parameter group."""
    hook = _hook(exp, "optimizers")
    if hook is None:
        return None
    cls = type(exp).__name__
    if not separate:
        raise ConfigError(
            f"{cls}.optimizers() gives the optimizers of a custom train step, but {cls} has "
            f"no train_step. Define train_step(self, model, params, opt_state, state, rng, "
            f"*, <batch fields>), or give per-group rules with optimizer(self, group) and "
            f"param_group(self, path, leaf)."
        )
    if rule_of is not None:
        raise ConfigError(
            f"{cls} defines both optimizers() and optimizer(group); keep one: optimizers() "
            f"returns {{name: optax transformation}} for every group at once."
        )
    table = hook()
    if not isinstance(table, Mapping) or not table or not all(isinstance(k, str) for k in table):
        raise ConfigError(
            f"{cls}.optimizers() must return a non-empty dict name -> optax transformation "
            f"(or factory), e.g. {{'gen': optax.adam(2e-4, b1=0.5), 'disc': "
            f"optax.adam(2e-4, b1=0.5)}}; got {table!r}."
        )
    return dict(table)


def _top_level(table: Mapping[str, Any]) -> Callable[[str, Any], str]:
    """The default `param_group` with `optimizers()`: a parameter's top-level module."""

    def group_of(path: str, leaf) -> str:
        top = path.split("/", 1)[0]
        if top not in table:
            raise ConfigError(
                f"parameter {path!r} is under {top!r}, which names none of the optimizers "
                f"{sorted(table)}. Name the optimizers after the model's top-level modules, "
                f"or define param_group(self, path, leaf) returning one of {sorted(table)}."
            )
        return top

    return group_of


def _check_table_groups(hooks: _Hooks, names: list[str], table_keys) -> None:
    unused = sorted(set(table_keys) - set(names))
    if unused:
        raise ConfigError(
            f"optimizers() names {unused}, but no parameter is in "
            f"{'that group' if len(unused) == 1 else 'those groups'} (the groups are "
            f"{names}). Drop it, or send parameters to it from param_group(self, path, leaf)."
        )


def _labels_fn(labels):
    """The labels for `multi_transform` as a function: optax calls a callable labels tree,
    and an Equinox model's tree of labels is a callable module."""
    return lambda params: labels


def _separate(core: Mapping[str, optax.GradientTransformation], labels, clip: float):
    """One optimizer per group over the whole tree (the other groups' updates are zero and
    their state empty), and a transformation whose state is {group: that optimizer's state}."""
    chain = [("clip", optax.clip_by_global_norm(clip))] if clip > 0 else []
    parts = {
        g: optax.named_chain(
            *chain,
            (
                "update",
                optax.multi_transform(
                    {o: (t if o == g else optax.set_to_zero()) for o, t in core.items()},
                    _labels_fn(labels),
                ),
            ),
        )
        for g in core
    }

    def init(params):
        return {g: part.init(params) for g, part in parts.items()}

    def update(updates, state, params=None):
        raise ConfigError(
            "a custom train step's optimizers are applied one at a time: call "
            "jn.optimizer_step(group, params, opt_state, grads) inside train_step."
        )

    return optax.GradientTransformation(init, update), parts


def build(
    exp,
    params,
    *,
    scheduled: Collection[str] = frozenset(),
    decay_anchor: str = "zero",
    separate: bool = False,
) -> Optimizer:
    """Build the optax transformation from the experiment's optimization hooks.

    The state is laid out by name: ``optax.named_chain(("clip", ...), ("update", ...))``,
    with one `multi_transform` entry per group when there are several groups. With
    `separate=True` (a custom train step) every group gets its own such optimizer, from
    `optimizers(self)` when the experiment defines it.

    Example:
        >>> opt = optim.build(exp, params)
        >>> sorted(opt.groups), opt.clip
        (['default'], 0.0)
    """
    hooks = _Hooks.of(exp, decay_anchor, separate=separate)
    labels = jax.tree_util.tree_map_with_path(lambda p, x: _label(hooks.group_of, p, x), params)
    names = sorted(set(jax.tree.leaves(labels)))
    table = _optimizer_table(exp, separate, None)
    if table is not None:
        _check_table_groups(hooks, names, table)
    sizes: collections.Counter[str] = collections.Counter()
    for x, lab in zip(jax.tree.leaves(params), jax.tree.leaves(labels), strict=True):
        sizes[lab] += int(np.prod(np.shape(x)))
    groups: dict[str, GroupSpec] = {}
    transforms: dict[str, optax.GradientTransformation] = {}
    hyper_paths: dict[str, tuple[str, str]] = {}
    for g in names:
        groups[g], transforms[g], injected = _group(hooks, g, sizes[g], scheduled)
        hyper_paths.update({f"opt.{g}.{hp}": (g, hp) for hp in injected})
    if all(spec.rate == 0.0 for spec in groups.values()):
        raise ConfigError(
            "every parameter group has learning rate 0: nothing would train. Set a positive "
            "rate in learning_rate(self, group) (a single group may be frozen with 0)."
        )
    if separate:
        tx, parts = _separate(transforms, labels, hooks.clip)
        return Optimizer(tx, groups, labels, hyper_paths, hooks.clip, parts)
    core = (
        transforms[names[0]]
        if len(names) == 1
        else optax.multi_transform(transforms, _labels_fn(labels))
    )
    chain = [("clip", optax.clip_by_global_norm(hooks.clip))] if hooks.clip > 0 else []
    tx = optax.named_chain(*chain, ("update", core))
    return Optimizer(tx, groups, labels, hyper_paths, hooks.clip)


def _group(hooks: _Hooks, g: str, count: int, scheduled: Collection[str]):
    """(GroupSpec, transformation, injected hyperparameter names) of one parameter group."""
    rule = hooks.rule_of(g)
    rate = _number("learning_rate", g, hooks.rate_of(g))
    wd = _number("weight_decay", g, hooks.decay_of(g))
    anchor = hooks.anchor_of(g)
    if anchor not in ("zero", "w0"):
        raise ConfigError(
            f"decay_anchor({g!r}) returned {anchor!r}; use 'zero' or 'w0' "
            f"(decay toward the initial weights)."
        )
    if rate < 0 or not math.isfinite(rate):
        raise ConfigError(
            f"learning_rate({g!r}) returned {rate}; return a finite rate >= 0 (0 freezes "
            f"the group), e.g. `return 1e-3`."
        )
    if isinstance(rule, optax.GradientTransformation):
        tuned = [k for k in scheduled if k.startswith(("opt.learning_rate", f"opt.{g}."))]
        if wd or tuned:
            raise ConfigError(
                f"{hooks.rule_hook.format(g=g)} returned a ready optax transformation, whose "
                f"learning rate and decay are fixed inside it, but the run also sets "
                f"{'weight decay' if wd else tuned}. Return the factory instead, e.g. "
                f"`return optax.adam` or `functools.partial(optax.sgd, momentum=0.9)`."
            )
        return GroupSpec(g, None, rule, rate, wd, count), rule, ()
    if not callable(rule):
        raise ConfigError(
            f"optimizer({g!r}) must return an optax factory such as optax.adamw "
            f"or an optax.GradientTransformation, got {rule!r}."
        )
    spec = GroupSpec(g, rule, None, rate, wd, count)
    if rate == 0.0:
        return spec, optax.set_to_zero(), ()  # frozen by its own rate
    tx, injected = _injected_rule(hooks, g, rule, rate, wd, anchor, scheduled)
    return spec, tx, injected


def _injected_rule(hooks: _Hooks, g, rule, rate, wd, anchor, scheduled):
    """The group's rule with its rate (and decay, and scheduled hyperparameters) injected."""
    no_decay = hooks.no_decay

    # A callable mask: inside multi_transform it sees only this group's leaves.
    def decay_mask(ps):
        return jax.tree_util.tree_map_with_path(
            lambda p, leaf: not bool(no_decay(path_str(p), leaf)), ps
        )

    hps = tuple(
        hp
        for hp in _factory_hparams(rule)
        if f"opt.{hp}" in scheduled or f"opt.{g}.{hp}" in scheduled
    )
    defaults = factory_defaults(rule)
    injected = {hp: jnp.float32(defaults[hp]) for hp in hps}
    decays = wd != 0 or "opt.weight_decay" in scheduled or f"opt.{g}.weight_decay" in scheduled
    if decays:
        tx = optax.inject_hyperparams(_group_rule(rule, decay_mask, anchor == "w0", hps))(
            learning_rate=jnp.float32(rate), weight_decay=jnp.float32(wd), **injected
        )
        return tx, ("learning_rate", "weight_decay", *hps)
    # No decay: the factory itself with its rate injected, as lean as a hand-written
    # optimizer (no unit-rate pass, decay pass or extra scaling over the params).
    own = {"weight_decay": 0.0} if "weight_decay" in defaults else {}
    factory = functools.partial(rule, **own) if own else rule
    tx = optax.inject_hyperparams(factory)(learning_rate=jnp.float32(rate), **injected)
    return tx, ("learning_rate", *hps)


def live_optimizer(exp, optimizer: Optimizer) -> Optimizer:
    """`optimizer` with each group's learning rate and weight decay as the experiment's hooks
    give them now. A hook that reads a Device field changed by `jn.set_device` moves them with
    no recompile: both travel to the step as inputs. A change that needs another program (a
    group frozen with rate 0 given a rate, decay turned on where it was off, a ready optax
    transformation, a new clip norm) raises a ConfigError naming it and the fix.

    Example:
        >>> live_optimizer(replace(exp, lr=0.05), n.optimizer).groups["default"].rate
        0.05
    """
    rate_of = _hook(exp, "learning_rate") or (lambda group: 1e-3)
    decay_of = _hook(exp, "weight_decay") or (lambda group: 0.0)
    clip_hook = _hook(exp, "gradient_clip_norm")
    clip = float(clip_hook()) if clip_hook is not None else 0.0
    if clip != optimizer.clip:
        raise ConfigError(
            f"this change moves gradient_clip_norm() from {optimizer.clip} to {clip}, which is "
            f"built into the optimizer: build a new Nitro with it (one recompile)."
        )
    groups = {}
    for g, spec in optimizer.groups.items():
        new: dict[str, Any] = {
            "rate": _number("learning_rate", g, rate_of(g)),
            "weight_decay": _number("weight_decay", g, decay_of(g)),
        }
        for field, hp in (("rate", "learning_rate"), ("weight_decay", "weight_decay")):
            old = getattr(spec, field)
            if new[field] != old and f"opt.{g}.{hp}" not in optimizer.hyper_paths:
                why = (
                    "the group is frozen (rate 0 at setup)"
                    if spec.rate == 0.0 and spec.factory is not None
                    else "its optimizer is a ready optax transformation"
                    if spec.factory is None
                    else "weight decay was off at setup"
                )
                raise ConfigError(
                    f"this change moves {hp}({g!r}) from {old} to {new[field]}, which cannot "
                    f"reach the running optimizer: {why}. Build a new Nitro with it (one "
                    f"recompile), or schedule it (schedules={{'opt.{hp}': ...}})."
                )
        groups[g] = dataclasses.replace(spec, **new)
    return dataclasses.replace(optimizer, groups=groups)


def _number(hook: str, group: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ConfigError(
            f"{hook}({group!r}) returned {value!r}; return a float (e.g. "
            f"`return 1e-3`), not {type(value).__name__}."
        )
    return float(value)


def factory_defaults(factory) -> dict[str, Any]:
    try:
        return {p.name: p.default for p in inspect.signature(factory).parameters.values()}
    except (TypeError, ValueError):
        return {}


def _label(group_of, path, leaf) -> str:
    g = group_of(path_str(path), leaf)
    if not isinstance(g, str):
        raise ConfigError(
            f"param_group must return a group name (str), got {g!r} for {path_str(path)!r}."
        )
    return g


def describe(opt: Optimizer) -> tuple[tuple[str, Any], ...]:
    """The optimizer's structure in the user's terms, for explaining a recompile:
    ``(("gradient_clip_norm", 1.0), ("param groups", ("decay", "default")),
    ("optimizer of group 'default'", "radam"), ("weight decay in group 'default'", True))``."""
    out: list[tuple[str, Any]] = [
        ("gradient_clip_norm", opt.clip),
        ("param groups", tuple(sorted(opt.groups))),
    ]
    for g, spec in sorted(opt.groups.items()):
        out.append((f"optimizer of group {g!r}", _rule_name(spec)))
        out.append((f"weight decay in group {g!r}", f"opt.{g}.weight_decay" in opt.hyper_paths))
        out.append((f"frozen group {g!r}", spec.rate == 0.0))
    return tuple(out)


def _rule_name(spec: GroupSpec) -> str:
    rule = spec.factory if spec.factory is not None else spec.transform
    if isinstance(rule, functools.partial):
        kw = ", ".join(f"{k}={v!r}" for k, v in sorted(rule.keywords.items()))
        return f"{getattr(rule.func, '__name__', type(rule.func).__name__)}({kw})"
    return getattr(rule, "__name__", type(rule).__name__)
