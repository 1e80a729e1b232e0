"""Pure step builders: `(state, batch, extras, hyper) -> (state, out)` on a `TrainState`.

The train step fuses forward, loss, gradient and the optimizer update in one program; the
eval step runs forward + metrics and adds the batch's (sum, count) totals to running totals
in-graph; the predict step runs forward in inference mode. Nothing here touches the host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias

import jax
import jax.numpy as jnp
import optax

from jaxnitro._src.core.errors import HookError
from jaxnitro._src.steps import metrics as metrics_mod

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Batch, PyTree
    from jaxnitro._src.steps.state import TrainState

#: A step: `(state, batch, extras, hyper) -> (state, outputs)`, pure, traced into a program.
StepFn: TypeAlias = "Callable[[TrainState, Batch, dict[str, Any], Any], tuple[TrainState, Any]]"

#: loss_fn(params, model_state, batch, extras, rng) -> (loss, (new_model_state, aux)), where
#: `loss` is a scalar or a (sum, count) pair (a count-weighted mean).
LossFn = Callable[..., tuple[Any, tuple[Any, dict]]]


def scalar_loss(value: Any, hook: str = "loss", where: str = "") -> jax.Array:
    """Check a loss is a floating scalar; a (sum, count) pair becomes sum / count.

    `hook` names the function in errors, `where` what it ran on (e.g. " on a batch of the
    'train' split (32 rows)")."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = loss_parts(value, hook, where)
        return total / count
    value = jnp.asarray(value)
    if value.shape != ():
        raise HookError(
            f"{hook}() returned an array of shape {value.shape}{where}; it must return a "
            f"scalar. Reduce it, e.g. return losses.mean() (or (losses.sum(), count) for a "
            f"count-weighted mean)."
        )
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise HookError(
            f"{hook}() must return a floating-point scalar, got dtype {value.dtype}{where}. An "
            f"integer "
            f"loss has no gradient: compute it in floating point (e.g. "
            f"optax.softmax_cross_entropy_with_integer_labels(...).mean()) or .astype(jnp.float32)."
        )
    return value


def loss_parts(value: Any, hook: str = "loss", where: str = "") -> tuple[jax.Array, jax.Array]:
    """(numerator, count) of a loss: a scalar mean counts 1; (sum, count) is weighted by count."""
    if isinstance(value, (tuple, list)) and len(value) == 2:
        total, count = scalar_loss(value[0], hook, where), jnp.asarray(value[1])
        if count.shape != ():
            raise HookError(
                f"{hook}() returned (sum, count) with a count of shape {count.shape}{where}; "
                f"the count is a scalar (samples or tokens in the sum)."
            )
        return total, count.astype(total.dtype)
    value = scalar_loss(value, hook, where)
    return value, jnp.ones((), value.dtype)


def _gradients(loss_fn: LossFn, accum: int) -> Callable[..., Any]:
    """(params, model_state, batch, extras, rng) -> (grads, loss, new model state, aux): the
    gradient of the count-weighted mean loss, over `accum` micro-batches in a `lax.scan`."""

    def grads_of(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any], rng: jax.Array
    ) -> tuple[Any, ...]:
        def objective(p: Any, ms: Any, b: Any, r: Any) -> tuple[Any, Any]:
            value, (ms, aux) = loss_fn(p, ms, b, extras, r)
            num, count = loss_parts(value)
            return num, (count, ms, aux)

        grad_fn = jax.value_and_grad(objective, has_aux=True)
        if accum == 1:
            (num, (count, model_state, aux)), grads = grad_fn(params, model_state, batch, rng)
            return jax.tree.map(lambda g: g / count, grads), num / count, model_state, aux

        def micro(acc: Any, xs: Any) -> tuple[Any, Any]:
            g_sum, n_sum, c_sum, ms = acc
            b, i = xs
            (num, (count, ms, aux)), g = grad_fn(params, ms, b, jax.random.fold_in(rng, i))
            return (jax.tree.map(jnp.add, g_sum, g), n_sum + num, c_sum + count, ms), aux

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (zeros, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), model_state)
        (g_sum, n_sum, c_sum, model_state), auxs = jax.lax.scan(
            micro, init, (batch, jnp.arange(accum))
        )
        aux = jax.tree.map(lambda a: a[-1], auxs)  # the closing micro-batch's train metrics
        return jax.tree.map(lambda g: g / c_sum, g_sum), n_sum / c_sum, model_state, aux

    return grads_of


def make_train_step(
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    *,
    accum: int = 1,
    steps_per_call: int = 1,
    write_hyper: Callable[..., Any] | None = None,
    unpack_hyper: Callable[..., Any] | None = None,
    skip_nonfinite: bool = False,
    grad_norm: bool = False,
) -> StepFn:
    """Build the fused train step: gradient (accumulated in-graph), one optimizer update.

    With `accum=k` the batch arrives stacked as (k, micro_batch, ...) and the k micro-batches
    run in a `lax.scan`; gradients of the summed loss numerators are divided once by the
    summed counts, so the step equals the big-batch step (token-weighted for (sum, count)).
    With `steps_per_call=s` the inputs carry a leading (s, ...) axis and s optimizer steps run
    in one dispatch. `hyper` holds per-step values ({"opt": {...}, "device": {...}}, or a
    packed vector that `unpack_hyper` turns into that dict).
    """

    grads_of = _gradients(loss_fn, accum)

    def one_step(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        rng, extras, opt_state = step_inputs(ts, extras, hyper, unpack_hyper, write_hyper)
        grads, loss, model_state, aux = grads_of(ts.params, ts.state, batch, extras, rng)
        updates, opt_state = tx.update(grads, opt_state, ts.params)
        params = optax.apply_updates(ts.params, updates)
        out = {"loss": loss, **aux}
        if grad_norm:  # the driver logs it per step; the low-level train_step does not pay
            out["grad_norm"] = optax.tree.norm(grads)
        new = ts.replace(params=params, state=model_state, opt_state=opt_state, step=ts.step + 1)
        if skip_nonfinite:  # a non-finite loss leaves params, state and optimizer untouched
            ok = jnp.isfinite(loss)
            new, out["skipped"] = kept_if(ok, new, ts), (~ok).astype(jnp.float32)
        return new, out

    return fuse(one_step, steps_per_call)


def step_inputs(
    ts: TrainState,
    extras: dict[str, Any],
    hyper: Any,
    unpack_hyper: Callable[..., Any] | None = None,
    write_hyper: Callable[..., Any] | None = None,
) -> tuple[jax.Array, dict[str, Any], PyTree]:
    """(this step's key, extras with the step's Device values, the optimizer state with the
    step's hyperparameters written in) of a train step."""
    rng = jax.random.fold_in(ts.rng, ts.step)
    hyper = unpack_hyper(hyper) if unpack_hyper is not None else (hyper or {})
    extras = {**extras, "device": {**extras.get("device", {}), **hyper.get("device", {})}}
    opt_state = ts.opt_state
    if write_hyper is not None and hyper.get("opt"):
        opt_state = write_hyper(opt_state, hyper["opt"])
    return rng, extras, opt_state


def kept_if(ok: Any, new: Any, old: Any) -> TrainState:
    """`new` where `ok`, else `old`'s params, model state, optimizer state and weight
    average (the step counter runs on): a skipped step, or a population member that stopped
    early."""
    keep = {
        k: jax.tree.map(lambda a, b: jnp.where(ok, a, b), getattr(new, k), getattr(old, k))
        for k in ("params", "state", "opt_state", "ema")
    }
    return new.replace(**keep)


def fuse(one_step: Any, steps_per_call: int) -> StepFn:
    """`steps_per_call` optimizer steps in one dispatch (a `lax.scan` over a leading axis of
    the batch and the per-step hyperparameters); one step is returned as it is."""
    if steps_per_call == 1:
        return one_step

    def fused(
        ts: TrainState, batches: Any, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        def body(c: Any, xs: Any) -> tuple[TrainState, Any]:
            b, h = xs
            return one_step(c, b, extras, h)

        return jax.lax.scan(body, ts, (batches, hyper))

    return fused


def make_eval_step(metrics_fn: Any, n_valid: int | None) -> Callable[..., Any]:
    """Build the eval step: forward + metrics on the first `n_valid` rows, added to totals.

    metrics_fn(params, model_state, batch, extras, n_valid) -> {name: (sum, count)}. A ragged
    final batch is padded to the compiled shape; `n_valid` (static) slices padding away before
    metrics run, so padding never reaches the totals.
    """

    def eval_step(
        params: PyTree, model_state: PyTree, batch: Batch, extras: dict[str, Any], totals: Any
    ) -> PyTree:
        return metrics_mod.add(totals, metrics_fn(params, model_state, batch, extras, n_valid))

    return eval_step


def slice_rows(tree: PyTree, n_valid: int | None, batch_size: int) -> PyTree:
    """Keep the first n_valid rows of every leaf whose leading dimension is the batch."""
    if n_valid is None or n_valid == batch_size:
        return tree
    return jax.tree.map(
        lambda x: x[:n_valid] if getattr(x, "ndim", 0) and x.shape[0] == batch_size else x, tree
    )
