"""One functional interface over Flax NNX, Flax Linen, Equinox and plain models.

`split_model` turns a model into `(model, params, state)`: a hashable description of
the computation plus two pytrees, so a train step can differentiate `params`, thread
`state` (batch statistics, RNG counters) and donate both. `apply` runs the model in
the mode set by `mode(...)` (`training_mode`, re-exported here), which the framework
enters while tracing a step: inside `mode(train=True, rng=key)` dropout is active and
batch statistics update; anywhere else the call is deterministic inference.

Flax and Equinox are looked up in `sys.modules` rather than imported, so an Equinox
user never pays for importing Flax and vice versa: an object cannot be an instance of
a library's class unless that library has been imported.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
from collections.abc import Callable, Hashable
from typing import Any

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.experiment.training_mode import is_training, mode, next_key

__all__ = [
    "EqxModel",
    "LinenModel",
    "NNXModel",
    "apply",
    "is_training",
    "mode",
    "split_model",
    "structure_key",
]

_ACCEPTED = (
    "an initialized flax.nnx.Module; "
    "a flax.linen.Module followed by an init rng and example inputs; "
    "an equinox.Module, optionally followed by its eqx.nn.State; "
    "or a plain (apply_fn, params, state) triple"
)


# ------------------------------------------------------------------ model wrappers


@dataclasses.dataclass(frozen=True)
class NNXModel:
    """The static half of a Flax NNX module: its `GraphDef`."""

    graphdef: Any


@dataclasses.dataclass(frozen=True)
class LinenModel:
    """A Flax Linen module plus the mode flags its `__call__` accepts."""

    module: Any
    mode_flags: frozenset[str]  # subset of {"train", "deterministic"}


@dataclasses.dataclass(frozen=True, eq=False)
class EqxModel:
    """The static (non-parameter) half of an Equinox module and its optional state."""

    static: Any
    stateful: bool

    @functools.cached_property
    def key(self) -> Hashable:
        """This model's `structure_key`, computed once (it hashes static arrays)."""
        return _eqx_key(self)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, EqxModel) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)


@dataclasses.dataclass(frozen=True, eq=False)
class _Identity:
    """Key part for an unhashable leaf: equal only to itself, and keeps it alive."""

    # Holding the object (not just its id) stops a later object reusing the id
    # while a cache entry still refers to this key.
    obj: Any

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


# -------------------------------------------------------------------- split_model


def split_model(module: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """Split a model into `(model, params, state)` for functional training.

    `params` are the trainable arrays, `state` the non-trainable ones (batch
    statistics, RNG counters; `{}`/`None` when there are none), and `model` a
    hashable object that `apply` and `structure_key` understand.

    Args:
        module: an initialized `flax.nnx.Module`; a `flax.linen.Module`; an `equinox.Module`;
            or a plain `(apply_fn, params, state)` triple (returned as it is).
        *args: for Linen, the init rng and example inputs; for Equinox, optionally its
            `eqx.nn.State`. Nothing for the others.
        **kwargs: for Linen, keyword arguments of `init`.

    Returns:
        `(model, params, state)`.

    Raises:
        ConfigError: `module` is none of the kinds above, or takes no extra arguments and got
            some.

    Example:
        >>> model, params, state = jn.split_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> type(model).__name__, params["kernel"].value.shape
        ('NNXModel', (3, 2))
    """
    nnx, linen, eqx = _module("flax.nnx"), _module("flax.linen"), _module("equinox")
    if nnx is not None and isinstance(module, nnx.Module):
        _no_extra_args("a flax.nnx.Module", args, kwargs, "it is already initialized")
        graphdef, params, state = nnx.split(module, nnx.Param, ...)
        return NNXModel(graphdef), params, state
    if linen is not None and isinstance(module, linen.Module):
        return _split_linen(module, *args, **kwargs)
    if eqx is not None and isinstance(module, eqx.Module):
        return _split_eqx(eqx, module, *args, **kwargs)
    if isinstance(module, tuple) and len(module) == 3:
        _no_extra_args("an (apply_fn, params, state) triple", args, kwargs, "")
        if not callable(module[0]):
            raise ConfigError(
                f"The first element of the (apply_fn, params, state) triple is a "
                f"{type(module[0]).__name__}, not a callable. Put the function "
                "apply_fn(params, state, *inputs) -> (outputs, new_state) first."
            )
        return module
    raise ConfigError(
        f"split_model() cannot split a {type(module).__module__}."
        f"{type(module).__qualname__}. It accepts {_ACCEPTED}."
    )


def _split_linen(module: Any, *args: Any, **init_kwargs: Any) -> tuple[Any, Any, Any]:
    """Initialize a Linen module in inference mode and split its variables."""
    if not args:
        raise ConfigError(
            f"split_model() needs an init rng and example inputs to initialize the "
            f"Linen module {type(module).__name__}. Call "
            "split_model(module, jax.random.key(0), example_batch)."
        )
    rng, *inputs = args
    try:
        hash(module)
    except TypeError as e:
        # The model is part of the compile-cache key, so it must be hashable.
        raise ConfigError(
            f"The Linen module {type(module).__name__} is not hashable ({e}). "
            "Use tuples instead of lists or dicts in its fields."
        ) from e
    model = LinenModel(module, _accepted(module.__call__, ("train", "deterministic")))
    variables = module.init(
        {"params": rng, "dropout": rng},
        *inputs,
        **{**_linen_flags(model, train=False), **init_kwargs},
    )
    state = {name: value for name, value in variables.items() if name != "params"}
    return model, variables.get("params", {}), state


def _split_eqx(eqx: Any, module: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
    """Partition an Equinox module into float arrays (params) and the rest."""
    if kwargs or len(args) > 1 or (args and not isinstance(args[0], (eqx.nn.State, type(None)))):
        raise ConfigError(
            "split_model() takes an Equinox module and at most its eqx.nn.State; got "
            f"extra arguments {[type(a).__name__ for a in args]} {sorted(kwargs)}. "
            "Call split_model(module) or split_model(*eqx.nn.make_with_state(Cls)(...))."
        )
    state = args[0] if args else None
    if state is None and _has_state_index(eqx, module):
        raise ConfigError(
            f"The Equinox module {type(module).__name__} has stateful layers "
            "(e.g. BatchNorm) but no state was given. Build it with "
            "eqx.nn.make_with_state and call split_model(module, state)."
        )
    params, static = eqx.partition(module, eqx.is_inexact_array)
    return EqxModel(static, stateful=state is not None), params, state


def _has_state_index(eqx: Any, module: Any) -> bool:
    """Return whether the module has stateful layers (which need an eqx.nn.State)."""
    is_index = lambda x: isinstance(x, eqx.nn.StateIndex)  # noqa: E731
    return any(map(is_index, jax.tree.leaves(module, is_leaf=is_index)))


def _no_extra_args(what: str, args: tuple, kwargs: dict, why: str) -> None:
    """Reject arguments that split_model() would otherwise silently ignore."""
    if args or kwargs:
        reason = f" ({why})" if why else ""
        raise ConfigError(
            f"split_model() takes no further arguments for {what}{reason}; got "
            f"{len(args)} positional and {sorted(kwargs)} keyword argument(s). "
            "Remove them."
        )


# -------------------------------------------------------------------------- apply


def apply(
    model: Any, params: Any, state: Any, *inputs: Any, method: Any = None, **kwargs: Any
) -> tuple[Any, Any]:
    """Run `model` on `inputs` in the current mode and return `(outputs, new_state)`.

    Extra `kwargs` go to the model call and override the mode-derived arguments
    (`train`, `deterministic`, `rngs`, `key`, `rng`) of the same name. `method` calls a
    method or submodule instead of the model itself (Flax and Equinox): a name
    (`method="generator"`) or a function `(module, *inputs) -> outputs` — how one model with
    several parts (a GAN's generator and discriminator) is run part by part.

    Args:
        model: the first value `jn.split_model` returned (or a plain
            `apply_fn(params, state, *inputs)`).
        params: the trainable arrays (`split_model`'s second value, or as updated).
        state: the non-trainable arrays (batch statistics, RNG counters).
        *inputs: the model call's positional inputs.
        method: a method name or a function `(module, *inputs) -> outputs`; None: the model.
        **kwargs: keyword arguments of the model call.

    Returns:
        `(outputs, new_state)`: what the model returned, and its state after the call (the
        same `state` in inference mode).

    Raises:
        ConfigError: `model` is not a split model or a callable, or `method` is given for a
            plain function.

    Example:
        >>> model, params, state = jn.split_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> outputs, state = jn.apply(model, params, state, jnp.ones((4, 3)))
        >>> outputs.shape
        (4, 2)
    """
    training, key = is_training(), next_key()
    if isinstance(model, NNXModel):
        return _apply_nnx(model, params, state, training, inputs, kwargs, method)
    if isinstance(model, LinenModel):
        return _apply_linen(model, params, state, training, key, inputs, kwargs, method)
    if isinstance(model, EqxModel):
        return _apply_eqx(model, params, state, training, key, inputs, kwargs, method)
    if callable(model):
        if method is not None:
            raise ConfigError(
                f"apply(..., method={method!r}) selects a method of a Flax or Equinox model; "
                f"this model is a plain function. Split the module with jn.split_model, or "
                f"call the function you want directly."
            )
        flags = _accepted(model, ("train", "rng"))
        defaults = {"train": training, "rng": key}
        call_kwargs = {name: defaults[name] for name in flags}
        return model(params, state, *inputs, **{**call_kwargs, **kwargs})
    raise ConfigError(
        f"apply() got a {type(model).__name__} as the model. Pass the model returned "
        f"by split_model(), or a callable apply_fn(params, state, *inputs)."
    )


def _bound(module: Any, method: Any) -> Callable:
    """The callable `method` names on `module` (the module itself when None)."""
    if method is None:
        return module
    if callable(method):
        return functools.partial(method, module)
    fn = getattr(module, method, None) if isinstance(method, str) else None
    if not callable(fn):
        own = {**vars(type(module)), **getattr(module, "__dict__", {})}
        names = sorted(n for n in own if not n.startswith("_"))
        raise ConfigError(
            f"apply(..., method={method!r}): {type(module).__name__} has no callable "
            f"{method!r}. Name one of its methods or submodules (it has {names[:12]}), or "
            f"pass a function (module, *inputs) -> outputs."
        )
    return fn


def _apply_nnx(model, params, state, training, inputs, kwargs, method=None):
    """Merge a private copy of the NNX module, set its mode, call it, split it."""
    nnx = _module("flax.nnx")
    # copy=True: merging the caller's Variables in place inside value_and_grad under
    # jit leaks tracers across trace levels (TraceContextError).
    module = nnx.merge(model.graphdef, params, state, copy=True)
    # Module.train()/eval() flip `deterministic`/`use_running_average` on every
    # submodule that has them; this copy is private, so mutating it is safe.
    module.train() if training else module.eval()
    outputs = _bound(module, method)(*inputs, **kwargs)
    # NNX dropout draws from the module's own Rngs stream, which lives in `state`
    # (RngKey/RngCount) and advances here; it ignores the mode's rng.
    _, _, new_state = nnx.split(module, nnx.Param, ...)
    return outputs, new_state


def _apply_linen(model, params, state, training, key, inputs, kwargs, method=None):
    """Call a Linen module; in training, with a dropout key and mutable state."""
    variables = {"params": params, **state}
    call_kwargs: dict[str, Any] = _linen_flags(model, train=training)
    if method is not None:  # Linen binds the method itself; flags go where it takes them
        target = getattr(type(model.module), method, None) if isinstance(method, str) else method
        if target is None:
            cls = type(model.module)
            names = sorted(n for n, v in vars(cls).items() if callable(v) and n[0] != "_")
            raise ConfigError(
                f"apply(..., method={method!r}): {cls.__name__} has no method {method!r} "
                f"(Linen submodules from setup() are reached through a method, or a function "
                f"(module, *inputs) -> outputs). Its methods: {names[:12]}."
            )
        accepted = _accepted(target, ("train", "deterministic"))
        call_kwargs = {k: v for k, v in call_kwargs.items() if k in accepted}
        kwargs = {"method": method, **kwargs}
    if not training:
        return model.module.apply(variables, *inputs, **{**call_kwargs, **kwargs}), state
    if key is not None:
        call_kwargs["rngs"] = {"dropout": key}
    outputs, updates = model.module.apply(
        variables, *inputs, mutable=list(state), **{**call_kwargs, **kwargs}
    )
    return outputs, {**state, **updates}


def _linen_flags(model: LinenModel, *, train: bool) -> dict[str, bool]:
    """Return the train/deterministic keyword arguments the module accepts."""
    flags = {"train": train, "deterministic": not train}
    return {name: flags[name] for name in model.mode_flags}


def _apply_eqx(model, params, state, training, key, inputs, kwargs, method=None):
    """Call a single-example Equinox model on a batch, vmapped over axis 0."""
    eqx = _module("equinox")
    if not jax.tree.leaves(inputs):
        raise ConfigError(
            "apply() on an Equinox model needs at least one batched input array: "
            "Equinox models take single examples, so apply() vmaps them over axis 0. "
            "Pass the batch as inputs: apply(model, params, state, x)."
        )
    module = eqx.nn.inference_mode(eqx.combine(params, model.static), not training)
    call = _bound(module, method)
    # Only models that declare a `key` get one, and only in training: eval is
    # deterministic.
    keys = None
    if training and key is not None and _accepted(call, ("key",)):
        batch_size = jax.tree.leaves(inputs)[0].shape[0]
        keys = jax.random.split(key, batch_size)

    def one_example(example, example_key, state):
        call_kwargs = kwargs if example_key is None else {"key": example_key, **kwargs}
        if model.stateful:
            return call(*example, state, **call_kwargs)
        return call(*example, **call_kwargs), None

    # axis_name="batch" is the name eqx.nn.BatchNorm(axis_name="batch") averages
    # over; state is shared by the whole batch, so it is neither mapped nor stacked.
    batched = jax.vmap(
        one_example,
        in_axes=(0, None if keys is None else 0, None),
        out_axes=(0, None),
        axis_name="batch",
    )
    outputs, new_state = batched(inputs, keys, state)
    return outputs, new_state if model.stateful else state


# ------------------------------------------------------------------ structure_key


def structure_key(model: Any) -> Hashable:
    """Return a hashable key, equal for models whose traced computation is the same.

    It ignores parameter values but covers every static choice (widths, activation
    functions, string options), so it can go into a compile-cache key.

    Example:
        >>> model, params, state = jn.split_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> hash(structure_key(model)) == hash(structure_key(model))
        True
    """
    if isinstance(model, NNXModel):
        return ("nnx", model.graphdef)
    if isinstance(model, LinenModel):
        return ("linen", model.module)
    if isinstance(model, EqxModel):
        return model.key
    if callable(model):
        return model  # the cache layer fingerprints callables itself
    raise ConfigError(
        f"structure_key() got a {type(model).__name__}. Pass the model returned by "
        "split_model() or a plain apply_fn callable."
    )


def model_classes(model: Any) -> tuple[type, ...]:
    """Return the classes of a split model's modules (library ones included), root first.

    For NNX these are the node types of the graphdef; for Linen and Equinox the module
    classes found in the module tree (dataclass fields, lists, tuples and dicts of them),
    plus, for Linen, module classes that a module's own code names (submodules made in
    `setup` or `@compact` are not fields). An `apply_fn` callable has none (its code is
    fingerprinted as the model itself).

    Example:
        >>> model, _, _ = jn.split_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
        >>> nnx.Linear in model_classes(model)
        True
    """
    found: dict[type, None] = {}
    if isinstance(model, NNXModel):
        for node in getattr(model.graphdef, "nodes", ()):
            t = getattr(node, "type", None)
            if isinstance(t, type):
                found.setdefault(t)
    elif isinstance(model, LinenModel):
        linen = _module("flax.linen")
        _module_tree(model.module, linen.Module, found)
        _named_by_code(found, linen.Module)
    elif isinstance(model, EqxModel):
        _module_tree(model.static, _module("equinox").Module, found)
    return tuple(found)


def held_functions(model: Any) -> dict[str, Any]:
    """Return ``Owner.attr`` -> every user function (or `functools.partial` of one) a split
    model holds as a value: an NNX module's `self.act = act` (a static attribute of the
    graphdef), a Linen module's field `act=...`, an Equinox module's function field. The
    structure key holds such a function by identity; its code and what it reads is fingerprinted
    by the caller. Library functions (`jax.nn.relu`) are left out: they cannot change.

    Example:
        >>> sorted(held_functions(jn.split_model(Net(act=my_act, ...))[0]))
        ['Net.act']
    """
    hit = _held.get(id(model))
    if hit is not None and hit[0] is model:  # a split model's static half never changes
        return dict(hit[1])
    found = _held_functions(model)
    _held[id(model)] = (model, found)  # (holding the model keeps its id from being reused)
    while len(_held) > 32:
        _held.pop(next(iter(_held)))
    return dict(found)


_held: dict[int, tuple[Any, dict[str, Any]]] = {}


def _held_functions(model: Any) -> dict[str, Any]:
    from jaxnitro._src.compile.fingerprint import is_user_function

    found: dict[str, Any] = {}
    if isinstance(model, NNXModel):
        nodes = [getattr(n, "type", None) for n in getattr(model.graphdef, "nodes", ())]
        owner = "/".join(sorted({getattr(t, "__name__", str(t)) for t in nodes[:1] if t}))
        for name, attr in getattr(model.graphdef, "attributes", ()) or ():
            value = getattr(attr, "value", None)
            if is_user_function(value):
                found.setdefault(f"{owner or 'model'}.{name}", value)
        return found
    if isinstance(model, LinenModel):
        root = model.module
    elif isinstance(model, EqxModel):
        root = model.static
    else:
        return found
    seen: set[int] = set()
    stack: list[tuple[str, Any]] = [(type(root).__name__, root)]
    while stack:
        where, obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if is_user_function(obj):
            found.setdefault(where, obj)
        elif dataclasses.is_dataclass(obj):
            owner = type(obj).__name__
            for f in dataclasses.fields(obj):
                if f.name not in ("parent", "name"):
                    stack.append((f"{owner}.{f.name}", getattr(obj, f.name, None)))
        elif isinstance(obj, (list, tuple)):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(obj)]
        elif isinstance(obj, dict):
            stack += [(f"{where}[{k!r}]", v) for k, v in obj.items()]
    return found


def _module_tree(root: Any, base: type, found: dict[type, None]) -> None:
    """Add the class of every `base` instance reachable from `root` through dataclass fields
    and containers (iteratively: a deep model must not hit the recursion limit)."""
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if isinstance(obj, base):
            found.setdefault(type(obj))
            if dataclasses.is_dataclass(obj):
                stack += [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
        elif isinstance(obj, (list, tuple)):
            stack += list(obj)
        elif isinstance(obj, dict):
            stack += list(obj.values())


def _named_by_code(found: dict[type, None], base: type) -> None:
    """Add the `base` subclasses that the methods of the classes in `found` load as globals
    (`Block(...)` in a `@compact` `__call__`), until no new one appears."""
    todo = list(found)
    while todo:
        cls = todo.pop()
        for klass in cls.__mro__:
            if klass.__module__.partition(".")[0] in ("flax", "builtins"):
                continue  # library code: it cannot change, and its own classes are named
            for attr in vars(klass).values():
                fn = getattr(attr, "__func__", attr)
                code = getattr(fn, "__code__", None)
                if code is None:
                    continue
                for name in _global_names(code):
                    value = fn.__globals__.get(name)
                    if (
                        isinstance(value, type)
                        and issubclass(value, base)
                        and value not in found
                        and value.__module__.partition(".")[0] != "flax"
                    ):
                        found.setdefault(value)
                        todo.append(value)


def _global_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _global_names(const)
    return names


def _eqx_key(model: EqxModel) -> Hashable:
    """Return the static treedef plus a hashable form of every static leaf."""
    # Fields that are not inexact arrays (str/bool/int options, activation functions,
    # integer arrays) are leaves of the static tree, not part of its treedef, so the
    # treedef alone would call two models with different options equal.
    leaves, treedef = jax.tree.flatten(model.static)
    return ("equinox", model.stateful, treedef, tuple(map(_leaf_key, leaves)))


def _leaf_key(leaf: Any) -> Hashable:
    """Return a hashable stand-in for one leaf of an Equinox static tree."""
    if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
        # Non-float arrays stay in the static half and are baked into the trace as
        # constants, so their values matter, not just their shape.
        array = np.asarray(leaf)
        return ("array", array.shape, array.dtype.str, array.tobytes())
    try:
        hash(leaf)
    except TypeError:
        return _Identity(leaf)
    return leaf


# --------------------------------------------------------------------- utilities


def _module(name: str) -> Any:
    """Return an already-imported module, or None (see the module docstring)."""
    return sys.modules.get(name)


def _accepted(fn: Callable, names: tuple[str, ...]) -> frozenset[str]:
    """Return which of `names` `fn` accepts as keyword arguments (not via **kwargs)."""
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return frozenset()
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(n for n in names if n in parameters and parameters[n].kind in keyword)
