"""A run's program bookkeeping: the `ProgramSet`, the `ProgramKey` of one program
(`program_key`) and `_acquire`, which fetches or compiles it and reports, logs and warns.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Any

import jax

from jaxnitro._src.compile import cache, context, explain
from jaxnitro._src.compile.fingerprint import (
    fingerprint_value,
)
from jaxnitro._src.core.errors import warn_user
from jaxnitro._src.dist.devices import mesh_id
from jaxnitro._src.experiment import models
from jaxnitro._src.experiment.markers import GRAPH, field_values
from jaxnitro._src.programs.traced import (
    _KIND_HOOKS,
    _traced_parts,
    hook_prints,
    traced_code,
)

if TYPE_CHECKING:
    from jaxnitro._src.programs.spec import ProgramSpec
    from jaxnitro._src.steps.state import TrainState


def _no_compile_context(kind: str, label: str) -> contextlib.AbstractContextManager[Any]:
    return contextlib.nullcontext()


@dataclasses.dataclass
class ProgramSet:
    """A run's compiled programs and what they were compiled from.

    Attributes:
        log: called with each compile's `other` log line (the run's logger, when writing).
        on_compile: `on_compile(kind, label)` -> a context manager around each XLA compile
            (the run's phase and progress display).
        prints: (name, fingerprint) of every traced function when the run first compiled
            (an entry point compares against it to find edited code).
        used: (kind, label) -> the program this run last used for it.
        compiled: the programs this run compiled (not cache hits), in order.
        train: (kind, steps per call) -> the train program of the current entry point.
        slots: the planned program slots already filled (a second compile of one warns).
        rebound: the classes of this run already named as re-defined (said once each).
        verified: the keys whose cached programs this entry-point call already checked
            against a trace of the current code (cleared at each entry point).
        parts: (hooks, helpers) of `explain.hook_parts` for `prints` (naming an edit).
    """

    log: Callable[[dict], Any] = lambda values: None
    on_compile: Callable[[str, str], Any] = _no_compile_context
    prints: tuple | None = None
    used: dict = dataclasses.field(default_factory=dict)
    compiled: list = dataclasses.field(default_factory=list)
    train: dict = dataclasses.field(default_factory=dict)
    slots: set = dataclasses.field(default_factory=set)
    rebound: set = dataclasses.field(default_factory=set)
    verified: set = dataclasses.field(default_factory=set)
    parts: tuple | None = None

    def reset_train(self) -> None:
        """Drop the run's train-program map (re-fetched from the cache, keyed anew)."""
        self.train = {}


def _state_arrays(ts: TrainState) -> tuple:
    """The arrays of a TrainState (its model and optimizer are in the key by structure)."""
    return (ts.params, ts.state, ts.opt_state, ts.step, ts.rng, ts.ema)


def program_key(
    spec: ProgramSpec,
    ps: ProgramSet,
    kind: str,
    split: str | None,
    inputs: dict,
    options: dict,
    *,
    avals: tuple,
    optimizer: Hashable = None,
) -> explain.ProgramKey:
    """The key of one program: every part that changes its graph, named for explanations."""
    if ps.prints is None:
        ps.prints = hook_prints(spec)
        ps.parts = explain.hook_parts(traced_code(spec))
    rows = tuple(
        (jax.tree_util.keystr(path), *cache.input_spec(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(inputs)[0]
    )
    graph = field_values(spec.experiment, GRAPH)
    gaps: list[str] = []  # what the key cannot prove unchanged (then a trace checks it)
    deps, hooks, helpers = _traced_parts(spec, kind, gaps)
    return explain.ProgramKey(
        kind=kind,
        experiment=spec.cls.__qualname__,
        # by content: a config's methods, a function's code and globals (not `==`, which
        # ignores a dataclass's methods and compares functions by identity); a digest, so a
        # value mutated in place later cannot change a stored key's hash
        graph_consts=tuple(
            (k, fingerprint_value(v, strict=False, gaps=gaps)) for k, v in graph.items()
        ),
        graph_shown=tuple((k, explain.shown(v)) for k, v in graph.items()),
        model=cache.freeze(models.structure_key(spec.model)),
        optimizer=optimizer,
        hooks=hooks,
        helpers=helpers,
        inputs=rows,
        split=split,
        options=tuple(
            sorted(
                {
                    **options,
                    "mesh": mesh_id(spec.mesh),
                    **{f"compile option {k}": v for k, v in spec.compile_options.items()},
                    **{f"{explain.JAX_FLAG}{k}": v for k, v in context.jax_flags()},
                    explain.ENVIRONMENT: context.environment(),
                }.items()
            )
        ),
        module=spec.cls.__module__,
        graph_types=tuple((k, type(v).__name__) for k, v in graph.items()),
        routes=tuple(
            sorted((k, r.required, r.optional, r.takes_all) for k, r in spec.routes.items())
        ),
        deps=deps,
        gaps=tuple(gaps),
        avals=avals,
    )


def _acquire(
    spec: ProgramSpec,
    ps: ProgramSet,
    key: explain.ProgramKey,
    lower: Any,
    *,
    label: str,
    bucket: int | None = None,
) -> cache.Program:
    """get_or_compile, plus this run's bookkeeping: reports, logs, recompile warnings."""
    kind = key.kind
    before = cache.cache_stats()["misses"]
    # The fast path: a closed key (its fingerprints cover everything the trace reads) that a
    # trace already proved runs its program; any other is checked against a trace of the
    # current code once per entry-point call: what a fingerprint cannot see, the text can.
    closed = not key.gaps
    verify = not (closed and cache.proven(key)) and key not in ps.verified
    prog = cache.get_or_compile(
        key,
        lower,
        kind=kind,
        label=label,
        devices=mesh_id(spec.mesh),
        hooks=tuple(h for h in _KIND_HOOKS[kind] if h in spec.routes),
        compile_options=dict(spec.compile_options),
        on_compile=ps.on_compile,
        verify=verify,
        closed=closed,
    )
    ps.verified.add(key)
    # A planned variant (the ragged last eval batch, a tail of single steps) is its own slot.
    slot = (kind, key.split, key.option("rows"), key.option("steps_per_call"), bucket)
    if cache.cache_stats()["misses"] > before:
        ps.compiled.append(prog)
        ps.log({"compile": _compile_line(prog)})
        for flag in prog.record.flags:
            warn_user(flag.message)
        if slot in ps.slots:
            why = "; ".join(prog.reasons) or "a new input signature"
            warn_user(f"recompiling the {kind} program ({label}): {why}")
    ps.slots.add(slot)
    ps.used[(kind, label)] = prog
    return prog


def _compile_line(prog: cache.Program) -> dict:
    rec = prog.record
    return {
        "kind": prog.kind,
        "label": prog.label,
        "trace_s": rec.trace_seconds,
        "lower_s": rec.lower_seconds,
        "compile_s": rec.compile_seconds,
        "loaded_from_persistent_cache": rec.loaded,
        "hlo_ops": rec.hlo_ops,
        "stablehlo_ops": rec.stablehlo_ops,
        "text_bytes": rec.text_bytes,
        "constant_bytes": rec.constant_bytes,
        "flops": rec.flops,
        "memory": rec.memory,
        "reasons": list(prog.reasons),
        "flags": [f.message for f in rec.flags],
    }
