"""The compiled programs of a `Nitro`: traced functions built from its hooks, and their keys.

Traced hooks run against the compile view (GraphConst values, Device tracers, Host refused);
the functions built here close over the model structure and the optimizer, which the key
covers, so a cached program is correct for every `Nitro` that produces the same key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect as pyinspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp

from . import metrics as metrics_mod
from . import models, optim
from .compile import cache, explain
from .compile.fingerprint import fingerprint
from .devices import mesh_id
from .errors import HookError, JaxnitroError
from .experiment import GRAPH, CompileView, field_values, graph_key
from .phases import set_phase
from .step import loss_parts, make_eval_step, make_train_step, scalar_loss, slice_rows

_TRACED_HOOKS = ("forward", "loss", "metrics", "train_metrics")
# The hooks each kind of program traces: a program's key holds their fingerprints only, so
# editing `metrics` never invalidates the train program.
_KIND_HOOKS = {
    "train": ("forward", "loss", "train_metrics"),
    "eval": ("forward", "loss", "metrics"),
    "predict": ("forward",),
}


def _forward(n, device, params, model_state, batch):
    try:
        out = n.cls.forward(
            CompileView(n.experiment, device, "forward"),
            n.model,
            params,
            model_state,
            **n.routes["forward"].select(batch),
        )
    except Exception as e:
        if not isinstance(e, JaxnitroError):  # the model's own error: say where it happened
            shapes = {k: f"{tuple(v.shape)} {v.dtype}" for k, v in batch.items()}
            e.add_note(f"jaxnitro: raised in {n.cls.__name__}.forward on a batch {shapes}")
        raise
    if not (isinstance(out, tuple) and len(out) == 2):
        raise HookError(
            f"{n.cls.__name__}.forward must return (outputs, new_state), got "
            f"{type(out).__name__}. Return what jn.apply returns: "
            f"`return jn.apply(model, params, state, x)`."
        )
    return out


def _cast_floats(tree, dtype):
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, tree
    )


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
        loss = n.cls.loss(
            CompileView(n.experiment, device, "loss"), outputs, **n.routes["loss"].select(batch)
        )
        aux = {}
        if "train_metrics" in n.routes:
            got = n.cls.train_metrics(
                CompileView(n.experiment, device, "train_metrics"),
                outputs,
                **n.routes["train_metrics"].select(batch),
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
        if has_loss:
            # Exact over the split: a scalar mean is weighted by the batch's rows, a
            # (sum, count) loss by its count, so the total divides once to sum / count.
            raw = n.cls.loss(
                CompileView(n.experiment, device, "loss"), outputs, **n.routes["loss"].select(batch)
            )
            if isinstance(raw, (tuple, list)) and len(raw) == 2:
                total, count = loss_parts(raw)
                totals["val_loss"] = (total, count.astype(jnp.float32))
            else:
                loss = scalar_loss(raw)
                totals["val_loss"] = (loss * rows, jnp.asarray(rows, jnp.int32))
        if "metrics" in n.routes:
            got = n.cls.metrics(
                CompileView(n.experiment, device, "metrics"),
                outputs,
                **n.routes["metrics"].select(batch),
            )
            totals.update(metrics_mod.normalize(got))
        return totals

    return metrics_fn


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


@dataclasses.dataclass
class ProgramSet:
    """A handle's compiled programs and what they were compiled from.

    Attributes:
        prints: (name, fingerprint) of every traced function when the handle first compiled
            (an entry point compares against it to find edited code).
        used: (kind, label) -> the program this handle last used for it.
        compiled: the programs this handle compiled (not cache hits), in order.
        train: (kind, steps per call) -> the train program of the current entry point.
        slots: the planned program slots already filled (a second compile of one warns).
    """

    prints: tuple | None = None
    used: dict = dataclasses.field(default_factory=dict)
    compiled: list = dataclasses.field(default_factory=list)
    train: dict = dataclasses.field(default_factory=dict)
    slots: set = dataclasses.field(default_factory=set)

    def reset_train(self) -> None:
        """Drop the handle's train-program map (re-fetched from the cache, keyed anew)."""
        self.train = {}


def traced_functions(n, hooks: tuple[str, ...] = _TRACED_HOOKS) -> dict[str, Any]:
    """The traced `hooks`, plus the experiment's methods and properties they reach via `self`.

    `self.helper(...)` is an attribute load, invisible to a function fingerprint; following
    the names the code loads (three levels) puts an edited helper method into the key.
    """
    out: dict[str, Any] = {}
    frontier = [h for h in hooks if h in n.routes]
    fields = n.cls.__jn_fields__
    for _ in range(3):
        nxt = []
        for name in frontier:
            if name in out or name in fields or name.startswith("__"):
                continue
            attr = pyinspect.getattr_static(n.cls, name, None)
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if not pyinspect.isfunction(fn):
                continue
            out[name] = fn
            nxt += sorted(_code_names(fn.__code__))
        frontier = nxt
    return out


def hook_prints(n, kind: str | None = None) -> tuple:
    """(name, fingerprint) of every function a `kind` of program traces (all kinds: None);
    part of that program's key."""
    hooks = _TRACED_HOOKS if kind is None else _KIND_HOOKS[kind]
    return tuple(sorted((name, fingerprint(fn)) for name, fn in traced_functions(n, hooks).items()))


def _base_key(n, kind: str) -> tuple:
    prints = hook_prints(n, kind)
    if n.program_set.prints is None:
        n.program_set.prints = hook_prints(n)
    return (
        kind,
        n.cls.__module__,
        n.cls.__qualname__,
        graph_key(n.experiment),
        cache.freeze(models.structure_key(n.model)),
        prints,
        tuple(sorted((k, r.required, r.optional, r.takes_all) for k, r in n.routes.items())),
        mesh_id(n.mesh),
        tuple(sorted(n.compile_options.items())),
    )


def _parts(
    n, kind: str, split: str | None, named_inputs: dict, options: dict, optimizer=None
) -> explain.KeyParts:
    hooks, helpers = explain.hook_parts(traced_functions(n, _KIND_HOOKS[kind]))
    rows = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(named_inputs)[0]:
        rows.append((jax.tree_util.keystr(path), *cache.input_spec(leaf)))
    return explain.KeyParts(
        kind=kind,
        experiment=n.cls.__qualname__,
        graph_consts=tuple(field_values(n.experiment, GRAPH).items()),
        model=cache.freeze(models.structure_key(n.model)),
        optimizer=optimizer,
        hooks=hooks,
        helpers=helpers,
        inputs=tuple(rows),
        split=split,
        options=tuple(
            sorted(
                {
                    **options,
                    "mesh": mesh_id(n.mesh),
                    **{f"compile option {k}": v for k, v in n.compile_options.items()},
                }.items()
            )
        ),
    )


def check_stale(n) -> None:
    """At an entry point: if a traced hook or helper was edited since this Nitro compiled,
    drop the programs built from the old code and say so once, naming what changed."""
    ps = n.program_set
    old = ps.prints
    if old is None:
        return
    new = hook_prints(n)
    if new == old:
        return
    was, now = dict(old), dict(new)
    edited = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    # Only the programs that trace the edited code: the others stay valid and cached.
    stale = [p for p in ps.used.values() if any(now.get(name) != digest for name, digest in p.deps)]
    kinds = sorted({p.kind for p in stale})
    dropped = cache.drop(
        lambda p: (
            p.key[1:3] == (n.cls.__module__, n.cls.__qualname__)  # type: ignore[index]
            and any(now.get(name) != digest for name, digest in p.deps)
        )
    )
    ps.reset_train()
    ps.prints = new
    ps.slots = set()  # the recompiles that follow are explained here, not again
    which = f" (the {' and '.join(kinds)} program{'s' * (len(kinds) > 1)})" if kinds else ""
    warnings.warn(
        f"{n.cls.__name__}: {', '.join(f'`{e}`' for e in edited)} changed since this Nitro "
        f"compiled its programs; {dropped} stale program(s) dropped{which}, they will be "
        f"recompiled; programs that do not call it are kept.",
        stacklevel=3,
    )


def _on_compile(n):
    """Publish the Compiling phase (and show it) while XLA compiles; restore the phase after."""

    @contextlib.contextmanager
    def compiling(kind, label):
        previous = n.phase
        set_phase(n, "Compiling", info={"program": kind, "label": label})
        try:
            with n.display.compiling(kind, label):
                yield
        finally:
            if previous in ("Training", "Evaluating"):  # a compile mid-run returns to it
                set_phase(n, previous)

    return compiling


def _acquire(
    n, key, lower, *, kind: str, label: str, parts, hooks, bucket: int | None = None
) -> cache.Program:
    """get_or_compile, plus this run's bookkeeping: reports, logs, recompile warnings."""
    before = cache.cache_stats()["misses"]
    prog = cache.get_or_compile(
        key,
        lower,
        kind=kind,
        label=label,
        devices=mesh_id(n.mesh),
        parts=parts,
        hooks=hooks,
        compile_options=n.compile_options,
        on_compile=_on_compile(n),
        deps=hook_prints(n, kind),
    )
    ps = n.program_set
    used = ps.used
    compiled_here = cache.cache_stats()["misses"] > before
    # A planned variant (the ragged last eval batch, a tail of single steps) is its own slot.
    slot = (
        kind,
        parts.split,
        dict(parts.options).get("rows"),
        dict(parts.options).get("steps_per_call"),
        bucket,
    )
    slots = ps.slots
    if compiled_here:
        ps.compiled.append(prog)
        rec = prog.record
        n.services.log_other(
            {
                "compile": {
                    "kind": kind,
                    "label": label,
                    "trace_s": rec.trace_seconds,
                    "lower_s": rec.lower_seconds,
                    "compile_s": rec.compile_seconds,
                    "hlo_ops": rec.hlo_ops,
                    "stablehlo_ops": rec.stablehlo_ops,
                    "text_bytes": rec.text_bytes,
                    "constant_bytes": rec.constant_bytes,
                    "flops": rec.flops,
                    "memory": rec.memory,
                    "reasons": list(prog.reasons),
                    "flags": [f.message for f in rec.flags],
                }
            }
        )
        for flag in rec.flags:
            warnings.warn(flag.message, stacklevel=4)
        if slot in slots:
            why = "; ".join(prog.reasons) or "a new input signature"
            warnings.warn(f"recompiling the {kind} program ({label}): {why}", stacklevel=4)
    slots.add(slot)
    used[(kind, label)] = prog
    return prog


def train_program(n, batch, hyper, steps_per_call: int) -> cache.Program:
    """The fused train step for these shapes (compiled once per process)."""
    extras = n.extras()
    key = (
        *_base_key(n, "train"),
        n.accum,
        steps_per_call,
        n.precision,
        n.on_nonfinite,
        n.log_grad_norm,
        cache.optimizer_key(n.tx),
        cache.avals((n.carry, batch, extras, hyper)),
    )
    step = make_train_step(
        train_loss_fn(n),
        n.tx,
        accum=n.accum,
        steps_per_call=steps_per_call,
        write_hyper=functools.partial(optim.write_hyper, n.optimizer),
        unpack_hyper=n.unpack_hyper,
        skip_nonfinite=n.on_nonfinite == "skip",
        grad_norm=n.log_grad_norm,
    )
    parts = _parts(
        n,
        "train",
        "train",
        {"batch": batch, "extras": extras["device"]},
        {
            "accum": n.accum,
            "steps_per_call": steps_per_call,
            "precision": n.precision,
            "log_grad_norm": n.log_grad_norm,
        },
        optimizer=(optim.describe(n.optimizer), cache.optimizer_key(n.tx)),
    )
    label = n.cls.__name__ + (f", {steps_per_call} steps per call" if steps_per_call > 1 else "")
    carry_def = n._carry_def

    def flat_step(leaves, batch, extras, hyper):  # the carry travels as a flat list
        carry, out = step(jax.tree.unflatten(carry_def, leaves), batch, extras, hyper)
        return jax.tree.leaves(carry), out

    return _acquire(
        n,
        key,
        lambda: jax.jit(flat_step, donate_argnums=(0,), out_shardings=n._rep).trace(
            n._leaves, batch, extras, hyper
        ),
        kind="train",
        label=label,
        parts=parts,
        hooks=tuple(h for h in ("forward", "loss", "train_metrics") if h in n.routes),
    )


def eval_metric_shapes(n, split: str) -> dict:
    """Abstract {name: (sum, count)} of the eval step on the split's first batch."""
    info = n.batch_info[split]
    first = info["first"]
    batch = {
        k: jax.ShapeDtypeStruct(first[k].shape, jnp.asarray(first[k][:1]).dtype)
        for k in info["fields"]
    }
    fn = eval_metrics_fn(n, split)
    return jax.eval_shape(
        lambda p, s, b, e: fn(p, s, b, e, None),
        n.carry.params,
        n.carry.model_state,
        batch,
        n.extras(),
    )


def eval_program(n, split: str, batch, totals, n_valid: int | None) -> cache.Program:
    """Forward + metrics added into running totals; one program per ragged width."""
    extras = n.extras()
    key = (
        *_base_key(n, "eval"),
        split == "train",
        n.batch_info[split]["has_loss"],
        n_valid,
        cache.avals((n.carry.params, n.carry.model_state, batch, extras, totals)),
    )
    step = make_eval_step(eval_metrics_fn(n, split), n_valid)
    args = (n.carry.params, n.carry.model_state, batch, extras, totals)
    label = split if n_valid is None else f"{split}, last batch of {n_valid}"
    parts = _parts(
        n, "eval", split, {"batch": batch, "extras": extras["device"]}, {"rows": n_valid}
    )
    return _acquire(
        n,
        key,
        lambda: jax.jit(step, donate_argnums=(4,), out_shardings=n._rep).trace(*args),
        kind="eval",
        label=label,
        parts=parts,
        hooks=tuple(h for h in ("forward", "loss", "metrics") if h in n.routes),
    )


def predict_program(n, batch, n_valid: int | None) -> cache.Program:
    """Forward in inference mode; outputs sliced back to the real rows."""
    extras = n.extras()

    def predict_step(params, model_state, batch, extras):
        device = extras["device"]
        size = next(iter(batch.values())).shape[0]
        with models.mode(train=False):
            outputs, _ = _forward(n, device, params, model_state, batch)
        return slice_rows(outputs, n_valid, size)

    key = (
        *_base_key(n, "predict"),
        n_valid,
        cache.avals((n.carry.params, n.carry.model_state, batch, extras)),
    )
    args = (n.carry.params, n.carry.model_state, batch, extras)
    parts = _parts(
        n,
        "predict",
        None,
        {"batch": batch, "extras": extras["device"]},
        {"rows": n_valid},
    )
    # Each padded size (a bucket) is a planned program of its own, not a recompile.
    bucket = next(iter(batch.values())).shape[0]
    return _acquire(
        n,
        key,
        lambda: jax.jit(predict_step).trace(*args),
        kind="predict",
        label=n.cls.__name__,
        parts=parts,
        hooks=("forward",),
        bucket=bucket,
    )


def planned(n, *, train: bool = True) -> dict[str, cache.Program]:
    """Compile (or fetch) every program the run will use, from the first batches' shapes.

    The train step for the first dispatch unit, single steps for an epoch's tail that does not
    fill `steps_per_call`, and the eval step for 'val' (plus its ragged last batch).
    """
    from . import feed  # the feed builds payloads exactly as training will

    out: dict[str, cache.Program] = {}
    if train and "train" in n.splits:
        loader = n.splits["train"]
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(n.epoch)
        stacked, k = feed.first_unit(n, loader)
        prepare = feed.train_prepare(n, n.epoch)
        (batch, hyper, steps), *_ = prepare((stacked, k))[0]
        out["train"] = train_program(n, batch, hyper, steps)
        spe = n.steps_per_epoch
        if steps > 1 and spe and spe % steps:
            one = {f: a[: n.accum] for f, a in stacked.items()}
            (single,) = prepare((one, n.accum))[0]
            out["train (single steps)"] = train_program(n, single[0], single[1], 1)
    if "val" in n.splits:
        bs = n.batch_info["val"]["batch_size"]
        dev, _ = feed.eval_prepare(n, "val", bs)(n.batch_info["val"]["first"])
        totals = jax.device_put(metrics_mod.zeros_like_totals(eval_metric_shapes(n, "val")), n._rep)
        out["eval"] = eval_program(n, "val", dev, totals, None)
        loader = n.splits["val"]
        if getattr(loader, "ragged", False):
            rows = loader.num_samples % loader.batch_size
            out["eval (last batch)"] = eval_program(n, "val", dev, totals, rows)
    return out


def plan_notes(n, *, train: bool = True) -> list[str]:
    """Every program the run will compile, and why: one line each (nothing compiles here).

    The extra programs are the ones a user can avoid: a tail of single steps when
    `steps_per_call` does not divide the steps of an epoch, and the ragged last val batch.
    """
    notes = []
    spe, spc = n.steps_per_epoch, n.steps_per_call
    if train and "train" in n.splits:
        notes.append(
            f"train: {spc} optimizer steps per call"
            if spc > 1
            else "train: one optimizer step per call"
        )
        if spc > 1 and spe and spe % spc:
            divisors = [d for d in range(2, spe + 1) if spe % d == 0][:4]
            notes.append(
                f"train (single steps): {spe} steps per epoch leave a tail of {spe % spc} that "
                f"does not fill steps_per_call={spc}; it runs as single steps, a second train "
                f"program. A steps_per_call dividing {spe}"
                + (f" (e.g. {', '.join(map(str, divisors))})" if divisors else "")
                + " avoids it."
            )
    if "val" in n.splits:
        notes.append("eval: the 'val' split")
        loader = n.splits["val"]
        if getattr(loader, "ragged", False):
            rows = loader.num_samples % loader.batch_size
            notes.append(
                f"eval (last batch): the 'val' split's {loader.num_samples} samples leave a last "
                f"batch of {rows} (batch_size {loader.batch_size}), padded in a program of its "
                f"own; a batch size dividing {loader.num_samples} avoids it."
            )
    return notes
