"""The low-level layer: `TrainState` and `train_step(loss_fn, state, batch)`.

Usable alone (the way Lux's Training API is), compiled and cached exactly like the programs of
a `Nitro`: one fused program per (loss function, model structure, optimizer, batch shapes).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxnitro._src.compile import backend_options, cache, context
from jaxnitro._src.compile.fingerprint import is_library_class
from jaxnitro._src.compile.remembered import check_of, forget, remembered
from jaxnitro._src.core.errors import ConfigArgumentError, HookError
from jaxnitro._src.experiment import models
from jaxnitro._src.steps import leaf_layout
from jaxnitro._src.steps.step import make_train_step, scalar_loss

if TYPE_CHECKING:
    from collections.abc import Callable

    from jaxnitro._src.core.types import Batch, Model, PyTree


def default_optimizer(learning_rate: float = 1e-3) -> optax.GradientTransformation:
    """RAdam with its learning rate held in the optimizer state (a traced, strong f32)."""
    return optax.inject_hyperparams(optax.radam)(learning_rate=jnp.float32(learning_rate))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Model structure, parameters, model state, optimizer and its state, step and RNG; with
    `Nitro(ema=...)` also `ema`, the average of the weights (`{"decay", "params"[, "state"]}`).

    Example:
        >>> ts = jn.TrainState.create(model, params, state, optax.adam(1e-3))
        >>> ts, loss, aux = jn.train_step(loss_fn, ts, {"x": x, "y": y})
    """

    params: Any
    state: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    model: Any = dataclasses.field(metadata={"static": True})
    tx: Any = dataclasses.field(metadata={"static": True})
    ema: Any = None  # weight averaging (ema.py): None when off

    @classmethod
    def create(
        cls,
        model: Model,
        params: PyTree,
        state: PyTree = None,
        tx: optax.GradientTransformation | None = None,
        *,
        seed: int = 0,
    ) -> TrainState:
        """Initialize the optimizer state (default RAdam at 1e-3) and the step counter."""
        tx = tx if tx is not None else default_optimizer()
        if not hasattr(tx, "init") or not hasattr(tx, "update"):
            raise ConfigArgumentError(
                f"tx must be an optax.GradientTransformation, got {type(tx).__name__}; "
                f"pass one, e.g. jn.TrainState.create(model, params, state, optax.adam(1e-3))."
            )
        state = {} if state is None else state
        return cls(
            params=params,
            state=state,
            opt_state=jax.jit(tx.init)(params),
            step=jnp.zeros((), jnp.int32),
            rng=jax.random.PRNGKey(seed),
            model=model,
            tx=tx,
        )

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)

    def __getstate__(self) -> dict:
        # copy, deepcopy and pickle see an ordinary state (an unread one builds its fields).
        for field in _ARRAY_FIELDS:
            getattr(self, field)
        return dict(self.__dict__)

    if not TYPE_CHECKING:  # hidden from the type checker, which would then accept any name

        def __getattr__(self, name: str):
            # Reached only for an attribute the instance lacks: the array fields of a state
            # `train_step` returned and nobody has read yet. Its leaves wait in `_unread`
            # and become the fields on the first read (see `_unread_state`).
            if name not in _ARRAY_FIELDS or "_unread" not in self.__dict__:
                raise AttributeError(f"'TrainState' object has no attribute {name!r}")
            with _materializing:  # two threads reading at once get the same objects
                unread = self.__dict__.pop("_unread", None)
                if unread is not None:
                    full = jax.tree.unflatten(unread[3], _leaves_of(unread))
                    for field in _ARRAY_FIELDS:
                        object.__setattr__(self, field, getattr(full, field))
            return self.__dict__[name]


_ARRAY_FIELDS = ("params", "state", "opt_state", "step", "rng")
_materializing = threading.Lock()


def _unread_state(
    model: Model,
    tx: optax.GradientTransformation,
    moving: list,
    fixed: list,
    steps: int,
    treedef: jax.tree_util.PyTreeDef,
    program: _Fast,
    taken: list,
) -> TrainState:
    """A `TrainState` that holds its leaves unflattened until a field is first read.

    A training loop passes each returned state straight back to `train_step` and reads a
    field only now and then; rebuilding the pytree every step and flattening it again on the
    next call costs more than a small step itself when the parameters are NNX `State`s
    (every `Variable` is rebuilt in Python). An unread state goes back as its leaves. Once a
    field is read, the state is an ordinary one (its containers may since have been edited
    in place, so it is flattened again like any other). Its leaves are kept as the program
    takes them: those a step changes, and those it keeps (`_Fast.fixed_at`); `steps` is how
    many steps the kept step counter is behind (a program that does not count, `_Fast`);
    `taken` those of the kept leaves its program takes (`Layout.taken`).
    """
    ts = object.__new__(TrainState)
    unread = (moving, fixed, steps, treedef, program, taken)
    ts.__dict__.update(model=model, tx=tx, _unread=unread)
    return ts


def _leaves_of(unread: tuple) -> list:
    """An unread state's leaves, in order, its step counter brought up to date."""
    moving, fixed, steps, _, program, _ = unread
    return program.layout.merge(moving, fixed, steps)


def _split_loss_output(out: Any) -> tuple[Any, Any, Any]:
    """loss | (loss, new_state) | (loss, new_state, aux) -> (loss, new_state or None, aux)."""
    if isinstance(out, tuple) and len(out) in (2, 3):
        loss, new_state, *rest = out
        aux = rest[0] if rest else {}
        if not isinstance(aux, dict):
            raise HookError(
                f"the loss function's aux output must be a dict, got {type(aux).__name__}."
            )
        return loss, new_state, aux
    return out, None, {}


def train_step(
    loss_fn: Callable[..., Any], state: TrainState, batch: Batch
) -> tuple[TrainState, jax.Array, dict]:
    """One fused, compiled optimizer step: `(state, batch) -> (state, loss, aux)`.

    The input state's buffers are donated: keep the returned state. A call is keyed by
    content: the fingerprint of `loss_fn` (its code, closure, the helpers and module-level
    values it reads), of the model's classes and the functions it holds, the optimizer, the
    shapes, JAX's trace-time flags and the environment. An edit of a helper or module global
    the *same* function object reads moves it, so the next call runs the current code; where
    the fingerprint cannot cover what the trace reads (an object by identity, `getattr`, an
    import inside the function), each call is checked against a trace instead (never stale).

    Args:
        loss_fn: `loss_fn(model, params, model_state, batch)` returning `loss`,
            `(loss, new_model_state)` or `(loss, new_model_state, aux_dict)`; inside it,
            `jn.apply` runs the model in training mode with a fresh per-step RNG.
        state: the `jn.TrainState` (from `TrainState.create`, or the last call).
        batch: a dict of numpy or JAX arrays, batch first (numpy ones go to the device as
            the program starts).

    Returns:
        `(state, loss, aux)`: the updated state (step, params, optimizer and model state),
        the loss, and `loss_fn`'s aux dict (``{}`` without one).

    Example:
        >>> def loss_fn(model, params, state, batch):
        ...     logits, state = jn.apply(model, params, state, batch["x"])
        ...     loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        ...     return loss.mean(), state
        >>> ts, loss, aux = jn.train_step(loss_fn, ts, {"x": x, "y": y})
    """
    # The batch goes to the compiled call as it comes (checked and moved to the device in C++).
    unread = state.__dict__.get("_unread") if type(state) is TrainState else None
    if unread is not None:  # a state this function returned, not read since: no flatten
        program = unread[4]
        again = program.again
        if again is not None:  # the usual loop (`_again`); None: it cannot take it back
            done = again(loss_fn, state, unread, batch)
            if done is not None:
                return done
        treedef = unread[3]
        leaves, state_sig = _leaves_of(unread), program.out_sig
    else:
        leaves, treedef = jax.tree.flatten(state)
        state_sig = _state_sig(leaves)
    batch_leaves, batch_def = jax.tree.flatten(batch)
    sigs = (state_sig, batch_def, tuple(map(_input_sig, batch_leaves)))
    program = _lookup(loss_fn, state, leaves, treedef, batch, *sigs, unread=unread is not None)
    moving, fixed = program.layout.split(leaves)
    taken = program.layout.taken(fixed)
    moving, out = program.call(moving, taken, batch)
    if program.out_sig is None:  # the program's output avals, the same on every call
        program.returned(_state_sig(program.layout.merge(moving, fixed)))
    loss = out.pop("loss")
    unread = (moving, fixed, program.uncounted, treedef, program, taken)
    if type(state) is not TrainState:  # a subclass: its own fields, rebuilt as it is
        return jax.tree.unflatten(treedef, _leaves_of(unread)), loss, out
    return _unread_state(state.model, state.tx, *unread), loss, out


def _lookup(
    loss_fn: Callable[..., Any],
    state: PyTree,
    leaves: Any,
    treedef: jax.tree_util.PyTreeDef,
    batch: Batch,
    state_sig: Any,
    batch_def: Any,
    batch_sig: Any,
    *,
    unread: bool,
) -> _Fast:
    """The program for these inputs: from the table of the fast path, else the full path.

    The table is keyed by the ids of the function, model and optimizer (each entry holds
    them, so an id stays theirs) and the input signatures. A new or redefined function, model
    or optimizer is a new object, and code edited in place is a new code object, so each
    takes the full path (fingerprints and structure keys): an edit never reuses a stale
    program. An unread `state` has its fields built only for the full path.
    """
    model, tx = state.model, state.tx
    flags, env = context.jax_flags(), context.environment()
    content = _content(loss_fn, model)
    key = (id(loss_fn), id(model), id(tx), treedef, batch_def, state_sig, batch_sig, flags, env)
    hit = _fast.get(key)
    if hit is not None and hit.fits(loss_fn, model, content):
        if content[1] and (hit.check is None or not hit.check()):
            # the same content read from other objects (an equal value rebound): check those
            hit.check = check_of((loss_fn, *_model_code(model)))
            hit.arm()
        if not hit.world():  # flags or variables set and set back: compare the values now
            hit.world = context.unchanged(flags, env)
            hit.arm()
        return hit
    if unread:
        state = jax.tree.unflatten(treedef, leaves)
    program = _program(loss_fn, state, leaves, batch, content)
    call, layout = program.compiled, leaf_layout.chosen(program)
    # what a later call re-checks instead of building the content (`_again`)
    check = check_of((loss_fn, *_model_code(model))) if content[1] else None
    hit = _Fast(loss_fn, model, tx, call, state_sig, content, flags, env, check, layout=layout)
    _remember(key, hit)
    return hit


def _content(loss_fn: Callable[..., Any], model: Model) -> tuple[str, bool]:
    """(digest, closed) of the code a train step traces: the loss function and the model's
    classes and held functions, by content. Not closed: the digest has gaps (`fingerprint`),
    so it cannot prove the program unchanged and each call is checked against a trace.

    Each fingerprint is `remembered`: a call re-checks what the last traversal read."""
    gaps: list[str] = []
    parts = [remembered(loss_fn, gaps=gaps) if callable(loss_fn) else repr(loss_fn)]
    for code in _model_code(model):
        parts.append(remembered(code, gaps=gaps))
    return "\0".join(parts), not gaps


def _model_code(model: Model) -> tuple[Any, ...]:
    """What of `model` is code: an apply_fn itself; else its user classes and the functions
    it holds. Kept per model for NNX and Equinox, whose static half never changes (their
    classes are those of the graphdef or module tree); a Linen model's classes include those
    its code names, so they are found again at each call."""
    hit = _model_codes.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    if callable(model) and not isinstance(model, type):
        return (model,)  # an apply_fn: the model is code
    code = tuple(cls for cls in models.model_classes(model) if not is_library_class(cls))
    code += tuple(models.held_functions(model).values())
    if isinstance(model, (models.NNXModel, models.EqxModel)):
        _model_codes[id(model)] = (model, code)  # (holding the model keeps its id)
        while len(_model_codes) > _FAST_ENTRIES:
            _model_codes.pop(next(iter(_model_codes)))
    return code


_model_codes: dict[int, tuple[Any, tuple[Any, ...]]] = {}


def _input_sig(x: Any) -> Any:
    """What the compiled call checks of one input: a JAX array's aval (shape, dtype, weak
    type); for anything else its type, shape and dtype (a numpy array, a Python scalar)."""
    if type(x) is np.ndarray:
        return (np.ndarray, x.shape, x.dtype)
    aval = getattr(x, "aval", None)
    if aval is not None:
        return aval
    return (type(x), np.shape(x), getattr(x, "dtype", None))


def _state_sig(leaves: Any) -> tuple:
    try:
        return tuple([x.aval for x in leaves])
    except AttributeError:  # a numpy or Python leaf (e.g. parameters built with numpy)
        return tuple(map(_input_sig, leaves))


@dataclasses.dataclass(eq=False)
class _Fast:
    """A compiled train step as the fast path keeps it: the function, model and optimizer
    it was compiled for (held, so their ids stay theirs while it lives), their code objects,
    and the signatures of its inputs and outputs."""

    loss_fn: Any
    model: Any
    tx: Any
    call: Any
    state_sig: tuple
    content: tuple[str, bool]  # `_content` of the function and model it was traced from
    flags: tuple = ()  # the JAX flags it was traced under (`context.jax_flags`)
    env: str = ""  # and the environment's digest
    # `check_of` the function and the model's code: while it holds, `_content` would give
    # `content` again (None: not remembered, or an open content)
    check: Callable[[], bool] | None = None
    out_sig: tuple | None = None
    # which leaves it takes kept (`leaf_layout`), and the steps a call adds uncounted
    layout: leaf_layout.Layout = leaf_layout.Layout((), -1)
    uncounted: int = dataclasses.field(init=False)  # (the layout's)
    loops: bool = False  # its returned state is a valid input of its own (same signature)
    live: bool = True  # False once `jn.cache_reset()` dropped it
    # JAX's flags and the environment still `flags` and `env` (`context.unchanged`)
    world: Callable[[], bool] = dataclasses.field(init=False)
    # `_again`: a call on a state this program returned (None: its state cannot come back)
    again: Callable[..., Any] | None = None

    def __post_init__(self) -> None:
        self.uncounted = self.layout.uncounted
        self.world = context.unchanged(self.flags, self.env)

    def fits(self, loss_fn: Callable[..., Any], model: Model, content: tuple[str, bool]) -> bool:
        """Still this function's and model's program: alive, and their content the same and
        closed (what the trace read is all in it)."""
        return self.live and self.loss_fn is loss_fn and content[1] and content == self.content

    def returned(self, out_sig: tuple) -> None:
        """After the first call: the output signature, and the call itself from then on."""
        self.out_sig, self.loops = out_sig, out_sig == self.state_sig
        self.call = cache.direct_call(self.call)
        self.arm()

    def arm(self) -> None:
        """`again` for the current checks (`check`, `world`), each time one is replaced;
        None where the state cannot come back, the code cannot be checked, or the program
        was dropped."""
        usable = self.loops and self.check is not None and self.live
        self.again = _again(self) if usable else None


def _again(program: _Fast) -> Callable[..., Any]:
    """`train_step` on a state `program` returned and nobody read: `(loss_fn, state, its
    unread parts, batch) -> (state, loss, aux)`, or None where the state does not go back
    into it (then nothing ran).

    It goes back in the usual loop: the same function and model every step, their code and
    JAX's flags and environment unchanged, and a batch the compiled call accepts. The code
    is checked through the read logs of its fingerprints (`_content` without building it).
    A loop of small steps calls this every step, so it is one function of local names,
    made again whenever a check is replaced (`_Fast.arm`)."""
    loss_fn, model, tx, call = program.loss_fn, program.model, program.tx, program.call
    uncounted, new = program.uncounted, object.__new__
    world, check = program.world, program.check
    assert check is not None
    # the common case of `world` inline: JAX's flags as they were, the environment's dict
    # at the version it was last found equal at (else `world` compares it)
    read, flags, version, seen = getattr(world, "common", (tuple, (), None, [None]))

    def again(fn: Any, state: TrainState, unread: tuple, batch: Batch) -> Any:
        # (an unread state's model and optimizer are its program's: the keyed path looked the
        # program up by their ids, and every change of a field makes an ordinary state)
        if fn is not loss_fn or read() != flags:
            return None
        if (version is None or version.value != seen[0]) and not world():
            return None
        if not check():
            return None
        moving, fixed, steps, treedef, _, taken = unread
        try:
            moving, out = call(moving, taken, batch)
        except TypeError:
            # Another batch structure, shape or dtype: the call refused it before running
            # (nothing donated); the keyed path finds or compiles its program.
            return None
        ts = new(TrainState)  # `_unread_state`, inline
        fields = ts.__dict__
        fields["model"], fields["tx"] = model, tx
        fields["_unread"] = (moving, fixed, steps + uncounted, treedef, program, taken)
        return ts, out.pop("loss"), out

    return again


_fast: collections.OrderedDict = collections.OrderedDict()
_FAST_ENTRIES = 64


def _reset_fast() -> None:
    for program in _fast.values():  # an unread state may still point at one
        program.live = False
        program.arm()
    _fast.clear()
    _model_codes.clear()
    forget()  # (the remembered fingerprints hold the functions and values they read)


cache.on_reset(_reset_fast)


def _remember(key: Any, entry: _Fast) -> None:
    _fast[key] = entry
    _fast.move_to_end(key)
    while len(_fast) > _FAST_ENTRIES:
        _fast.popitem(last=False)


def _program(
    loss_fn: Callable[..., Any],
    state: TrainState,
    leaves: Any,
    batch: Batch,
    content: tuple[str, bool],
) -> cache.Program:
    """The train-step program, from the process-wide cache (keyed by `_content`; an open
    key is checked against a trace of the current code).

    It takes the state's leaves (flat lists: the call flattens them in C++, where an NNX
    `State` would call back into Python) as those a step changes (donated) and those it keeps
    (`leaf_layout`), and the batch; it returns the new state's changed leaves and the
    outputs. A state of a `TrainState` subclass is rebuilt after each call, so its step is
    counted on the device.
    """
    model, tx = state.model, state.tx

    def inner(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any], rng: jax.Array
    ) -> tuple[Any, Any]:
        with models.mode(train=True, rng=rng):
            loss, new_state, aux = _split_loss_output(loss_fn(model, params, model_state, batch))
        return scalar_loss(loss, "loss_fn"), (model_state if new_state is None else new_state, aux)

    rows = next((np.shape(x)[0] for x in jax.tree.leaves(batch) if np.ndim(x)), None)
    options = backend_options.defaults(jax.default_backend(), rows)  # as a run's programs
    key = (
        "train_step",
        tuple(options.items()),
        content[0],
        cache.freeze(models.structure_key(model)),
        cache.optimizer_key(tx),
        cache.avals(([state.params, state.state, state.opt_state, state.step, state.rng], batch)),
        context.jax_flags(),
        context.environment(),
        ("leaves kept, not returned", host_counts := type(state) is TrainState),
    )
    step_fn = make_train_step(inner, tx)  # model and tx are static: only leaves travel

    def lower() -> tuple[jax.stages.Traced, leaf_layout.Layout]:
        return leaf_layout.lower(
            lambda ts, batch: step_fn(ts, batch, {}, {}),
            state,
            leaves,
            (batch,),
            passed=leaf_layout.positions(state)[1],  # the RNG
            host_counts=host_counts,
        )

    closed = content[1]
    return leaf_layout.acquired(
        lambda traced: cache.get_or_compile(
            key,
            traced,
            kind="train_step",
            label=getattr(loss_fn, "__qualname__", "loss_fn"),
            verify=not (closed and cache.proven(key)),
            closed=closed,
            compile_options=options,
        ),
        lower,
    )
