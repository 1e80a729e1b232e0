"""`steps_per_call="auto"`: measure, at the first train, whether fusing steps pays.

A small model is dispatch-bound: one compiled call per optimizer step costs more in Python and
launch overhead than the step computes, and `steps_per_call=K` (K steps in a `lax.scan` per
call) removes most of it. Where the step itself dominates, or where XLA compiles the scanned
step worse (convolutions on XLA:CPU), fusing does not pay. `pick` times both on a copy of the
state (the handle is untouched; the results are bitwise the same either way) and keeps the
faster, by a margin: K must be at least `MARGIN` faster per step to be chosen. A step long
enough that no call overhead could make up the margin is not fused, and its fused program is
never compiled (a large model pays nothing for "auto").
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from jaxnitro._src.data import feed
from jaxnitro._src.programs.builders import train_layout, train_program

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import RunSpec

#: Fused steps per call tried: the largest divisor of the epoch's steps up to this (a divisor
#: leaves no tail of single steps, which would need a program of its own).
MAX_STEPS = 32
#: K must be this much faster per step than one step per call to be picked.
MARGIN = 0.9
#: A generous bound on what one call costs beyond its step (the driver's Python and the
#: launch): all that fusing can save per step. A step longer than this over (1 - MARGIN)
#: cannot gain the margin, so the fused program is not compiled to find out.
CALL_OVERHEAD_S = 0.5e-3
_REPEATS = 3


@dataclasses.dataclass(frozen=True)
class Choice:
    """What was measured: seconds per optimizer step at 1 and at `candidate` per call."""

    steps: int
    candidate: int
    single_s: float | None
    fused_s: float | None

    def line(self) -> str:
        if self.single_s is not None and self.fused_s is None:
            return (
                f"steps_per_call='auto': 1 (one step per call {self.single_s * 1e3:.3f} ms per "
                f"step: not dispatch-bound, so {self.candidate} per call was not tried)"
            )
        if self.single_s is None or self.fused_s is None:
            return f"steps_per_call='auto': {self.steps} (nothing to compare)"
        return (
            f"steps_per_call='auto': {self.steps} (one step per call {self.single_s * 1e3:.3f} "
            f"ms per step, {self.candidate} per call {self.fused_s * 1e3:.3f} ms per step)"
        )


def candidate(spec: RunSpec) -> int:
    """The K to try: the largest divisor of the epoch's optimizer steps up to `MAX_STEPS`."""
    spe = spec.steps_per_epoch
    if not spe or spe < 2:
        return 1
    return max(d for d in range(1, min(spe, MAX_STEPS) + 1) if spe % d == 0)


def pick(n: Nitro) -> Choice:
    """Time one step per call against `candidate` steps per call on copies of the state."""
    spec = n.spec
    k = candidate(spec)
    if k == 1 or "train" not in spec.splits or spec.population is not None:
        return Choice(1, k, None, None)
    longest = CALL_OVERHEAD_S / (1 - MARGIN) if MARGIN < 1 else float("inf")
    single = _per_step(n, spec, 1, calls=2 * k, give_up=longest)
    if single > longest:  # the step dominates: the fused program is not even compiled
        return Choice(1, k, single, None)
    # A fused call clearly slower than single steps (a loop of convolutions on XLA:CPU) is
    # timed once, not `_REPEATS` times: it costs k steps a call.
    fused = _per_step(
        n, dataclasses.replace(spec, steps_per_call=k), k, calls=1, give_up=2 * single
    )
    steps = k if fused < MARGIN * single else 1
    return Choice(steps, k, single, fused)


def _per_step(
    n: Nitro, spec: RunSpec, steps: int, *, calls: int, give_up: float | None = None
) -> float:
    """Best of `_REPEATS` timings of `calls` calls of the `steps`-per-call program, per step
    (one timed call alone when it is already over `give_up` per step: a long step is not
    timed for longer than it takes to see that)."""
    loader = spec.splits["train"]
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(n.epoch)
    unit = feed.first_unit(spec, loader)
    (batch, hyper, got), *_ = feed.train_prepare(spec, n.step, n.device.hyper_base)(unit)[0]
    prog = train_program(spec, n.programs, n.train_state, batch, n.device.extras, hyper, got)
    leaves = [jnp.copy(x) for x in n.state_leaves]  # the handle's buffers are never donated
    layout = train_layout(prog)
    leaves, kept = layout.split(leaves)
    kept = layout.taken(kept)  # (what the program takes of them)
    t0 = time.perf_counter()
    leaves, out = prog.compiled(leaves, kept, batch, n.device.extras, hyper)  # warm up
    jax.block_until_ready(out)
    first = (time.perf_counter() - t0) / got
    if give_up is not None and first > give_up:
        t0 = time.perf_counter()  # the first call may carry one-off costs: time a second
        leaves, out = prog.compiled(leaves, kept, batch, n.device.extras, hyper)
        jax.block_until_ready(out)
        first = (time.perf_counter() - t0) / got
        if first > give_up:
            return first
    best = float("inf")
    for _ in range(_REPEATS):
        t0 = time.perf_counter()
        for _ in range(calls):
            leaves, out = prog.compiled(leaves, kept, batch, n.device.extras, hyper)
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - t0) / (calls * got))
    return best
