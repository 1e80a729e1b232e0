"""How a train program takes a `TrainState`'s leaves: which it donates and returns, and which
it keeps (takes, neither donated nor returned).

On a CPU, every leaf a call donates and returns costs ~1.5 µs (its donation, a new output
array), which a small model's step feels. Three kinds of leaf need not travel:

- the RNG never changes in a train step (each step's key is folded in from it and the step
  counter);
- the optimizer hyperparameters that `optax.inject_hyperparams` keeps in the state and no
  step writes (an RAdam's b1, b2, eps, ...): passed through unchanged;
- the step counter, where the traced step never reads its key (an NNX model draws dropout
  from its own `Rngs`; a model without dropout): the host counts the steps instead
  (`Layout.uncounted`), and adds them when the state is read (`Layout.merge`, `Unmerged`).

Which apply is decided from one trace (`lower`), with the counter among the changed leaves:
a leaf kept but changed after all is traced again as a changed leaf; where nothing but its
own new value reads the counter, the program is made again from its jaxpr without them
(`_slimmed`). A kept leaf the trace never reads (the RNG without dropout, a counter the host
counts) is not even taken (`Layout.idle_at`, `Layout.taken`): each input costs a CPU call
its dispatch, read or not. The layout a program was lowered with is kept by its cache key
(`acquired`, `chosen`), so a cached program is called as it was built.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from typing import TYPE_CHECKING, Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Iterable


@dataclasses.dataclass(frozen=True)
class Layout:
    """The positions among a state's leaves of those a program keeps (`fixed_at`), of the
    step counter (`step_at`), and how many steps a call adds that the program does not
    count (`uncounted`: 1 where the counter is kept and the host counts)."""

    fixed_at: tuple[int, ...]
    step_at: int
    uncounted: int = 0
    # the kept leaves the program does not take at all (its trace never reads them)
    idle_at: tuple[int, ...] = ()

    def split(self, leaves: list) -> tuple[list, list]:
        """A state's leaves -> (those the program donates and returns, those it keeps)."""
        at = self.fixed_at
        return [x for i, x in enumerate(leaves) if i not in at], [leaves[i] for i in at]

    def taken(self, fixed: list) -> list:
        """Of the kept leaves (`split`'s second list), those a call of the program takes:
        all but the idle ones (`fixed` itself where none is idle)."""
        if not self.idle_at:
            return fixed
        return [x for i, x in zip(self.fixed_at, fixed, strict=True) if i not in self.idle_at]

    def merge(self, moving: list, fixed: list, behind: int = 0) -> list:
        """`split`'s two lists -> the state's leaves, in order; a kept step counter advanced
        by the `behind` steps the host counted since it was right."""
        leaves = list(moving)
        for i, x in zip(self.fixed_at, fixed, strict=True):
            leaves.insert(i, x)
        if behind and self.uncounted:
            leaves[self.step_at] = _advanced(leaves[self.step_at], behind)
        return leaves

    def flat(
        self, step_fn: Callable[..., Any], treedef: Any, passed: tuple[int, ...], changed: set
    ) -> Any:
        """`step_fn` on a state as (changed leaves, kept leaves, *inputs) -> (the new changed
        leaves, outputs); a leaf at `passed` the step does change is added to `changed`."""

        def flat_step(moving: list, fixed: list, *inputs: Any) -> tuple[list, Any]:
            leaves = self.merge(moving, fixed)
            new, out = step_fn(jax.tree.unflatten(treedef, leaves), *inputs)
            new_leaves = jax.tree.leaves(new)
            changed.update(i for i in passed if new_leaves[i] is not leaves[i])
            return [x for i, x in enumerate(new_leaves) if i not in self.fixed_at], out

        return flat_step


class Unmerged:
    """A state's leaves as `split` holds them, merged (and a kept step counter advanced) on
    their first read, once (`leaves`; several threads may read).

    An epoch hands its state to the handle after each read-back chunk. Merging there would
    advance the kept counter on the device each time: on a CPU that addition waits behind the
    calls in flight (~25-100 µs a chunk). Most handovers are never read (the next chunk's
    replaces them); those that are read (a step callback, a checkpoint, the epoch's end) pay
    the addition once, as before.
    """

    __slots__ = ("_lock", "_merged", "_parts")

    def __init__(self, layout: Layout, moving: list, fixed: list, behind: int):
        self._parts: tuple | None = (layout, list(moving), list(fixed), behind)
        self._merged: list | None = None
        self._lock = threading.Lock()

    def leaves(self) -> list:
        with self._lock:
            if self._merged is None:
                assert self._parts is not None
                layout, moving, fixed, behind = self._parts
                self._merged, self._parts = layout.merge(moving, fixed, behind), None
            return self._merged


_add = jax.jit(operator.add)
_by: dict[int, Any] = {}  # steps -> the device scalar (the same few, again and again)


def _advanced(step: Any, by: int) -> Any:
    """`step + by` on the device, compiled once (`by` a device scalar made once): an eager
    `+` of a Python int costs ~60 µs of a CPU through JAX's dispatch, this ~21 µs."""
    scalar = _by.get(by)
    if scalar is None:
        if len(_by) > 64:
            _by.clear()
        scalar = _by[by] = jnp.asarray(np.int32(by))
    return _add(step, scalar)


def positions(state: Any) -> tuple[int, tuple[int, ...]]:
    """(the step counter's position, the RNG's positions) among the leaves of `state`."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    names = [getattr(path[0], "name", "") for path in paths]
    return names.index("step"), tuple(i for i, name in enumerate(names) if name == "rng")


def constant_hyperparameters(state: Any, written: Iterable[str]) -> tuple[int, ...]:
    """The positions of the optimizer hyperparameters that `optax.inject_hyperparams` keeps
    in the state and no step writes (`written`: the names a run writes each step): an
    RAdam's b1, b2, eps, eps_root and threshold, passed through with every call."""
    skip = set(written)
    out = []
    for i, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(state)[0]):
        names = [getattr(k, "name", getattr(k, "key", None)) for k in path]
        if "hyperparams" in names[:-1] and names[-1] not in skip:
            out.append(i)
    return tuple(out)


def lower(
    step_fn: Callable[..., Any],
    state: Any,
    leaves: list,
    inputs: tuple,
    *,
    passed: Iterable[int],
    host_counts: bool,
    out_shardings: Callable[[list], Any] | None = None,
) -> tuple[jax.stages.Traced, Layout]:
    """The traced program `(changed leaves, kept leaves, *inputs) -> (new changed leaves,
    outputs)` of `step_fn(state, *inputs)`, and its layout.

    Kept: the leaves at `passed` that the step passes through unchanged (a leaf it changes
    after all is found in the trace, and traced again as a changed one), and where
    `host_counts` allows it and the trace never reads it, the step counter. `out_shardings`
    maps the changed leaves to the shardings of the returned ones.
    """
    treedef = jax.tree.structure(state)
    step_at = positions(state)[0]
    passed = set(passed)
    while True:  # (the counter changes on the device here; `_slimmed` may give it the host)
        layout = Layout(tuple(sorted(passed)), step_at)
        changed: set[int] = set()
        moving, fixed = layout.split(leaves)
        extra = {} if out_shardings is None else {"out_shardings": out_shardings(moving)}
        fn = layout.flat(step_fn, treedef, tuple(sorted(passed)), changed)
        traced = jax.jit(fn, donate_argnums=(0,), **extra).trace(moving, fixed, *inputs)
        if not changed:
            break
        passed -= changed  # kept where it changes: a changed leaf, traced again
    return _slimmed(traced, layout, leaves, inputs, host_counts, out_shardings)


def _slimmed(
    traced: jax.stages.Traced,
    layout: Layout,
    leaves: list,
    inputs: tuple,
    host_counts: bool,
    out_shardings: Callable[[list], Any] | None,
) -> tuple[jax.stages.Traced, Layout]:
    """The traced program, less what it does not need, and its layout: where `host_counts`
    allows it and nothing but its own new value reads the step counter, the counter is kept
    and counted by the host (`Layout.uncounted`); and the kept leaves nothing reads (the RNG
    without dropout, a counter the host counts) are not taken (`Layout.idle_at`).

    On a CPU each input and output of a call costs its dispatch (~0.2 µs an input, however
    unused). The program is made again from its own jaxpr, less those inputs and outputs and
    the equations nothing reads: the user's code is traced once either way."""
    closed = traced.jaxpr
    moving_at = [i for i in range(len(leaves)) if i not in layout.fixed_at]
    at = {i: n for n, i in enumerate(moving_at)}  # a leaf -> its input position in the trace
    at.update({i: len(moving_at) + n for n, i in enumerate(layout.fixed_at)})
    counter = at[layout.step_at]  # (also its output's position: the new changed leaves first)
    invars = closed.jaxpr.invars
    drop_out: set[int] = set()
    if host_counts:  # what is read but for the counter's own new value
        live, eqns = _liveness(closed.jaxpr, {counter})
        if id(invars[counter]) not in live:
            fixed_at = tuple(sorted((*layout.fixed_at, layout.step_at)))
            layout, drop_out = Layout(fixed_at, layout.step_at, 1), {counter}
    if not drop_out:
        live, eqns = _liveness(closed.jaxpr, set())
    idle = tuple(i for i in layout.fixed_at if id(invars[at[i]]) not in live)
    if not idle and not drop_out:
        return traced, layout
    smaller = _dropped(closed, {at[i] for i in idle}, drop_out, eqns)
    if smaller is None:  # a JAX whose jaxprs this cannot rebuild: the program as traced
        return traced, _as_traced(layout)
    run = jex.core.jaxpr_as_fun(smaller)
    out_tree = _less(traced.out_tree, counter) if drop_out else traced.out_tree
    layout = dataclasses.replace(layout, idle_at=idle)
    moving, fixed = layout.split(leaves)
    extra = {} if out_shardings is None else {"out_shardings": out_shardings(moving)}

    def program(moving: list, taken: list, *inputs: Any) -> Any:
        return jax.tree.unflatten(out_tree, run(*jax.tree.leaves((moving, taken, inputs))))

    program.__name__ = getattr(traced, "fun_name", None) or "flat_step"
    again = jax.jit(program, donate_argnums=(0,), **extra)
    return again.trace(moving, layout.taken(fixed), *inputs), layout


def _as_traced(layout: Layout) -> Layout:
    """The layout of the program as traced: the counter among the changed leaves."""
    return Layout(tuple(i for i in layout.fixed_at if i != layout.step_at), layout.step_at)


def _less(out_tree: Any, n: int) -> Any:
    """The output structure `(new changed leaves, outputs)` without the changed leaf `n`."""
    new, out = jax.tree.unflatten(out_tree, list(range(out_tree.num_leaves)))
    return jax.tree.structure(([x for x in new if x != n], out))


def _dropped(closed: Any, drop_in: set[int], drop_out: set[int], eqns: list) -> Any:
    """`closed` (a ClosedJaxpr) without its inputs at `drop_in` and outputs at `drop_out`,
    with only `eqns` (`_liveness` of the outputs left: what nothing left reads is gone; no
    input at `drop_in` is read); None where this JAX's jaxprs do not allow it."""
    jaxpr = closed.jaxpr
    outvars = [v for n, v in enumerate(jaxpr.outvars) if n not in drop_out]
    keep = [n for n in range(len(jaxpr.invars)) if n not in drop_in]
    try:
        info = jaxpr.debug_info
        if info is not None and info.arg_names is not None:
            info = info._replace(arg_names=tuple(info.arg_names[n] for n in keep))
        if info is not None and isinstance(info.result_paths, tuple) and drop_out:
            paths = info.result_paths
            info = info._replace(
                result_paths=tuple(p for n, p in enumerate(paths) if n not in drop_out)
            )
        smaller = jaxpr.replace(
            invars=[jaxpr.invars[n] for n in keep],
            outvars=outvars,
            eqns=eqns,
            debug_info=info,
        )
        return jex.core.ClosedJaxpr(smaller, closed.consts)
    except (AttributeError, TypeError, ValueError, IndexError, AssertionError):
        return None


# a program's cache key -> the layout it was lowered with (a key lowers to one program; kept
# after `jn.cache_reset()`, for the handles that still hold their programs)
_chosen: dict[Hashable, Layout] = {}


def acquired(get: Callable[[Callable[[], Any]], Any], lower: Callable[[], tuple]) -> Any:
    """`get(traced)`: a program cache's get-or-compile, where `traced()` lowers through
    `lower()` -> (traced, layout); the layout of a program lowered now is recorded under its
    key for `chosen` (one from the cache was recorded when it was built)."""
    made: list[Layout] = []

    def traced() -> Any:
        out, layout = lower()
        made.append(layout)
        return out

    prog = get(traced)
    if made:
        _chosen[prog.key] = made[-1]
    return prog


def chosen(prog: Any) -> Layout:
    """The layout the program `prog` (an `acquired` one, or a copy of it) was lowered with."""
    return _chosen[prog.key]


def reads_inputs(closed: Any, inputs: Iterable[int], ignoring: Iterable[int] = ()) -> bool:
    """Whether the jaxpr's outputs (but those at `ignoring`) or an effect depend on any of
    its `inputs` (positions among its flat inputs). An equation is taken whole: what it reads
    is read where any of its outputs is (a nested jaxpr's unused inputs count as read, which
    only keeps more)."""
    live, _ = _liveness(closed.jaxpr, set(ignoring))
    return any(id(closed.jaxpr.invars[i]) in live for i in inputs)


def _liveness(jaxpr: Any, ignoring: set[int]) -> tuple[set[int], list]:
    """(the ids of the variables the outputs but those at `ignoring`, or an effect, read;
    the equations that compute them, in order): one pass from the end."""
    live = {id(v) for n, v in enumerate(jaxpr.outvars) if n not in ignoring}
    eqns = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(id(v) in live for v in eqn.outvars):
            live.update(id(v) for v in eqn.invars)
            eqns.append(eqn)
    return live, eqns[::-1]
