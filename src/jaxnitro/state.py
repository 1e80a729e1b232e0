"""The low-level layer: `TrainState` and `train_step(loss_fn, state, batch)`.

Usable alone (the way Lux's Training API is), compiled and cached exactly like the programs of
a `Nitro`: one fused program per (loss function, model structure, optimizer, batch shapes).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from . import models
from .compile import cache
from .errors import ConfigArgumentError, HookError
from .step import make_train_step, scalar_loss


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
        model,
        params,
        state=None,
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

    def replace(self, **changes) -> TrainState:
        return dataclasses.replace(self, **changes)


def _split_loss_output(out):
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


def train_step(loss_fn, state: TrainState, batch) -> tuple[TrainState, jax.Array, dict]:
    """One fused, compiled optimizer step: `(state, batch) -> (state, loss, aux)`.

    `loss_fn(model, params, model_state, batch)` returns `loss`, `(loss, new_model_state)` or
    `(loss, new_model_state, aux_dict)`. Inside it, `jn.apply` runs the model in training mode
    with a fresh per-step RNG. The input state's buffers are donated: keep the returned state.

    A call is one lookup by the function object, model, optimizer and shapes, then the
    dispatch. A redefined `loss_fn` (a notebook cell run again, `importlib.reload`) is a new
    object and compiles anew; a module-level value or closure variable the *same* function
    object reads is not re-checked on each call: after changing one, call `jn.cache_reset()`.

    Example:
        >>> def loss_fn(model, params, state, batch):
        ...     logits, state = jn.apply(model, params, state, batch["x"])
        ...     loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"])
        ...     return loss.mean(), state
        >>> ts, loss, aux = jn.train_step(loss_fn, ts, {"x": x, "y": y})
    """
    batch = jax.tree.map(
        lambda x: jnp.asarray(x) if isinstance(x, (np.ndarray, list)) else x, batch
    )
    leaves, treedef = jax.tree.flatten(state)
    batch_leaves, batch_def = jax.tree.flatten(batch)
    # The fast path: one lookup per (function object, model, optimizer, shapes). A new or
    # redefined function, model or optimizer is a new object, so it takes the full path
    # (fingerprints and structure keys) and an edit never reuses a stale program.
    fast = (
        id(loss_fn),
        id(state.model),
        id(state.tx),
        batch_def,
        tuple((x.shape, x.dtype) for x in leaves),
        tuple(
            (np.shape(x), getattr(x, "dtype", None), getattr(x, "weak_type", None))
            for x in batch_leaves
        ),
    )
    hit = _fast.get(fast)
    if hit is not None and hit[0] is loss_fn and hit[1] == treedef:
        call = hit[2]
    else:
        call = _program(loss_fn, state, leaves, treedef, batch).compiled
        _remember(fast, (loss_fn, treedef, call, state.model, state.tx))
    leaves, out = call(leaves, batch)
    loss = out.pop("loss")
    return jax.tree.unflatten(treedef, leaves), loss, out


_fast: collections.OrderedDict = collections.OrderedDict()
_FAST_ENTRIES = 64
cache.on_reset(_fast.clear)


def _remember(key, entry) -> None:
    """Keep the entry (it holds the function, model and optimizer, so their ids stay theirs)."""
    _fast[key] = entry
    _fast.move_to_end(key)
    while len(_fast) > _FAST_ENTRIES:
        _fast.popitem(last=False)


def _program(loss_fn, state: TrainState, leaves, treedef, batch) -> cache.Program:
    """The train-step program, from the process-wide cache (keyed by fingerprints)."""
    model, tx = state.model, state.tx

    def inner(params, model_state, batch, extras, rng):
        with models.mode(train=True, rng=rng):
            loss, new_state, aux = _split_loss_output(loss_fn(model, params, model_state, batch))
        return scalar_loss(loss, "loss_fn"), (model_state if new_state is None else new_state, aux)

    key = (
        "train_step",
        cache.freeze(loss_fn),
        cache.freeze(models.structure_key(model)),
        cache.optimizer_key(tx),
        cache.avals(([state.params, state.state, state.opt_state, state.step, state.rng], batch)),
    )
    step_fn = make_train_step(inner, tx)

    def flat_step(leaves, batch):  # the state travels as its leaves (model and tx are static)
        new, out = step_fn(jax.tree.unflatten(treedef, leaves), batch, {}, {})
        return jax.tree.leaves(new), out

    return cache.get_or_compile(
        key,
        lambda: jax.jit(flat_step, donate_argnums=(0,)).lower(leaves, batch),
        kind="train_step",
        label=getattr(loss_fn, "__qualname__", "loss_fn"),
    )
