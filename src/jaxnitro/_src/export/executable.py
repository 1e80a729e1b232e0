"""A bundle's program, compiled ahead of time once per padded batch size and called on flat
arguments: the weights are flattened and placed on the device once, at load, so a call
passes the input arrays and a tuple of device buffers, with no pytree of weights to walk,
no jit cache lookup and no re-tracing. This is the whole per-call cost of a `Bundle`
besides its input checks (about a third of what ``jax.jit(exported.call)`` on dicts costs
for a small model)."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jaxnitro._src.compile import backend_options


class Executable:
    """``exported``'s program for one input signature per batch size.

    Args:
        exported: the deserialized `jax.export.Exported`, taking ``(weights, inputs)``, two
            dicts of arrays, and returning a dict of arrays.
        weights: name -> host array, as the program takes them.
        input_specs: name -> (dtype, per-example shape) of every input.

    ``run(size, arrays)`` takes the inputs in `input_names` order, each with ``size`` rows,
    and returns the outputs in `output_names` order (device arrays; the caller fetches them).
    """

    def __init__(
        self,
        exported: Any,
        weights: Mapping[str, np.ndarray],
        input_specs: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
    ):
        (w_avals, in_avals), _ = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)
        out_avals = jax.tree_util.tree_unflatten(exported.out_tree, exported.out_avals)
        # dict pytrees flatten in sorted-key order; keep that order for the flat call
        self._weight_names = sorted(w_avals)
        self.input_names: tuple[str, ...] = tuple(sorted(in_avals))
        self.output_names: tuple[str, ...] = tuple(sorted(out_avals))
        self._specs = {k: input_specs[k] for k in self.input_names}
        self._weights = tuple(jax.device_put([weights[k] for k in self._weight_names]))
        self._exported = exported
        self._programs: dict[int, Any] = {}
        self._lock = threading.Lock()

    @property
    def sizes(self) -> tuple[int, ...]:
        """The batch sizes compiled so far."""
        return tuple(sorted(self._programs))

    def run(self, size: int, arrays: Sequence[np.ndarray]) -> Sequence[jax.Array]:
        program = self._programs.get(size)
        if program is None:
            program = self._compile(size)
        return program(*self._weights, *arrays)

    def _compile(self, size: int) -> Any:
        with self._lock:  # two threads asking for one new size compile it once
            program = self._programs.get(size)
            if program is None:
                args = [jax.ShapeDtypeStruct(w.shape, w.dtype) for w in self._weights]
                args += [
                    jax.ShapeDtypeStruct((size, *shape), dtype)
                    for dtype, shape in self._specs.values()
                ]
                lowered = jax.jit(self._flat).lower(*args)
                # the options a run's programs take (`compile/backend_options.py`)
                options = backend_options.defaults(jax.default_backend(), size)
                options = backend_options.resolve(options, lowered)
                program = lowered.compile(compiler_options=options or None)
                self._programs[size] = program
        return program

    def _flat(self, *leaves: jax.Array) -> list[jax.Array]:
        n = len(self._weight_names)
        weights = dict(zip(self._weight_names, leaves[:n], strict=True))
        inputs = dict(zip(self.input_names, leaves[n:], strict=True))
        out = self._exported.call(weights, inputs)
        return [out[k] for k in self.output_names]
