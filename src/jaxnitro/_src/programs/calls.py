"""The hooks as traced programs call them: the forward pass, the train loss (with bf16
precision), the experiment's own `train_step` and the eval metrics, each run against the
compile view and raising errors that name the hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxnitro._src.core.errors import HookError, JaxnitroError
from jaxnitro._src.experiment import models
from jaxnitro._src.experiment.markers import CompileView
from jaxnitro._src.steps import metrics as metrics_mod
from jaxnitro._src.steps.step import (
    loss_parts,
    scalar_loss,
    slice_rows,
)

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Batch, PyTree
    from jaxnitro._src.programs.spec import ProgramSpec


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
