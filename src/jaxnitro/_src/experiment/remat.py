"""Activation rematerialisation per block: `jn.Nitro(exp, remat=["Block"], remat_policy=...)`.

Recomputing a block's activations in the backward pass instead of storing them trades compute
for memory. It helps per block (a transformer layer, a residual stage); wrapping the whole
loss would recompute everything. The named block classes are found in the model at setup;
while the train program is traced, their `__call__` runs under `nnx.remat` (Flax NNX) or
`eqx.filter_checkpoint` (Equinox) with the chosen policy. Evaluation and prediction are never
rematerialised (they have no backward pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jaxnitro._src.core.errors import ConfigError, did_you_mean

POLICIES = {
    "full": None,  # save nothing inside the block: recompute all of it
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
}


@dataclasses.dataclass(frozen=True)
class RematPlan:
    """The block classes to rematerialise and the policy (a name from `POLICIES`).

    Example:
        >>> n = jn.Nitro(MyGPT(), remat=["Block"], remat_policy="dots_saveable")
        >>> n.spec.remat.classes
        (<class 'gpt.Block'>,)
    """

    classes: tuple[type, ...]
    policy: str
    kind: str  # "nnx" or "equinox"

    def key(self) -> tuple:
        return (tuple(f"{c.__module__}.{c.__qualname__}" for c in self.classes), self.policy)


def check(blocks, policy: str) -> tuple[tuple[str, ...], str]:
    """The `remat=` and `remat_policy=` options, validated."""
    if policy not in POLICIES:
        raise ConfigError(
            f"remat_policy={policy!r}; use one of {sorted(POLICIES)} ('full' recomputes the "
            f"whole block, 'dots_saveable' keeps the matmul outputs)."
            + did_you_mean(str(policy), POLICIES)
        )
    if blocks is None:
        return (), policy
    if isinstance(blocks, str) or not isinstance(blocks, Sequence) or not blocks:
        raise ConfigError(
            f"remat={blocks!r}; name the block classes to rematerialise as a list, e.g. "
            f"remat=['Block']."
        )
    if not all(isinstance(b, str) for b in blocks):
        raise ConfigError(f"remat={blocks!r}: give class names (str), e.g. remat=['Block'].")
    return tuple(blocks), policy


def plan(names: tuple[str, ...], policy: str, model, params, state) -> RematPlan | None:
    """Find the named block classes in the model (an error lists the classes it has)."""
    if not names:
        return None
    kind, found = _module_classes(model, params, state)
    by_name = {c.__name__: c for c in found}
    missing = [name for name in names if name not in by_name]
    if missing:
        raise ConfigError(
            f"remat names {missing}, which the model does not contain; its module classes are "
            f"{sorted(by_name)}." + did_you_mean(missing[0], by_name)
        )
    return RematPlan(tuple(by_name[name] for name in names), policy, kind)


def _module_classes(model, params, state) -> tuple[str, list[type]]:
    from jaxnitro._src.experiment import models

    if isinstance(model, models.NNXModel):
        from flax import nnx

        module = nnx.merge(model.graphdef, params, state, copy=True)
        found = {type(node) for _, node in nnx.iter_graph(module) if isinstance(node, nnx.Module)}
        return "nnx", sorted(found, key=lambda c: c.__name__)
    eqx = models._module("equinox")
    if eqx is not None and isinstance(model, models.EqxModel):
        whole = eqx.combine(params, model.static)
        nodes = jax.tree.leaves(whole, is_leaf=lambda x: isinstance(x, eqx.Module))
        found = set()
        stack = [whole, *nodes]
        while stack:
            node = stack.pop()
            if isinstance(node, eqx.Module) and type(node) not in found:
                found.add(type(node))
                stack += [v for v in vars(node).values() if isinstance(v, (eqx.Module, list))]
            elif isinstance(node, list):
                stack += node
        return "equinox", sorted(found, key=lambda c: c.__name__)
    raise ConfigError(
        f"remat= works on Flax NNX and Equinox models; for a {type(model).__name__}, wrap the "
        f"block in the model itself (flax.linen: nn.remat(Block); a function: jax.checkpoint)."
    )


@contextlib.contextmanager
def applied(remat: RematPlan | None) -> Iterator[None]:
    """While tracing: each named block's `__call__` runs rematerialised."""
    if remat is None:
        yield
        return
    policy = POLICIES[remat.policy]
    saved: list[tuple[type, Any]] = []
    try:
        for cls in remat.classes:
            original = vars(cls).get("__call__", cls.__call__)
            saved.append((cls, vars(cls).get("__call__")))
            type.__setattr__(cls, "__call__", _wrap(remat.kind, original, policy))
        yield
    finally:
        for cls, original in reversed(saved):
            if original is None:
                type.__delattr__(cls, "__call__")
            else:
                type.__setattr__(cls, "__call__", original)


def _wrap(kind: str, fn, policy):
    if kind == "nnx":
        from flax import nnx

        return nnx.remat(fn, policy=policy)
    import equinox as eqx

    return eqx.filter_checkpoint(fn, policy=policy)
