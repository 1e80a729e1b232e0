"""Pure step builders: `(carry, batch, extras) -> (carry, out)`.

The train step fuses forward, loss, gradient and the optimizer update in one program; the
eval step runs forward + metrics and adds the batch's (sum, count) totals to running totals
in-graph; the predict step runs forward in inference mode. Nothing here touches the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from .errors import HookError


class Carry(NamedTuple):
    """All mutable training state, donated to and returned by the train step."""

    params: Any
    model_state: Any
    opt_state: Any
    step: jax.Array  # optimizer steps taken (int32)


#: loss_fn(params, model_state, batch, extras, rng) -> (loss, (new_model_state, aux))
LossFn = Callable[..., tuple[jax.Array, tuple[Any, dict]]]


def scalar_loss(value, hook: str = "loss") -> jax.Array:
    """Check a loss is a scalar; `(sum, count)` means a count-weighted mean."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = value
        value = jnp.asarray(total) / jnp.asarray(count, jnp.result_type(total))
    value = jnp.asarray(value)
    if value.shape != ():
        raise HookError(
            f"{hook}() must return a scalar, got an array of shape {value.shape}. Reduce it, "
            f"e.g. return losses.mean() (or (losses.sum(), count) for a count-weighted mean)."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise HookError(f"{hook}() must return a floating-point scalar, got dtype {value.dtype}.")
    return value


def make_train_step(loss_fn: LossFn, tx: optax.GradientTransformation):
    """Build the fused train step: grad of `loss_fn`, one optimizer update, step + 1."""

    def train_step(carry: Carry, batch, extras):
        rng = jax.random.fold_in(extras["rng"], carry.step)

        def objective(params):
            return loss_fn(params, carry.model_state, batch, extras, rng)

        (loss, (model_state, aux)), grads = jax.value_and_grad(objective, has_aux=True)(
            carry.params
        )
        updates, opt_state = tx.update(grads, carry.opt_state, carry.params)
        params = optax.apply_updates(carry.params, updates)
        return Carry(params, model_state, opt_state, carry.step + 1), {"loss": loss, **aux}

    return train_step


def make_eval_step(metrics_fn, n_valid: int | None):
    """Build the eval step: forward + metrics on the first `n_valid` rows, added to totals.

    metrics_fn(params, model_state, batch, extras, n_valid) -> {name: (sum, count)}. A ragged
    final batch is padded to the compiled shape; `n_valid` (static) slices padding away before
    metrics run, so padding never reaches the totals.
    """

    def eval_step(params, model_state, batch, extras, totals):
        batch_totals = metrics_fn(params, model_state, batch, extras, n_valid)
        return jax.tree.map(lambda a, b: a + b.astype(a.dtype), totals, batch_totals)

    return eval_step


def slice_rows(tree, n_valid: int | None, batch_size: int):
    """Keep the first n_valid rows of every leaf whose leading dimension is the batch."""
    if n_valid is None or n_valid == batch_size:
        return tree
    return jax.tree.map(
        lambda x: x[:n_valid] if getattr(x, "ndim", 0) and x.shape[0] == batch_size else x, tree
    )
