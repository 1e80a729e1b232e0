"""The compiled programs of a `Nitro`: traced functions built from its hooks, and their keys.

Traced hooks run against the compile view (GraphConst values, Device tracers, Host refused);
the functions built here close over the model structure and the optimizer, which the key
covers, so a cached program is correct for every `Nitro` that produces the same key.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from . import metrics as metrics_mod
from . import models, optim
from .compile import cache
from .compile.fingerprint import fingerprint
from .devices import mesh_id
from .errors import HookError
from .experiment import CompileView, graph_key
from .step import make_eval_step, make_train_step, scalar_loss, slice_rows

_TRACED_HOOKS = ("forward", "loss", "metrics", "train_metrics")


def _forward(n, device, params, model_state, batch):
    out = n.cls.forward(CompileView(n.experiment, device, "forward"), n.model, params, model_state,
                        **n.routes["forward"].select(batch))
    if not (isinstance(out, tuple) and len(out) == 2):
        raise HookError(
            f"{n.cls.__name__}.forward must return (outputs, new_state), got "
            f"{type(out).__name__}. Return what jn.apply returns: "
            f"`return jn.apply(model, params, state, x)`.")
    return out


def _loss(n, device, outputs, batch):
    return scalar_loss(n.cls.loss(CompileView(n.experiment, device, "loss"), outputs, **n.routes["loss"].select(batch)))


def _cast_floats(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, tree)


def train_loss_fn(n):
    """(params, model_state, batch, extras, rng) -> (loss, (new_model_state, train metrics)).

    With precision="bf16" the forward and backward run in bfloat16 on a bf16 copy of the
    params and floating inputs (the gradient flows back through the cast to the f32 master
    params), and the outputs are cast to f32 before the loss.
    """
    bf16 = n.precision == "bf16"

    def loss_fn(params, model_state, batch, extras, rng):
        device = extras["device"]
        if bf16:
            params, batch_in = _cast_floats(params, jnp.bfloat16), _cast_floats(batch, jnp.bfloat16)
        else:
            batch_in = batch
        with models.mode(train=True, rng=rng):
            outputs, new_state = _forward(n, device, params, model_state, batch_in)
        if bf16:
            outputs = _cast_floats(outputs, jnp.float32)
            new_state = jax.tree.map(lambda new, old: new.astype(old.dtype), new_state, model_state)
        loss = n.cls.loss(CompileView(n.experiment, device, "loss"), outputs,
                          **n.routes["loss"].select(batch))
        aux = {}
        if "train_metrics" in n.routes:
            got = n.cls.train_metrics(CompileView(n.experiment, device, "train_metrics"), outputs,
                                      **n.routes["train_metrics"].select(batch))
            if not isinstance(got, dict):
                raise HookError(f"train_metrics must return a dict name -> scalar, got "
                                f"{type(got).__name__}.")
            for k, v in got.items():
                v = jnp.asarray(v)
                if v.shape != ():
                    raise HookError(f"train_metrics {k!r} has shape {v.shape}; each train "
                                    f"metric is a scalar.")
                aux[k] = v.astype(jnp.float32)
        return loss, (new_state, aux)

    return loss_fn


def eval_metrics_fn(n, split: str):
    """(params, model_state, batch, extras, n_valid) -> {name: (sum, count)} for one batch."""
    has_loss = n.batch_info[split]["has_loss"]

    def metrics_fn(params, model_state, batch, extras, n_valid):
        device = extras["device"]
        size = next(iter(batch.values())).shape[0]
        with models.mode(train=False):
            outputs, _ = _forward(n, device, params, model_state, batch)
        outputs, batch = slice_rows(outputs, n_valid, size), slice_rows(batch, n_valid, size)
        rows = size if n_valid is None else n_valid
        totals = {}
        if has_loss:  # val_loss is sample-weighted: exact over a ragged split
            loss = _loss(n, device, outputs, batch)
            totals["val_loss"] = (loss * rows, jnp.asarray(rows, jnp.int32))
        if "metrics" in n.routes:
            got = n.cls.metrics(CompileView(n.experiment, device, "metrics"), outputs,
                                **n.routes["metrics"].select(batch))
            totals.update(metrics_mod.normalize(got))
        return totals

    return metrics_fn


def _hook_prints(n) -> tuple:
    return tuple((h, fingerprint(getattr(n.cls, h))) for h in _TRACED_HOOKS if h in n.routes)


def _base_key(n, kind: str) -> tuple:
    return (
        kind,
        n.cls.__module__, n.cls.__qualname__,
        graph_key(n.experiment),
        cache.freeze(models.structure_key(n.model)),
        _hook_prints(n),
        tuple(sorted((k, r.required, r.optional, r.takes_all) for k, r in n.routes.items())),
        mesh_id(n.mesh),
        tuple(sorted(n.compile_options.items())),
    )


def _on_compile(n):
    return lambda kind, label: n.display.compiling(kind, label)


def train_program(n, batch, hyper, steps_per_call: int) -> cache.Program:
    """The fused train step for these shapes (compiled once per process)."""
    extras = n.extras()
    key = (*_base_key(n, "train"), n.accum, steps_per_call, n.precision, cache.optimizer_key(n.tx),
           cache.avals((n.carry, batch, extras, hyper)))
    step = make_train_step(
        train_loss_fn(n), n.tx, accum=n.accum, steps_per_call=steps_per_call,
        write_hyper=functools.partial(optim.write_hyper, n.optimizer),
        unpack_hyper=n.unpack_hyper)
    return cache.get_or_compile(
        key, lambda: jax.jit(step, donate_argnums=(0,), out_shardings=n._rep).lower(
            n.carry, batch, extras, hyper),
        kind="train", label=n.cls.__name__ + (f", {steps_per_call} steps per call"
                                              if steps_per_call > 1 else ""),
        devices=mesh_id(n.mesh), on_compile=_on_compile(n))


def eval_metric_shapes(n, split: str) -> dict:
    """Abstract {name: (sum, count)} of the eval step on the split's first batch."""
    info = n.batch_info[split]
    first = next(iter(n.splits[split]))
    batch = {k: jax.ShapeDtypeStruct(first[k].shape, jnp.asarray(first[k][:1]).dtype)
             for k in info["fields"]}
    fn = eval_metrics_fn(n, split)
    return jax.eval_shape(lambda p, s, b, e: fn(p, s, b, e, None),
                          n.carry.params, n.carry.model_state, batch, n.extras())


def eval_program(n, split: str, batch, totals, n_valid: int | None) -> cache.Program:
    """Forward + metrics added into running totals; one program per ragged width."""
    extras = n.extras()
    key = (*_base_key(n, "eval"), split == "train", n.batch_info[split]["has_loss"], n_valid,
           cache.avals((n.carry.params, n.carry.model_state, batch, extras, totals)))
    step = make_eval_step(eval_metrics_fn(n, split), n_valid)
    args = (n.carry.params, n.carry.model_state, batch, extras, totals)
    label = split if n_valid is None else f"{split}, last batch of {n_valid}"
    return cache.get_or_compile(
        key, lambda: jax.jit(step, donate_argnums=(4,), out_shardings=n._rep).lower(*args),
        kind="eval", label=label, devices=mesh_id(n.mesh), on_compile=_on_compile(n))


def predict_program(n, batch, n_valid: int | None) -> cache.Program:
    """Forward in inference mode; outputs sliced back to the real rows."""
    extras = n.extras()

    def predict_step(params, model_state, batch, extras):
        device = extras["device"]
        size = next(iter(batch.values())).shape[0]
        with models.mode(train=False):
            outputs, _ = _forward(n, device, params, model_state, batch)
        return slice_rows(outputs, n_valid, size)

    key = (*_base_key(n, "predict"), n_valid,
           cache.avals((n.carry.params, n.carry.model_state, batch, extras)))
    args = (n.carry.params, n.carry.model_state, batch, extras)
    return cache.get_or_compile(
        key, lambda: jax.jit(predict_step).lower(*args),
        kind="predict", label=n.cls.__name__, devices=mesh_id(n.mesh), on_compile=_on_compile(n))


def zero_totals(shapes) -> Any:
    return metrics_mod.zeros_like_totals(shapes)
