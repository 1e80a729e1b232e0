"""The exported program of a run: `forward` in inference mode over flat dicts of arrays.

`jax.export` serializes functions of arrays, not framework objects (an `nnx.State` or an
Equinox module has no serialization), and weights a function closes over are baked in as
constants. So the program takes two flat dicts, ``weights`` (one array per parameter and
model-state leaf, keyed by path) and ``inputs`` (the wire tensors), rebuilds the pytrees from
a treedef captured here, and runs ``export_preprocess → forward → export_postprocess`` with
Device values frozen at their current values and `models.mode(train=False)` (BatchNorm
running statistics, no dropout). The batch dimension is symbolic: one program, any size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import export

from jaxnitro._src.core.errors import ExportError, JaxnitroError
from jaxnitro._src.experiment import models
from jaxnitro._src.experiment.markers import CompileView
from jaxnitro._src.export.format import BATCH, TensorSpec
from jaxnitro._src.export.weights import Weights
from jaxnitro._src.programs.calls import _forward

if TYPE_CHECKING:
    from jaxnitro._src.run.nitro import Nitro

#: Primitives that call back into Python, with the call a user writes.
_CALLBACKS = {
    "debug_print": "jax.debug.print",
    "debug_callback": "jax.debug.callback",
    "pure_callback": "jax.pure_callback",
    "io_callback": "jax.experimental.io_callback",
}
_HOOKS = "forward, export_preprocess, export_postprocess"


# -- the wire inputs -------------------------------------------------------------------------
def wire_inputs(n: Nitro) -> dict[str, TensorSpec]:
    """`export_inputs()` if the experiment has it, else the fields `forward` takes, with the
    dtypes and per-example shapes of the first train batch."""
    spec = n.spec
    if callable(getattr(spec.cls, "export_inputs", None)):
        got = n.experiment.export_inputs()
        where = f"{spec.cls.__name__}.export_inputs()"
        if not isinstance(got, Mapping) or not got:
            raise ExportError(
                f"{where} must return a non-empty dict name -> jn.TensorSpec(dtype, shape), "
                f"got {type(got).__name__}; e.g. {{'img': jn.TensorSpec('uint8', (28, 28))}}."
            )
        for name, ts in got.items():
            if not isinstance(name, str) or not name or not isinstance(ts, TensorSpec):
                raise ExportError(
                    f"{where}: entry {name!r}: {ts!r} is not a jn.TensorSpec; each input is "
                    f"jn.TensorSpec(dtype, per-example shape), e.g. jn.TensorSpec('float32', "
                    f"(8,))."
                )
        specs = dict(got)
    else:
        first = spec.split_specs["train"].first
        specs = {}
        for name, value in spec.routes["forward"].select(first).items():
            arr = np.asarray(value)
            specs[name] = TensorSpec(jax.dtypes.canonicalize_dtype(arr.dtype), arr.shape[1:])
    for name, ts in specs.items():
        canonical = np.dtype(jax.dtypes.canonicalize_dtype(ts.dtype))
        if canonical != ts.dtype:
            raise ExportError(
                f"input {name!r} is declared {ts.dtype}, but JAX runs with 64-bit types off, "
                f"so the program would take {canonical}. Declare jn.TensorSpec({canonical.name!r}"
                f", {ts.shape}) (and cast on the client)."
            )
    return specs


# -- the traced function ---------------------------------------------------------------------
def _hook(spec, device, name: str, *args, **kwargs):
    view = CompileView(spec.experiment, device, name)
    return getattr(spec.cls, name)(view, *args, **kwargs)


def _named_outputs(outputs: Any, where: str) -> dict[str, Any]:
    if isinstance(outputs, Mapping):
        bad = [k for k, v in outputs.items() if not isinstance(k, str) or not hasattr(v, "shape")]
        if not outputs or bad:
            raise ExportError(
                f"{where} returned a dict whose entries {bad or '(none)'} are not "
                f"name -> array; return {{'probs': ..., 'label': ...}}."
            )
        return dict(outputs)
    if hasattr(outputs, "shape") and hasattr(outputs, "dtype"):
        return {"output": outputs}
    raise ExportError(
        f"{where} returned a {type(outputs).__name__}; a served model has named outputs. "
        f"Return one array (named 'output') or a dict name -> array, or define "
        f"export_postprocess(self, outputs) returning {{name: array}}."
    )


def _check_batch(cls_name: str, batch: Any, needs: tuple, preprocessed: bool) -> None:
    """The batch forward is given must have every field it names."""
    missing = [f for f in needs if not isinstance(batch, Mapping) or f not in batch]
    if not missing:
        return
    got = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
    if preprocessed:
        raise ExportError(
            f"{cls_name}.export_preprocess must return the batch forward reads, fields "
            f"{list(needs)}; it returned {got}. Return a dict with {missing}."
        )
    raise ExportError(
        f"{cls_name}.export_inputs() declares inputs {got}, but forward reads {list(needs)}. "
        f"Declare those, or define export_preprocess(self, **wire) returning {{{missing[0]!r}: "
        f"...}} from the wire inputs."
    )


def serving_function(n: Nitro, weights: Weights, order: list) -> Callable:
    """``(weights, inputs) -> {name: array}``: preprocess, forward, postprocess in inference
    mode with the Device values of now. ``order`` receives the output names as declared."""
    spec = n.spec
    device_host = {k: np.asarray(jax.device_get(v)) for k, v in n.device.values.items()}
    has = {
        h: callable(getattr(spec.cls, h, None)) for h in ("export_preprocess", "export_postprocess")
    }
    forward_needs = spec.routes["forward"].required

    def serve(flat_weights, inputs):
        device = {k: jnp.asarray(v) for k, v in device_host.items()}  # frozen: constants
        params, state = weights.rebuild(flat_weights)
        with models.mode(train=False):
            if has["export_preprocess"]:
                batch = _hook(spec, device, "export_preprocess", **inputs)
            else:
                batch = dict(inputs)
            _check_batch(spec.cls.__name__, batch, forward_needs, has["export_preprocess"])
            outputs, _ = _forward(spec, device, params, state, dict(batch))
            where = f"{spec.cls.__name__}.forward"
            if has["export_postprocess"]:
                outputs = _hook(spec, device, "export_postprocess", outputs)
                where = f"{spec.cls.__name__}.export_postprocess"
        named = _named_outputs(outputs, where)
        order[:] = list(named)
        return named

    return serve


# -- export and its checks -------------------------------------------------------------------
def _subjaxprs(value: Any):
    if isinstance(value, jax.extend.core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jax.extend.core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _subjaxprs(v)


def _callbacks(jaxpr) -> list[str]:
    """'jax.debug.print at file.py:12 (forward)' for every host callback, nested ones too."""
    found = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _CALLBACKS or name.endswith("callback"):
            found.append(f"{_CALLBACKS.get(name, name)}{_where(eqn)}")
        for value in eqn.params.values():
            for sub in _subjaxprs(value):
                found += _callbacks(sub)
    return found


def _where(eqn) -> str:
    try:
        from jax._src import source_info_util

        return f" at {source_info_util.summarize(eqn.source_info)}"
    except Exception:  # noqa: BLE001 - a location is a courtesy; jax may move it
        return ""


def _trace(fn, args) -> Any:
    try:
        return jax.make_jaxpr(fn)(*args)
    except JaxnitroError:
        raise
    except Exception as e:
        raise ExportError(
            f"tracing the exported program ({_HOOKS}) with a symbolic batch dimension "
            f"{BATCH!r} failed: {type(e).__name__}: {e}. The bundle takes any batch size, so "
            f"code must not need the concrete size (no int(x.shape[0]), Python max/min or "
            f"reshape to a fixed batch; use x.shape[0] and jnp ops)."
        ) from e


def export_program(
    fn: Callable,
    weight_specs: dict,
    input_specs: dict[str, TensorSpec],
    *,
    platforms: Sequence[str],
    allow_custom_calls: Sequence[str] = (),
) -> export.Exported:
    """`jax.export` of ``fn(weights, inputs)`` for every platform, refusing host callbacks
    and custom calls without a compatibility guarantee (unless named in
    ``allow_custom_calls``)."""
    (batch,) = export.symbolic_shape(BATCH)
    inputs = {
        k: jax.ShapeDtypeStruct((batch, *ts.shape), ts.dtype) for k, ts in input_specs.items()
    }
    args = (weight_specs, inputs)
    calls = _callbacks(_trace(fn, args).jaxpr)
    if calls:
        raise ExportError(
            f"the exported program calls back into Python: {'; '.join(calls)}. A bundle runs "
            f"without Python code, so host callbacks cannot be serialized. Remove the call "
            f"from {_HOOKS} (a debug print can move to loss or metrics, which are not exported)."
        )
    checks = [export.DisabledSafetyCheck.custom_call(t) for t in allow_custom_calls]
    try:
        return export.export(jax.jit(fn), platforms=tuple(platforms), disabled_checks=checks)(*args)
    except ValueError as e:
        if "custom calls whose targets have no compatibility" not in str(e):
            raise
        import re

        targets = sorted(set(re.findall(r"stablehlo\.custom_call @([\w$.\-]+)", str(e))))
        raise ExportError(
            f"the exported program uses custom call(s) {targets} that jax.export gives no "
            f"compatibility guarantee for: a bundle with them may fail on any other jaxlib. "
            f"Use an implementation without them (e.g. jax.nn.dot_product_attention("
            f"implementation='xla') instead of 'cudnn'), or, if the bundle only has to run "
            f"with this jaxlib, pass export_model(..., allow_custom_calls={tuple(targets)!r})."
        ) from e


def serialize(exported: export.Exported) -> bytes:
    try:
        return bytes(exported.serialize())
    except ImportError as e:
        raise ExportError(
            f"serializing the program needs the flatbuffers package ({e}); "
            f"pip install 'flatbuffers>=24.3'."
        ) from e


def output_specs(exported: export.Exported, order: list[str]) -> dict[str, TensorSpec]:
    """{name: per-example TensorSpec} in the declared order; every output must have the
    batch dimension first and constant dimensions after it."""
    avals = jax.tree_util.tree_unflatten(exported.out_tree, exported.out_avals)
    specs = {}
    for name in order:
        aval = avals[name]
        dims = [str(d) for d in aval.shape]
        lead_ok = bool(aval.shape) and export.is_symbolic_dim(aval.shape[0]) and dims[0] == BATCH
        rest = aval.shape[1:]
        if not lead_ok or any(export.is_symbolic_dim(d) for d in rest):
            raise ExportError(
                f"output {name!r} has shape ({', '.join(dims)}); every output needs one row "
                f"per example: the batch dimension {BATCH!r} first, fixed sizes after it "
                f"(a served batch is split back per request). Return per-example values "
                f"(e.g. drop a .mean() over the batch)."
            )
        specs[name] = TensorSpec(aval.dtype, tuple(int(d) for d in rest))
    return specs
