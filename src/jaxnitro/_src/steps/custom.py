"""A custom train step: the experiment's `train_step` hook and the helpers it is written with.

Defining `train_step(self, model, params, opt_state, state, rng, *, <batch fields>)` on an
experiment replaces the built-in step (forward, loss, one gradient, one update). The hook gets
the whole parameter tree, `opt_state` as a dict group -> that group's optimizer state (one
optimizer per parameter group, from `optimizers(self)` or the optimizer hooks), the model
state and a per-step key, and returns `(params, opt_state, state, metrics)`. Two helpers make
the step read like the math:

- `jn.group_grad(fn, params, group, *args)` -> (value, grads): `fn(params, *args)` and its
  gradient with respect to one group's parameters, the other groups held constant;
- `jn.optimizer_step(group, params, opt_state, grads)` -> (params, opt_state): one group's
  optimizer (its clipping, rate and schedules) applied to that group's parameters only.

Everything else (validation, checkpoints of every optimizer state, bitwise resume, schedules,
`steps_per_call`, logging, `on_nonfinite`) is the framework's, as for the built-in step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import optax

from jaxnitro._src.core.errors import HookError, did_you_mean
from jaxnitro._src.steps.step import kept_if, step_inputs

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Batch, PyTree
    from jaxnitro._src.steps.state import TrainState
    from jaxnitro._src.steps.step import StepFn

__all__ = ["group_grad", "optimizer_step"]


@dataclasses.dataclass(frozen=True)
class Tools:
    """What the helpers need while a `train_step` is traced: the group of every parameter
    leaf (a tree like the params) and each group's optimizer."""

    labels: Any
    parts: Mapping[str, optax.GradientTransformation]


_active = threading.local()


@contextlib.contextmanager
def active(tools: Tools) -> Iterator[None]:
    """Make `tools` the helpers' context while the framework traces a `train_step`."""
    prev = getattr(_active, "tools", None)
    _active.tools = tools
    try:
        yield
    finally:
        _active.tools = prev


def _tools(helper: str, group: str) -> Tools:
    tools = getattr(_active, "tools", None)
    if tools is None:
        raise HookError(
            f"jn.{helper} works inside an experiment's train_step hook, where jaxnitro knows "
            f"the parameter groups and their optimizers. Call it from train_step(self, model, "
            f"params, opt_state, state, rng, ...)."
        )
    if group not in tools.parts:
        hint = did_you_mean(group, tools.parts)
        if list(tools.parts) == ["default"]:  # no optimizers() and no param_group
            hint += (
                " Name the groups: define optimizers(self) returning {group: optax "
                "transformation}, one per top-level module of the model (or param_group)."
            )
        raise HookError(
            f"jn.{helper}: no parameter group {group!r}; the groups are {sorted(tools.parts)}."
            + hint
        )
    return tools


def _in_group(labels: Any, group: str, tree: PyTree, other: Callable[[Any], Any]) -> PyTree:
    """`tree` with the leaves outside `group` replaced by `other(leaf)` (a static choice, so
    XLA drops the work that produced them)."""
    try:
        return jax.tree.map(lambda lab, x: x if lab == group else other(x), labels, tree)
    except ValueError as e:
        raise HookError(
            f"the tree given for group {group!r} is not shaped like the model's parameters; "
            f"pass the whole `params` tree that train_step received (or an update of it)."
        ) from e


def group_grad(
    fn: Callable[..., Any], params: PyTree, group: str, *args: Any, has_aux: bool = False
) -> tuple[Any, PyTree]:
    """`fn(params, *args)` and its gradient with respect to the parameters of one group.

    The other groups' parameters are constants of the differentiation (their entries in the
    returned gradient are zeros), which is the math of alternating updates: the
    discriminator's loss is differentiated with respect to the discriminator only.

    Args:
        fn: a function of the whole parameter tree returning a scalar (with `has_aux`, a pair
            `(scalar, aux)`).
        params: the whole parameter tree, as train_step received it or after an update.
        group: the parameter group to differentiate (a key of `optimizers(self)`).
        *args: further arguments of `fn` (a batch, a key), not differentiated.
        has_aux: `fn` returns `(value, aux)`; the result is then `((value, aux), grads)`.

    Returns:
        (value, grads), grads shaped like `params`.

    Raises:
        HookError: called outside an experiment's `train_step` hook, or `group` is not a
            parameter group.

    Example:
        >>> d_loss, grads = jn.group_grad(disc_loss, params, "disc", x, z)
        >>> params, opt_state = jn.optimizer_step("disc", params, opt_state, grads)
    """
    tools = _tools("group_grad", group)
    frozen = _in_group(tools.labels, group, params, jax.lax.stop_gradient)

    def of_group(p: Any) -> Any:
        whole = jax.tree.map(
            lambda lab, own, fixed: own if lab == group else fixed, tools.labels, p, frozen
        )
        return fn(whole, *args)

    value, grads = jax.value_and_grad(of_group, has_aux=has_aux)(params)
    return value, _in_group(tools.labels, group, grads, jnp.zeros_like)


def optimizer_step(
    group: str, params: PyTree, opt_state: Mapping[str, Any], grads: Any
) -> tuple[PyTree, dict[str, Any]]:
    """Apply one group's optimizer to that group's parameters; the others are untouched.

    Args:
        group: the parameter group (a key of `optimizers(self)`).
        params: the whole parameter tree.
        opt_state: the dict group -> optimizer state that train_step received (or an update).
        grads: gradients shaped like `params` (from `jn.group_grad`; entries outside the
            group are ignored).

    Returns:
        (params, opt_state) with the group's parameters and optimizer state updated.

    Raises:
        HookError: called outside an experiment's `train_step` hook, `group` is not a
            parameter group, or `opt_state` is not the dict `train_step` received.
    """
    tools = _tools("optimizer_step", group)
    if not isinstance(opt_state, Mapping) or group not in opt_state:
        raise HookError(
            f"jn.optimizer_step({group!r}, ...) needs the opt_state dict train_step received "
            f"(group -> optimizer state, groups {sorted(tools.parts)}); got "
            f"{type(opt_state).__name__}."
        )
    grads = _in_group(tools.labels, group, grads, jnp.zeros_like)
    updates, new_state = tools.parts[group].update(grads, opt_state[group], params)
    moved = optax.apply_updates(params, updates)
    params = jax.tree.map(
        lambda lab, new, old: new if lab == group else old, tools.labels, moved, params
    )
    return params, {**opt_state, group: new_state}


# -- the step built around the hook ---------------------------------------------------------
def _short(treedef: jax.tree_util.PyTreeDef, limit: int = 300) -> str:
    text = str(treedef)
    return text if len(text) <= limit else text[:limit] + " …"


def _same(what: str, got: Any, like: Any, others: Mapping[str, Any]) -> None:
    """`got` has the structure, shapes and dtypes of `like` (a step changes values only);
    `others` are the other trees received, to name a result returned in the wrong place."""
    treedef: Any = jax.tree.structure(got)  # (PyTreeDef's == is untyped in jaxlib's stubs)
    if treedef != jax.tree.structure(like):
        swapped = [name for name, t in others.items() if treedef == jax.tree.structure(t)]
        hint = (
            f"It has the structure of {swapped[0]}: return (params, opt_state, state, "
            f"metrics) in this order."
            if swapped
            else f"Return {what} updated in place of the one given (from jn.optimizer_step, "
            f"or unchanged)."
        )
        raise HookError(
            f"train_step returned {what} with another structure than it received:\n"
            f"  received {_short(jax.tree.structure(like))}\n  returned {_short(treedef)}\n" + hint
        )
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(like), strict=True
    ):
        if jnp.shape(a) != jnp.shape(b) or jnp.result_type(a) != jnp.result_type(b):
            raise HookError(
                f"train_step returned {what} whose leaf {jax.tree_util.keystr(path)} is "
                f"{jnp.shape(a)} {jnp.result_type(a)}, but it received {jnp.shape(b)} "
                f"{jnp.result_type(b)}. A step changes values, not shapes or dtypes."
            )


def _metrics(got: Any) -> dict[str, jax.Array]:
    if not isinstance(got, Mapping) or not all(isinstance(k, str) for k in got):
        raise HookError(
            f"train_step's fourth result must be a dict name -> scalar metric (e.g. "
            f"{{'d_loss': d, 'g_loss': g}}), got {type(got).__name__}."
        )
    if not got:
        raise HookError(
            "train_step returned no metrics; return at least one scalar, e.g. "
            "{'loss': loss} (logged per step, and the run's training loss)."
        )
    out = {}
    for k, v in got.items():
        v = jnp.asarray(v)
        if v.shape != ():
            raise HookError(
                f"train_step metric {k!r} has shape {v.shape}; each metric is a scalar "
                f"(reduce it, e.g. .mean())."
            )
        out[k] = v.astype(jnp.float32)
    return out


def checked(
    result: Any, params: PyTree, opt_state: PyTree, state: PyTree
) -> tuple[PyTree, PyTree, PyTree, dict[str, Any]]:
    """The hook's result as (params, opt_state, state, metrics), or an error naming what is
    missing or misshapen."""
    names = "(params, opt_state, state, metrics)"
    if not isinstance(result, (tuple, list)) or len(result) != 4:
        got = f"a {len(result)}-tuple" if isinstance(result, (tuple, list)) else type(result)
        raise HookError(
            f"train_step must return {names}, got {getattr(got, '__name__', got)}. Return "
            f"the updated trees and a dict of scalar metrics: `return params, opt_state, "
            f"state, {{'loss': loss}}`."
        )
    new_params, new_opt, new_state, metrics = result
    given = {"params": params, "opt_state": opt_state, "state": state}
    for name, tree in zip(given, (new_params, new_opt, new_state), strict=True):
        _same(name, tree, given[name], {k: v for k, v in given.items() if k != name})
    return new_params, new_opt, new_state, _metrics(metrics)


def make_custom_step(
    user_step: Callable,
    tools: Tools,
    *,
    write_hyper: Callable[..., Any] | None = None,
    unpack_hyper: Callable[..., Any] | None = None,
    skip_nonfinite: bool = False,
) -> StepFn:
    """One optimizer step of a custom `train_step`: `(ts, batch, extras, hyper) -> (ts, out)`.

    `user_step(params, opt_state, state, rng, batch, extras)` calls the hook. Scheduled
    hyperparameters are written into every group's optimizer state first; with
    `skip_nonfinite`, a step whose metrics are not all finite leaves the state untouched.
    """

    def one_step(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        rng, extras, opt_state = step_inputs(ts, extras, hyper, unpack_hyper, write_hyper)
        with active(tools):
            result = user_step(ts.params, opt_state, ts.state, rng, batch, extras)
        params, opt_state, state, out = checked(result, ts.params, opt_state, ts.state)
        new = ts.replace(params=params, state=state, opt_state=opt_state, step=ts.step + 1)
        if skip_nonfinite:  # any non-finite metric leaves the state untouched
            ok = jnp.all(jnp.stack([jnp.isfinite(v) for v in out.values()] or [jnp.bool_(True)]))
            new, out["skipped"] = kept_if(ok, new, ts), (~ok).astype(jnp.float32)
        return new, out

    return one_step
