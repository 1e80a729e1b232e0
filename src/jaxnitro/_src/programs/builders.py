"""A run's compiled programs: traced functions built from its hooks, keyed by `ProgramKey`.

Builders take a `ProgramSpec` (what setup decided; a `RunSpec` is one), a `ProgramSet` (this
run's bookkeeping) and the current `TrainState`; traced hooks run against the compile view
(GraphConst values, Device tracers, Host refused). The functions built here close over the
model structure and the optimizer, which the key covers, so a cached program is correct for
every run whose key is the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect as pyinspect
import sys
import types
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxnitro._src.compile import cache, context, explain
from jaxnitro._src.compile.fingerprint import (
    fingerprint,
    fingerprint_reach,
    fingerprint_value,
    is_library_class,
)
from jaxnitro._src.core.errors import HookError, JaxnitroError, warn_user
from jaxnitro._src.dist.devices import mesh_id
from jaxnitro._src.dist.sharding import to_sharding
from jaxnitro._src.experiment import models, remat
from jaxnitro._src.experiment.markers import GRAPH, CompileView, field_values
from jaxnitro._src.optim import groups as optim
from jaxnitro._src.steps import custom
from jaxnitro._src.steps import metrics as metrics_mod
from jaxnitro._src.steps.ema import averaging
from jaxnitro._src.steps.step import (
    fuse,
    kept_if,
    loss_parts,
    make_eval_step,
    make_train_step,
    scalar_loss,
    slice_rows,
)

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Batch, PyTree
    from jaxnitro._src.programs.spec import ProgramSpec
    from jaxnitro._src.steps.state import TrainState
    from jaxnitro._src.steps.step import StepFn

_TRACED_HOOKS = ("forward", "loss", "metrics", "train_metrics", "train_step")
# The hooks each kind of program traces: a program's key holds their fingerprints only, so
# editing `metrics` never invalidates the train program.
_KIND_HOOKS = {
    "train": ("forward", "loss", "train_metrics"),
    "eval": ("forward", "loss", "metrics"),
    "predict": ("forward",),
}


def _kind_hooks(spec: ProgramSpec, kind: str) -> tuple[str, ...]:
    """The hooks a kind of program traces; a custom step's train program traces that hook
    (and what it reaches through `self`) instead of forward and loss."""
    if kind == "train" and "train_step" in spec.routes:
        return ("train_step",)
    return _KIND_HOOKS[kind]


def _forward(
    spec: ProgramSpec, device: Any, params: PyTree, model_state: PyTree, batch: Batch
) -> Any:
    try:
        out = spec.cls.forward(
            CompileView(spec.experiment, device, "forward"),
            spec.model,
            params,
            model_state,
            **spec.routes["forward"].select(batch),
        )
    except Exception as e:
        if not isinstance(e, JaxnitroError):  # the model's own error: say where it happened
            shapes = {k: f"{tuple(v.shape)} {v.dtype}" for k, v in batch.items()}
            e.add_note(f"jaxnitro: raised in {spec.cls.__name__}.forward on a batch {shapes}")
        raise
    if not (isinstance(out, tuple) and len(out) == 2):
        raise HookError(
            f"{spec.cls.__name__}.forward must return (outputs, new_state), got "
            f"{type(out).__name__}. Return what jn.apply returns: "
            f"`return jn.apply(model, params, state, x)`."
        )
    return out


def _cast_floats(tree: PyTree, dtype: Any) -> PyTree:
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, tree
    )


def train_loss_fn(spec: ProgramSpec) -> Callable[..., Any]:
    """(params, model_state, batch, extras, rng) -> (loss, (new_model_state, train metrics)).

    With precision="bf16" the forward and backward run in bfloat16 on a bf16 copy of the
    params and floating inputs (the gradient flows back through the cast to the f32 master
    params), and the outputs are cast to f32 before the loss.
    """
    bf16 = spec.precision == "bf16"

    def loss_fn(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any], rng: jax.Array
    ) -> tuple[Any, tuple[Any, Any]]:
        device = extras["device"]
        if bf16:
            params, batch_in = _cast_floats(params, jnp.bfloat16), _cast_floats(batch, jnp.bfloat16)
        else:
            batch_in = batch
        with models.mode(train=True, rng=rng):
            outputs, new_state = _forward(spec, device, params, model_state, batch_in)
        if bf16:
            outputs = _cast_floats(outputs, jnp.float32)
            new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, model_state)
        loss = spec.cls.loss(
            CompileView(spec.experiment, device, "loss"),
            outputs,
            **spec.routes["loss"].select(batch),
        )
        loss_parts(loss, *_loss_context(spec, "train", batch))  # checked here, with the split
        aux = {}
        if "train_metrics" in spec.routes:
            got = spec.cls.train_metrics(
                CompileView(spec.experiment, device, "train_metrics"),
                outputs,
                **spec.routes["train_metrics"].select(batch),
            )
            if not isinstance(got, dict):
                raise HookError(
                    f"train_metrics must return a dict name -> scalar, got {type(got).__name__}."
                )
            for k, v in got.items():
                v = jnp.asarray(v)
                if v.shape != ():
                    raise HookError(
                        f"train_metrics {k!r} has shape {v.shape}; each train metric is a scalar."
                    )
                aux[k] = v.astype(jnp.float32)
        return loss, (new_state, aux)

    return loss_fn


def custom_step_fn(spec: ProgramSpec) -> Callable[..., Any]:
    """(params, opt_state, state, rng, batch, extras) -> what the experiment's `train_step`
    returns, called in training mode (dropout on; `jn.apply` draws from its own key)."""
    route = spec.routes["train_step"]

    def user_step(
        params: PyTree,
        opt_state: PyTree,
        state: PyTree,
        rng: jax.Array,
        batch: Batch,
        extras: dict[str, Any],
    ) -> Any:
        hook_rng, mode_rng = jax.random.split(rng)
        view = CompileView(spec.experiment, extras["device"], "train_step")
        try:
            with models.mode(train=True, rng=mode_rng):
                return spec.cls.train_step(
                    view, spec.model, params, opt_state, state, hook_rng, **route.select(batch)
                )
        except Exception as e:
            if not isinstance(e, JaxnitroError):
                shapes = {k: f"{tuple(v.shape)} {v.dtype}" for k, v in batch.items()}
                e.add_note(f"jaxnitro: raised in {spec.cls.__name__}.train_step on {shapes}")
            raise

    return user_step


def _loss_context(spec: ProgramSpec, split: str, batch: Batch) -> tuple[str, str]:
    """(hook, where) for a loss error: the experiment's hook, the split and the batch rows
    (a micro-batch's with accum)."""
    rows = next((v.shape[0] for v in batch.values() if getattr(v, "ndim", 0)), None)
    size = f" ({rows} rows)" if rows is not None else ""
    return f"{spec.cls.__name__}.loss", f" on a batch of the {split!r} split{size}"


def eval_metrics_fn(spec: ProgramSpec, split: str) -> Callable[..., Any]:
    """(params, model_state, batch, extras, n_valid) -> {name: (sum, count)} for one batch."""
    has_loss = spec.split_specs[split].has_loss

    def metrics_fn(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any], n_valid: int
    ) -> PyTree:
        device = extras["device"]
        size = next(iter(batch.values())).shape[0]
        with models.mode(train=False):
            outputs, _ = _forward(spec, device, params, model_state, batch)
        outputs, batch = slice_rows(outputs, n_valid, size), slice_rows(batch, n_valid, size)
        rows = size if n_valid is None else n_valid
        totals = {}
        if has_loss:
            # Exact over the split: a scalar mean is weighted by the batch's rows, a
            # (sum, count) loss by its count, so the total divides once to sum / count.
            raw = spec.cls.loss(
                CompileView(spec.experiment, device, "loss"),
                outputs,
                **spec.routes["loss"].select(batch),
            )
            context = _loss_context(spec, split, batch)
            if isinstance(raw, (tuple, list)) and len(raw) == 2:
                total, count = loss_parts(raw, *context)
                totals["val_loss"] = (total, count.astype(jnp.float32))
            else:
                loss = scalar_loss(raw, *context)
                totals["val_loss"] = (loss * rows, jnp.asarray(rows, jnp.int32))
        if "metrics" in spec.routes:
            got = spec.cls.metrics(
                CompileView(spec.experiment, device, "metrics"),
                outputs,
                **spec.routes["metrics"].select(batch),
            )
            totals.update(metrics_mod.normalize(got))
        return totals

    return metrics_fn


def _no_compile_context(kind: str, label: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclasses.dataclass
class ProgramSet:
    """A run's compiled programs and what they were compiled from.

    Attributes:
        log: called with each compile's `other` log line (the run's logger, when writing).
        on_compile: `on_compile(kind, label)` -> a context manager around each XLA compile
            (the run's phase and progress display).
        prints: (name, fingerprint) of every traced function when the run first compiled
            (an entry point compares against it to find edited code).
        used: (kind, label) -> the program this run last used for it.
        compiled: the programs this run compiled (not cache hits), in order.
        train: (kind, steps per call) -> the train program of the current entry point.
        slots: the planned program slots already filled (a second compile of one warns).
        rebound: the classes of this run already named as re-defined (said once each).
        verified: the keys whose cached programs this entry-point call already checked
            against a trace of the current code (cleared at each entry point).
        parts: (hooks, helpers) of `explain.hook_parts` for `prints` (naming an edit).
    """

    log: Callable[[dict], Any] = lambda values: None
    on_compile: Callable[[str, str], Any] = _no_compile_context
    prints: tuple | None = None
    used: dict = dataclasses.field(default_factory=dict)
    compiled: list = dataclasses.field(default_factory=list)
    train: dict = dataclasses.field(default_factory=dict)
    slots: set = dataclasses.field(default_factory=set)
    rebound: set = dataclasses.field(default_factory=set)
    verified: set = dataclasses.field(default_factory=set)
    parts: tuple | None = None

    def reset_train(self) -> None:
        """Drop the run's train-program map (re-fetched from the cache, keyed anew)."""
        self.train = {}


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def traced_functions(
    spec: ProgramSpec, hooks: tuple[str, ...] = _TRACED_HOOKS, gaps: list[str] | None = None
) -> dict[str, Any]:
    """The traced `hooks`, plus the experiment's methods and properties they reach via `self`.

    `self.helper(...)` is an attribute load, invisible to a function fingerprint; following
    the names the code loads (three levels) puts an edited helper method into the key. A
    method still unfollowed below that goes into `gaps` (the key cannot prove it unchanged).
    """
    out: dict[str, Any] = {}
    frontier = [h for h in hooks if h in spec.routes]
    fields = spec.cls.__jn_fields__
    for _ in range(3):
        nxt = []
        for name in frontier:
            if name in out or name in fields or name.startswith("__"):
                continue
            attr = pyinspect.getattr_static(spec.cls, name, None)
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if isinstance(fn, (functools.partial, functools.partialmethod)):
                # `loss = functools.partialmethod(generic, k=1.0)`: the partial is the hook
                # (its arguments are in its fingerprint); follow the function underneath
                out[name] = fn
                inner = _partial_root(fn)
                if pyinspect.isfunction(inner):
                    nxt += sorted(_code_names(inner.__code__))
                continue
            if not pyinspect.isfunction(fn):
                continue
            out[name] = fn
            nxt += sorted(_code_names(fn.__code__))
        frontier = nxt
    if gaps is not None:
        deeper = [n for n in frontier if n not in out and _is_method(spec.cls, n)]
        gaps += [f"method `{n}` below the three levels followed" for n in deeper[:1]]
    return out


def _is_method(cls: Any, name: str) -> bool:
    if name in cls.__jn_fields__ or name.startswith("__"):
        return False
    attr = pyinspect.getattr_static(cls, name, None)
    fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
    return pyinspect.isfunction(fn) or isinstance(fn, (functools.partial, functools.partialmethod))


def _partial_root(fn: Any) -> Any:
    """The function under nested partials and partialmethods."""
    while isinstance(fn, (functools.partial, functools.partialmethod)):
        fn = fn.func
    return getattr(fn, "__func__", fn)


@dataclasses.dataclass(frozen=True, eq=False)
class ClassValue:
    """A class-level value of the experiment that traced code reads as `self.NAME` (not a
    field, not a method): `SCALE = 1.3`, `act = staticmethod(jnp.tanh)`."""

    value: Any


def class_values(spec: ProgramSpec, functions: dict[str, Any]) -> dict[str, ClassValue]:
    """``self.NAME`` -> the class-level value, for every name the traced `functions` load
    that the experiment's class (or a base) holds as a plain value or a callable that is not
    a Python function (a `jnp` function, a `functools.partial`, a wrapper object).

    A name loaded as an attribute of something else (`x.shape`) that the class also holds
    is keyed too: a harmless extra (it recompiles only when that class value changes).
    """
    fields = spec.cls.__jn_fields__
    names: set[str] = set()
    for fn in functions.values():
        code = getattr(_partial_root(fn), "__code__", None)
        if code is not None:
            names |= _code_names(code)
    out = {}
    for name in sorted(names):
        if name in fields or name in functions or name.startswith("__"):
            continue
        attr = pyinspect.getattr_static(spec.cls, name, _ABSENT)
        if attr is _ABSENT or isinstance(attr, (property, types.FunctionType)):
            continue
        inner = (
            getattr(attr, "__func__", attr)
            if isinstance(attr, (staticmethod, classmethod))
            else attr
        )
        if pyinspect.isfunction(inner):
            continue  # a static/class method: traced_functions follows it
        out[f"self.{name}"] = ClassValue(inner)
    return out


_ABSENT = object()


def model_classes(spec: ProgramSpec) -> dict[str, type]:
    """``model:Qualname`` -> every user class of the model (its modules), whose code the
    programs run: the model's key is its structure, which names the classes but not what
    their methods (and the helpers and module values those read) do."""
    return {
        f"model:{cls.__qualname__}": cls
        for cls in models.model_classes(spec.model)
        if not is_library_class(cls)
    }


def model_functions(spec: ProgramSpec) -> dict[str, Any]:
    """``model-fn:Owner.attr`` -> every user function the model holds as a value (an NNX
    module's `self.act = act`, a Linen module given `act=...`, an Equinox static field): the
    model's structure keys them by identity, so their code, globals and closures go here."""
    return {f"model-fn:{name}": fn for name, fn in models.held_functions(spec.model).items()}


def traced_code(
    spec: ProgramSpec, hooks: tuple[str, ...] = _TRACED_HOOKS, gaps: list[str] | None = None
) -> dict[str, Any]:
    """Everything whose content a program built from `hooks` depends on beyond its key's
    other parts: the hooks and the methods they reach (`traced_functions`), the class-level
    values they read through `self` (`class_values`), the model's classes (`model_classes`)
    and the functions the model holds (`model_functions`)."""
    functions = traced_functions(spec, hooks, gaps)
    return {
        **functions,
        **class_values(spec, functions),
        **model_classes(spec),
        **model_functions(spec),
    }


def code_print(obj: Any, gaps: list[str] | None = None) -> str:
    """The fingerprint of one entry of `traced_code` (what it cannot cover into `gaps`)."""
    if isinstance(obj, ClassValue):
        return fingerprint_value(obj.value, strict=False, gaps=gaps)
    return fingerprint(obj, gaps=gaps)


def hook_prints(spec: ProgramSpec, kind: str | None = None, gaps: list[str] | None = None) -> tuple:
    """(name, fingerprint) of everything a `kind` of program traces (all kinds: None); what
    the fingerprints cannot cover goes into `gaps`, each named with its entry."""
    hooks = _TRACED_HOOKS if kind is None else _kind_hooks(spec, kind)
    out = []
    for name, obj in traced_code(spec, hooks, gaps).items():
        found: list[str] = []
        out.append((name, code_print(obj, found)))
        if gaps is not None:
            gaps += [f"{why} (in {_shown(name)})" for why in found]
    return tuple(sorted(out))


def _traced_parts(spec: ProgramSpec, kind: str, gaps: list[str]) -> tuple[tuple, tuple, tuple]:
    """(`hook_prints`, then `explain.hook_parts`' hooks and helpers) of a kind of program, from
    one traversal of each traced entry (a program request pays it once)."""
    prints, own, reached = [], [], []
    for name, obj in traced_code(spec, _kind_hooks(spec, kind), gaps).items():
        found: list[str] = []
        if isinstance(obj, ClassValue):
            digest = fingerprint_value(obj.value, strict=False, gaps=found)
            own.append((name, digest))
        else:
            digest, reach = fingerprint_reach(obj, gaps=found)
            mine, theirs = explain.entry_parts(name, obj, reach, digest)
            own.append(mine)
            reached += theirs
        prints.append((name, digest))
        gaps += [f"{why} (in {_shown(name)})" for why in found]
    return tuple(sorted(prints)), tuple(own), tuple(reached)


def _state_arrays(ts: TrainState) -> tuple:
    """The arrays of a TrainState (its model and optimizer are in the key by structure)."""
    return (ts.params, ts.state, ts.opt_state, ts.step, ts.rng, ts.ema)


def program_key(
    spec: ProgramSpec,
    ps: ProgramSet,
    kind: str,
    split: str | None,
    inputs: dict,
    options: dict,
    *,
    avals: tuple,
    optimizer: Hashable = None,
) -> explain.ProgramKey:
    """The key of one program: every part that changes its graph, named for explanations."""
    if ps.prints is None:
        ps.prints = hook_prints(spec)
        ps.parts = explain.hook_parts(traced_code(spec))
    rows = tuple(
        (jax.tree_util.keystr(path), *cache.input_spec(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(inputs)[0]
    )
    graph = field_values(spec.experiment, GRAPH)
    gaps: list[str] = []  # what the key cannot prove unchanged (then a trace checks it)
    deps, hooks, helpers = _traced_parts(spec, kind, gaps)
    return explain.ProgramKey(
        kind=kind,
        experiment=spec.cls.__qualname__,
        # by content: a config's methods, a function's code and globals (not `==`, which
        # ignores a dataclass's methods and compares functions by identity); a digest, so a
        # value mutated in place later cannot change a stored key's hash
        graph_consts=tuple(
            (k, fingerprint_value(v, strict=False, gaps=gaps)) for k, v in graph.items()
        ),
        graph_shown=tuple((k, explain.shown(v)) for k, v in graph.items()),
        model=cache.freeze(models.structure_key(spec.model)),
        optimizer=optimizer,
        hooks=hooks,
        helpers=helpers,
        inputs=rows,
        split=split,
        options=tuple(
            sorted(
                {
                    **options,
                    "mesh": mesh_id(spec.mesh),
                    **{f"compile option {k}": v for k, v in spec.compile_options.items()},
                    **{f"{explain.JAX_FLAG}{k}": v for k, v in context.jax_flags()},
                    explain.ENVIRONMENT: context.environment(),
                }.items()
            )
        ),
        module=spec.cls.__module__,
        graph_types=tuple((k, type(v).__name__) for k, v in graph.items()),
        routes=tuple(
            sorted((k, r.required, r.optional, r.takes_all) for k, r in spec.routes.items())
        ),
        deps=deps,
        gaps=tuple(gaps),
        avals=avals,
    )


def _shown(name: str) -> str:
    """A `traced_code` name as the user wrote it."""
    if name.startswith("model:"):
        return f"the model class `{name.removeprefix('model:')}`"
    if name.startswith("model-fn:"):
        return f"the function `{name.removeprefix('model-fn:')}` the model holds"
    return f"`{name}`"


def _bound_now(cls: type) -> object | None:
    """What the class's module binds under its qualified name now (None: not found, or a
    class made inside a function, which no module binds)."""
    if "<locals>" in cls.__qualname__:
        return None
    obj: object = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        try:
            obj = vars(obj)[part]
        except (TypeError, KeyError):
            return None
    return obj


def check_rebound(spec: ProgramSpec, ps: ProgramSet) -> None:
    """Say once per class when the experiment's class (or a model class) is no longer the
    one its module binds under its name: a notebook cell re-run made a new class, and this
    handle still runs the old one's code (Python's semantics, but silent)."""
    classes = [spec.cls, *model_classes(spec).values()]
    for cls in classes:
        if cls in ps.rebound:
            continue
        now = _bound_now(cls)
        if not isinstance(now, type) or now is cls:
            continue
        ps.rebound.add(cls)
        exp = spec.cls.__name__
        what = "experiment" if cls is spec.cls else "model"
        warn_user(
            f"The {what} class `{cls.__qualname__}` was re-defined in `{cls.__module__}` after "
            f"this handle was made: this handle still runs the old class's code. To use the "
            f"new code, make a new handle: jn.Nitro({exp}(...), ...), or "
            f'jn.Nitro({exp}(...), run_dir=<this run\'s dir>, resume="auto") to continue '
            f"this run with it.",
        )


def check_stale(spec: ProgramSpec, ps: ProgramSet, *, begin: bool = True) -> None:
    """At an entry point: if a traced hook or helper was edited since this run compiled,
    drop the keys of the programs built from the old code and say so once, naming what
    changed (the hook, or the helper, module value or closure variable under it). Also names
    a class re-defined since the handle was made (`check_rebound`).

    `begin`: a new entry-point call, whose programs are each checked once against a trace of
    the current code before they run (`ProgramSet.verified`), unless a closed key proves
    them (`_acquire`); False: a step inside a call that already began (a validation).
    """
    if begin:
        ps.verified = set()
    check_rebound(spec, ps)
    old = ps.prints
    if old is None:
        return
    new = hook_prints(spec)
    if new == old:
        return
    was, now = dict(old), dict(new)
    edited = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    parts = explain.hook_parts(traced_code(spec))
    named = _edits(ps.parts, parts) or [_shown(name) for name in edited]

    def stale(p: Any) -> bool:  # only programs that trace the edited code; the others stay valid
        return any(now.get(name) != digest for name, digest in p.deps)

    kinds = sorted({p.kind for p in ps.used.values() if stale(p)})
    # Their keys go; the executables stay findable by program text, so an edit that traces to
    # the same program (a docstring, a renamed local) compiles nothing.
    dropped = cache.drop(
        lambda p: (
            isinstance(p.key, explain.ProgramKey)
            and (p.key.module, p.key.experiment) == (spec.cls.__module__, spec.cls.__qualname__)
            and stale(p)
        ),
        by_text=False,
    )
    ps.reset_train()
    ps.prints, ps.parts = new, parts
    ps.slots = set()  # the recompiles that follow are explained here, not again
    ps.verified = set()
    which = f" (the {' and '.join(kinds)} program{'s' * (len(kinds) > 1)})" if kinds else ""
    warn_user(
        f"{spec.cls.__name__}: {', '.join(named)} changed since this Nitro compiled its "
        f"programs; {dropped} stale program(s) dropped{which}, they will be traced again from "
        f"the current code and recompiled where the program changed; programs that do not "
        f"call it are kept.",
    )


_REACHED = {
    "global": "module-level value",
    "closure": "closure variable",
    "wrapper": "wrapper",
    "method": "method",
    "partial": "the arguments of partial",
}


def _edits(old: tuple | None, new: tuple) -> list[str]:
    """What changed between two `explain.hook_parts`, as the user wrote it: a hook, class
    value or model class by its name; a helper (module value, closure variable) under a hook
    whose own code is unchanged by its name and where it was reached from."""
    if old is None:
        return []
    (old_own, old_reach), (new_own, new_reach) = (map(dict, old), map(dict, new))
    roots = sorted(k for k in old_own.keys() | new_own.keys() if old_own.get(k) != new_own.get(k))
    out = [_shown(k) for k in roots]
    for key in sorted(old_reach.keys() | new_reach.keys()):
        if old_reach.get(key) == new_reach.get(key):
            continue
        root, _, item = key.partition("/")
        if root in roots or key not in old_reach or key not in new_reach:
            continue  # (what an edited function now uses or no longer uses: its consequence)
        kind, _, name = item.rpartition(":")
        line = f"{_REACHED.get(kind, 'helper')} `{name}` (reached from {_shown(root)})"
        if line not in out:
            out.append(line)
    return out


def _acquire(
    spec: ProgramSpec,
    ps: ProgramSet,
    key: explain.ProgramKey,
    lower: Any,
    *,
    label: str,
    bucket: int | None = None,
) -> cache.Program:
    """get_or_compile, plus this run's bookkeeping: reports, logs, recompile warnings."""
    kind = key.kind
    before = cache.cache_stats()["misses"]
    # The fast path: a closed key (its fingerprints cover everything the trace reads) that a
    # trace already proved runs its program; any other is checked against a trace of the
    # current code once per entry-point call: what a fingerprint cannot see, the text can.
    closed = not key.gaps
    verify = not (closed and cache.proven(key)) and key not in ps.verified
    prog = cache.get_or_compile(
        key,
        lower,
        kind=kind,
        label=label,
        devices=mesh_id(spec.mesh),
        hooks=tuple(h for h in _KIND_HOOKS[kind] if h in spec.routes),
        compile_options=dict(spec.compile_options),
        on_compile=ps.on_compile,
        verify=verify,
        closed=closed,
    )
    ps.verified.add(key)
    # A planned variant (the ragged last eval batch, a tail of single steps) is its own slot.
    slot = (kind, key.split, key.option("rows"), key.option("steps_per_call"), bucket)
    if cache.cache_stats()["misses"] > before:
        ps.compiled.append(prog)
        ps.log({"compile": _compile_line(prog)})
        for flag in prog.record.flags:
            warn_user(flag.message)
        if slot in ps.slots:
            why = "; ".join(prog.reasons) or "a new input signature"
            warn_user(f"recompiling the {kind} program ({label}): {why}")
    ps.slots.add(slot)
    ps.used[(kind, label)] = prog
    return prog


def _compile_line(prog: cache.Program) -> dict:
    rec = prog.record
    return {
        "kind": prog.kind,
        "label": prog.label,
        "trace_s": rec.trace_seconds,
        "lower_s": rec.lower_seconds,
        "compile_s": rec.compile_seconds,
        "loaded_from_persistent_cache": rec.loaded,
        "hlo_ops": rec.hlo_ops,
        "stablehlo_ops": rec.stablehlo_ops,
        "text_bytes": rec.text_bytes,
        "constant_bytes": rec.constant_bytes,
        "flops": rec.flops,
        "memory": rec.memory,
        "reasons": list(prog.reasons),
        "flags": [f.message for f in rec.flags],
    }


def train_program(
    spec: ProgramSpec,
    ps: ProgramSet,
    ts: TrainState,
    batch: Batch,
    extras: dict[str, Any],
    hyper: Any,
    steps: int,
) -> cache.Program:
    """The fused train step for these shapes: `(state leaves, batch, extras, hyper) ->
    (state leaves, outputs)`, compiled once per process."""
    options = {
        "accum": spec.accum,
        "steps_per_call": steps,
        "precision": spec.precision,
        "on_nonfinite": spec.on_nonfinite,
        "log_grad_norm": spec.log_grad_norm,
        "remat": spec.remat.key() if spec.remat is not None else None,
        "population": spec.population.key() if spec.population is not None else None,
        "early stopping per member": spec.population is not None and spec.early_stop is not None,
        "data on device": spec.resident is not None,
        "ema": spec.ema.key() if spec.ema is not None else None,  # (the decay is traced)
    }
    inputs = {"batch": batch, "extras": extras["device"]}
    if spec.resident is not None:  # the arrays are not stacked per step: not batch inputs
        inputs = {"batch": {"rows": batch["rows"]}, "train arrays on the device": batch["data"]}
        inputs["extras"] = extras["device"]
    key = program_key(
        spec,
        ps,
        "train",
        "train",
        inputs,
        options,
        avals=cache.avals((_state_arrays(ts), batch, extras, hyper)),
        optimizer=(optim.describe(spec.optimizer), cache.optimizer_key(spec.tx)),
    )
    step = _train_step(spec, steps, gathered=spec.resident is not None)
    leaves, treedef = jax.tree.flatten(ts)

    def flat_step(
        leaves: Any, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[list[Any], Any]:  # the state travels as a flat list
        new, out = step(jax.tree.unflatten(treedef, leaves), batch, extras, hyper)
        return jax.tree.leaves(new), out

    def lower() -> jax.stages.Traced:
        with remat.applied(spec.remat):  # named blocks recompute in the backward pass
            return jax.jit(
                flat_step,
                donate_argnums=(0,),
                # the state comes back placed as it went in (FSDP shards stay shards)
                out_shardings=([x.sharding for x in leaves], spec.replicated),
            ).trace(leaves, batch, extras, hyper)

    label = spec.cls.__name__ + (f", {steps} steps per call" if steps > 1 else "")
    return _acquire(spec, ps, key, lower, label=label)


def _train_step(spec: ProgramSpec, steps: int, *, gathered: bool = False) -> StepFn:
    """The built-in step (forward, loss, one gradient and update) or the experiment's own;
    for a population, that step under `vmap` over the members; `steps` of it per call,
    each on its batch gathered from the arrays on the device when `gathered`."""
    if "train_step" in spec.routes:
        one = custom.make_custom_step(
            custom_step_fn(spec),
            custom.Tools(spec.optimizer.labels, spec.optimizer.parts or {}),
            write_hyper=spec.hyper.write,
            unpack_hyper=spec.hyper.unpack,
            skip_nonfinite=spec.on_nonfinite == "skip",
        )
    else:
        one = make_train_step(
            train_loss_fn(spec),
            spec.tx,
            accum=spec.accum,
            write_hyper=spec.hyper.write,
            unpack_hyper=spec.hyper.unpack,
            skip_nonfinite=spec.on_nonfinite == "skip",
            grad_norm=spec.log_grad_norm,
        )
    if spec.ema is not None:  # the average moves in the same program, after the update
        one = averaging(one, spec.ema)
    pop = spec.population
    if pop is not None and spec.early_stop is not None:
        one = _frozen_when_stopped(one)
    if pop is not None:  # state, Device values and hyperparameters per member; batch shared
        one = jax.vmap(one, in_axes=(0, 0 if pop.own_data else None, 0, 0))
    return _gathering(one, steps) if gathered else fuse(one, steps)


def _gathering(one: Any, steps: int) -> StepFn:
    """`steps` of `one` per call, each on its batch gathered from the arrays kept on the
    device: the payload is {"rows": indices (steps, micro-batches, batch), "data": {field:
    array}}. Each step gathers its own rows (inside the loop of a fused call), so a call
    holds one step's batch at a time, not all of them."""

    def gathered(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        data = batch["data"]

        def on_rows(
            ts: TrainState, b: Any, extras: dict[str, Any], h: Any
        ) -> tuple[TrainState, Any]:
            got = {f: jnp.take(a, b["rows"], axis=0, mode="clip") for f, a in data.items()}
            return one(ts, got, extras, h)

        return fuse(on_rows, steps)(ts, {"rows": batch["rows"]}, extras, hyper)

    return gathered


def _frozen_when_stopped(one: Any) -> StepFn:
    """A member's step whose update is dropped once the member stopped early (`active`)."""

    def step(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        new, out = one(ts, batch, extras, hyper)
        return kept_if(extras["active"], new, ts), out  # (its step counter runs on)

    return step


def eval_metric_shapes(
    spec: ProgramSpec, ts: TrainState, split: str, extras: dict[str, Any]
) -> dict:
    """Abstract {name: (sum, count)} of the eval step on the split's first batch."""
    info = spec.split_specs[split]
    batch = {
        k: jax.ShapeDtypeStruct(info.first[k].shape, jnp.asarray(info.first[k][:1]).dtype)
        for k in info.fields
    }
    fn = eval_metrics_fn(spec, split)
    params, state = ts.params, ts.state
    if spec.population is not None:  # one member's shapes (the totals gain a member axis)
        params, state, extras = jax.eval_shape(
            lambda t: jax.tree.map(lambda x: x[0], t), (params, state, extras)
        )
    return jax.eval_shape(lambda p, s, b, e: fn(p, s, b, e, None), params, state, batch, extras)


def eval_totals(spec: ProgramSpec, ts: TrainState, split: str, extras: dict[str, Any]) -> PyTree:
    """Zero running totals of the eval step, on the mesh (one set per population member)."""
    zeros = metrics_mod.zeros_like_totals(eval_metric_shapes(spec, ts, split, extras))
    if spec.population is not None:
        size = spec.population.size
        zeros = jax.tree.map(lambda z: jnp.broadcast_to(z, (size, *z.shape)), zeros)
    return jax.tree.map(lambda x: to_sharding(x, spec.replicated), zeros)


def eval_program(
    spec: ProgramSpec,
    ps: ProgramSet,
    ts: TrainState,
    split: str,
    batch: Batch,
    extras: dict[str, Any],
    totals: Any,
    n_valid: int | None,
) -> cache.Program:
    """Forward + metrics added into running totals; one program per ragged width."""
    args = (ts.params, ts.state, batch, extras, totals)
    key = program_key(
        spec,
        ps,
        "eval",
        split,
        {"batch": batch, "extras": extras["device"]},
        {
            "rows": n_valid,
            "on the train split": split == "train",
            "loss": spec.split_specs[split].has_loss,
            "population": spec.population.key() if spec.population is not None else None,
        },
        avals=cache.avals(args),
    )
    step = make_eval_step(eval_metrics_fn(spec, split), n_valid)
    if spec.population is not None:  # every member on the same batch, totals per member
        step = jax.vmap(step, in_axes=(0, 0, None, 0, 0))
    label = split if n_valid is None else f"{split}, last batch of {n_valid}"
    return _acquire(
        spec,
        ps,
        key,
        lambda: jax.jit(step, donate_argnums=(4,), out_shardings=spec.replicated).trace(*args),
        label=label,
    )


def predict_program(
    spec: ProgramSpec, ps: ProgramSet, ts: TrainState, batch: Batch, extras: dict[str, Any]
) -> cache.Program:
    """Forward in inference mode, on a batch padded to a bucket (the host slices padding)."""

    def predict_step(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any]
    ) -> Any:
        with models.mode(train=False):
            outputs, _ = _forward(spec, extras["device"], params, model_state, batch)
        return outputs

    args = (ts.params, ts.state, batch, extras)
    key = program_key(
        spec,
        ps,
        "predict",
        None,
        {"batch": batch, "extras": extras["device"]},
        {"rows": None},
        avals=cache.avals(args),
    )
    # Each padded size (a bucket) is a planned program of its own, not a recompile.
    bucket = next(iter(batch.values())).shape[0]
    return _acquire(
        spec,
        ps,
        key,
        lambda: jax.jit(predict_step).trace(*args),
        label=spec.cls.__name__,
        bucket=bucket,
    )
