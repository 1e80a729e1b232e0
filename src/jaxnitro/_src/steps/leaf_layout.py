"""How `jn.train_step`'s program takes a `TrainState`'s leaves: which it donates and returns,
and which it keeps.

On a CPU, every leaf a call donates and returns costs ~1.5 µs (its donation, a new output
array), which a small model's step feels. Two leaves need not travel:

- the RNG never changes in a train step (each step's key is folded in from it and the step
  counter): it goes in, kept, and is not returned;
- the step counter is needed on the device only to fold the key; where the traced step never
  reads its key (an NNX model draws dropout from its own `Rngs`; a model without dropout), it
  is kept too and the host counts the steps (`Layout.uncounted`), adding them when the state is
  read.

Which applies is decided from the trace: the step is traced with both kept, and where the
program reads either, traced again with the counter on the device. The decision is the
program's own (its inputs say it: `of_compiled`), so a cached program is called as it was
built.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from jaxnitro._src.core.types import Batch


@dataclasses.dataclass(frozen=True)
class Layout:
    """The positions among a state's leaves of those a program keeps (`fixed_at`), of the
    step counter (`step_at`), and how many steps a call adds that the program does not
    count (`uncounted`: 1 where the counter is kept and the host counts)."""

    fixed_at: tuple[int, ...]
    step_at: int
    uncounted: int = 0

    def split(self, leaves: list) -> tuple[list, list]:
        """A state's leaves -> (those the program donates and returns, those it keeps)."""
        at = self.fixed_at
        return [x for i, x in enumerate(leaves) if i not in at], [leaves[i] for i in at]

    def merge(self, moving: list, fixed: list) -> list:
        """`split`'s two lists -> the state's leaves, in order."""
        leaves = list(moving)
        for i, x in zip(self.fixed_at, fixed, strict=True):
            leaves.insert(i, x)
        return leaves

    def flat(self, step_fn: Callable[..., Any], treedef: Any, passed: tuple[int, ...]) -> Any:
        """`step_fn` on a state as (changed leaves, kept leaves, batch) -> (the new changed
        leaves, outputs); `passed`: the kept leaves the step must pass through unchanged."""

        def flat_step(moving: list, fixed: list, batch: Batch) -> tuple[list, Any]:
            leaves = self.merge(moving, fixed)
            new, out = step_fn(jax.tree.unflatten(treedef, leaves), batch, {}, {})
            new_leaves = jax.tree.leaves(new)
            if any(new_leaves[i] is not leaves[i] for i in passed):
                raise AssertionError("a train step changed its RNG, which it passes through")
            return [x for i, x in enumerate(new_leaves) if i not in self.fixed_at], out

        return flat_step


def positions(state: Any) -> tuple[int, tuple[int, ...]]:
    """(the step counter's position, the RNG's positions) among the leaves of `state`."""
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
    names = [getattr(path[0], "name", "") for path in paths]
    return names.index("step"), tuple(i for i, name in enumerate(names) if name == "rng")


def lower(
    step_fn: Callable[..., Any],
    state: Any,
    leaves: list,
    batch: Batch,
    *,
    host_counts: bool,
) -> jax.stages.Lowered:
    """The lowered program: with the step counter and the RNG kept where the trace reads
    neither (and `host_counts` allows it), else with the RNG alone kept."""
    treedef = jax.tree.structure(state)
    step_at, rng_at = positions(state)
    if host_counts:
        kept = Layout(tuple(sorted((step_at, *rng_at))), step_at, 1)
        moving, fixed = kept.split(leaves)
        traced = jax.jit(kept.flat(step_fn, treedef, rng_at), donate_argnums=(0,)).trace(
            moving, fixed, batch
        )
        first = len(jax.tree.leaves(moving))
        if not reads_inputs(traced.jaxpr, range(first, first + len(fixed))):
            return traced.lower()
    counted = Layout(rng_at, step_at)
    moving, fixed = counted.split(leaves)
    fn = counted.flat(step_fn, treedef, rng_at)
    return jax.jit(fn, donate_argnums=(0,)).lower(moving, fixed, batch)


def of_compiled(compiled: Any, state: Any) -> Layout:
    """The layout `lower` chose for `compiled`, from the number of leaves it keeps."""
    step_at, rng_at = positions(state)
    kept = len(jax.tree.leaves(compiled.args_info[0][1]))
    if kept == len(rng_at) + 1:
        return Layout(tuple(sorted((step_at, *rng_at))), step_at, 1)
    return Layout(rng_at, step_at)


def reads_inputs(closed: Any, inputs: Iterable[int]) -> bool:
    """Whether the jaxpr's outputs (or an effect) depend on any of its `inputs` (positions
    among its flat inputs). An equation is taken whole: what it reads is read where any of
    its outputs is (a nested jaxpr's unused inputs count as read, which only keeps more)."""
    jaxpr = closed.jaxpr
    live = {id(v) for v in jaxpr.outvars}
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(id(v) in live for v in eqn.outvars):
            live.update(id(v) for v in eqn.invars)
    return any(id(jaxpr.invars[i]) in live for i in inputs)
