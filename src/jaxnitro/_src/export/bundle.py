"""`jn.load_bundle` and `Bundle`: run an exported model without its code.

Loading reads only JSON, safetensors and the jax.export flatbuffer (never pickle), verifies
every file's sha256 and refuses a bundle outside jax.export's compatibility window. A call
validates its inputs against the manifest, pads the batch to a power-of-two bucket (so any
batch size runs in a bounded set of compiled programs) and slices the outputs back.
"""

from __future__ import annotations

import copy
import os
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import export

from jaxnitro._src.core.errors import BundleError, BundleInputError, did_you_mean
from jaxnitro._src.export import compat
from jaxnitro._src.export.executable import Executable
from jaxnitro._src.export.format import PROGRAM, WEIGHTS, TensorSpec
from jaxnitro._src.export.inputs import as_input, batch_size, bucket, signature
from jaxnitro._src.export.manifest import read_files, read_manifest


def load_bundle(
    dir: str | os.PathLike,
    *,
    max_batch_size: int = 256,
    allow_incompatible_jaxlib: bool = False,
) -> Bundle:
    """Load a bundle written by `jn.export_model`; no model code is imported.

    Args:
        dir: the bundle directory.
        max_batch_size: the largest batch one compiled program takes; a larger input runs in
            pieces. Programs are compiled for powers of two up to it (and it), on first use.
        allow_incompatible_jaxlib: load even if this jaxlib is outside jax.export's
            compatibility window for the bundle (it may then fail, or compute wrongly).

    Returns:
        A `jn.Bundle`: call it with the inputs (positional, or by name) for the outputs;
        `inputs`, `outputs` and `name` describe it.

    Raises:
        BundleError: a file is missing, altered (checksum) or unreadable, or the bundle
            was exported by a jaxlib outside this one's compatibility window.

    Example:
        >>> bundle = jn.load_bundle("bundles/mnist")
        >>> probs = bundle(images)                # or bundle(img=images)
        >>> list(bundle.inputs), bundle.name
        (['img'], 'mnistmlp')
    """
    root = Path(dir)
    manifest = read_manifest(root)
    files = read_files(root, manifest)
    problem = compat.window_problem(_get(manifest, "provenance"))
    if problem and not allow_incompatible_jaxlib:
        raise BundleError(
            f"bundle {root}: {problem}. Re-export it with this jax (jn.export_model), install "
            f"the exporting jaxlib, or pass load_bundle(dir, allow_incompatible_jaxlib=True) "
            f"to try anyway."
        )
    try:
        exported = export.deserialize(bytearray(files[PROGRAM]))
    except Exception as e:
        raise BundleError(
            f"{root / PROGRAM} cannot be deserialized by jax {jax.__version__} "
            f"({type(e).__name__}: {e}); re-export the bundle with this jax."
        ) from e
    weights = _read_weights(root, files[WEIGHTS])
    return Bundle(root, manifest, exported, weights, max_batch_size=max_batch_size)


def _get(obj: Any, key: str) -> dict:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, dict) else {}


def _read_weights(root: Path, data: bytes) -> dict[str, np.ndarray]:
    import safetensors.numpy

    try:
        return dict(safetensors.numpy.load(data))
    except Exception as e:
        raise BundleError(
            f"{root / WEIGHTS} is not a readable safetensors file ({e}); export again."
        ) from e


def _specs(manifest: dict, key: str, root: Path) -> dict[str, TensorSpec]:
    entries = manifest.get(key)
    if not isinstance(entries, list) or not entries:
        raise BundleError(f"{root}/manifest.json has no {key!r} list; export the bundle again.")
    try:
        pairs = [TensorSpec.from_entry(e, f"manifest {key}") for e in entries]
    except (TypeError, ValueError) as e:
        raise BundleError(f"{root}/manifest.json: {e}; export the bundle again.") from e
    return dict(pairs)


def _check_against_program(root: Path, exported, inputs, outputs, weights) -> None:
    """The manifest and the weights file must describe exactly what the program takes."""
    (w_avals, in_avals), _ = jax.tree_util.tree_unflatten(exported.in_tree, exported.in_avals)
    out_avals = jax.tree_util.tree_unflatten(exported.out_tree, exported.out_avals)
    problems = []
    for what, avals, specs in (("input", in_avals, inputs), ("output", out_avals, outputs)):
        if set(avals) != set(specs):
            problems.append(
                f"{what}s {sorted(specs)} in the manifest, {sorted(avals)} in the program"
            )
            continue
        for name, ts in specs.items():
            aval = avals[name]
            if np.dtype(aval.dtype) != ts.dtype or tuple(aval.shape[1:]) != ts.shape:
                problems.append(f"{what} {name!r}: {ts} in the manifest, {aval} in the program")
    for key, aval in w_avals.items():
        got = weights.get(key)
        if got is None or got.shape != tuple(aval.shape) or got.dtype != np.dtype(aval.dtype):
            have = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            problems.append(f"weight {key!r}: the program takes {aval}, the file has {have}")
    if extra := sorted(set(weights) - set(w_avals)):
        problems.append(f"weights {extra[:5]} are not used by the program")
    if problems:
        raise BundleError(
            f"bundle {root}: the manifest or weights do not match {PROGRAM}: "
            + "; ".join(problems[:5])
            + ". The bundle was assembled from different exports: export it again."
        )


class Bundle:
    """An exported model, callable on arrays: ``bundle(x)`` (manifest order) or
    ``bundle(x=x)``; a numpy array for one output, a dict name -> array otherwise.

    Made by `jn.load_bundle`. Any batch size >= 1 works: a batch is padded to the next power
    of two (up to ``max_batch_size``, larger batches run in pieces) and the outputs sliced
    back, so at most log2(max_batch_size) + 2 programs are ever compiled.

    Attributes:
        manifest: the parsed manifest.json (a copy).
        inputs / outputs: name -> `TensorSpec` (per example), in manifest order.
        name: the model name.
        platforms: the platforms the program was lowered for.
        compiled_batch_sizes: the padded batch sizes compiled so far.

    Example:
        >>> bundle = jn.load_bundle("bundles/tiny")
        >>> bundle.inputs
        mappingproxy({'x': TensorSpec(dtype='float32', shape=(8,))})
        >>> bundle(np.zeros((3, 8), np.float32)).shape
        (3, 4)
    """

    def __init__(self, root: Path, manifest: dict, exported, weights, *, max_batch_size: int):
        integer = isinstance(max_batch_size, int) and not isinstance(max_batch_size, bool)
        if not integer or max_batch_size < 1:
            raise BundleError(
                f"max_batch_size must be an int >= 1, got {max_batch_size!r}; e.g. 256."
            )
        self._root = root
        self._manifest = manifest
        self._inputs = _specs(manifest, "inputs", root)
        self._outputs = _specs(manifest, "outputs", root)
        _check_against_program(root, exported, self._inputs, self._outputs, weights)
        here = compat.platform()
        if here not in exported.platforms:
            raise BundleError(
                f"bundle {root} was exported for {list(exported.platforms)}; this process runs "
                f"on {here}. Export with platforms=(..., {here!r}), or run where one of those "
                f"is the default (e.g. JAX_PLATFORMS=cpu)."
            )
        self._exported = exported
        self._cap = max_batch_size
        specs = {k: (v.dtype, v.shape) for k, v in self._inputs.items()}
        self._program = Executable(exported, weights, specs)

    # -- what it is ---------------------------------------------------------------------------
    @property
    def manifest(self) -> dict:
        return copy.deepcopy(self._manifest)

    @property
    def inputs(self) -> Mapping[str, TensorSpec]:
        return types.MappingProxyType(self._inputs)

    @property
    def outputs(self) -> Mapping[str, TensorSpec]:
        return types.MappingProxyType(self._outputs)

    @property
    def name(self) -> str:
        return str(self._manifest.get("name", self._root.name))

    @property
    def platforms(self) -> tuple[str, ...]:
        return tuple(self._exported.platforms)

    @property
    def compiled_batch_sizes(self) -> tuple[int, ...]:
        """The padded batch sizes run so far: one compiled program each."""
        return self._program.sizes

    def __repr__(self) -> str:
        sig = ", ".join(f"{k}: {signature(v)}" for k, v in self._inputs.items())
        outs = list(self._outputs)
        return f"Bundle({self.name!r}, {sig} -> {outs}, platforms={list(self.platforms)})"

    # -- running it ---------------------------------------------------------------------------
    def __call__(self, *args: Any, **named: Any) -> Any:
        """Outputs for a batch: a numpy array when the model has one output, else a dict."""
        inputs = self._bind(args, named)
        size = batch_size(inputs)
        if size <= self._cap:
            out = self._run(inputs, size)
        else:
            pieces = [
                self._run({k: v[i : i + self._cap] for k, v in inputs.items()}, None)
                for i in range(0, size, self._cap)
            ]
            out = {k: np.concatenate([p[k] for p in pieces]) for k in self._outputs}
        return next(iter(out.values())) if len(out) == 1 else out

    def _bind(self, args: tuple, named: dict) -> dict[str, np.ndarray]:
        if not args and named.keys() == self._inputs.keys():  # by name, all there: the fast path
            return {k: as_input(k, named[k], spec) for k, spec in self._inputs.items()}
        names = list(self._inputs)
        if args and named:
            raise BundleInputError(
                f"pass the inputs either by position or by name, not both; this bundle takes "
                f"{names}: bundle({', '.join(names)}) or "
                f"bundle({', '.join(f'{n}=...' for n in names)})."
            )
        if args:
            if len(args) != len(names):
                raise BundleInputError(
                    f"this bundle takes {len(names)} input(s) {names}, got {len(args)} "
                    f"positional argument(s); pass them in that order, or by name."
                )
            named = dict(zip(names, args, strict=True))
        unknown = [k for k in named if k not in self._inputs]
        if unknown:
            hint = did_you_mean(unknown[0], names)
            raise BundleInputError(f"unknown input(s) {unknown}; this bundle takes {names}.{hint}")
        missing = [k for k in names if k not in named]
        if missing:
            raise BundleInputError(
                f"missing input(s) {missing}; this bundle takes {names} (one array each, "
                f"batch dimension first)."
            )
        return {k: as_input(k, named[k], self._inputs[k]) for k in names}

    def _run(self, inputs: dict[str, np.ndarray], size: int | None) -> dict[str, np.ndarray]:
        if size is None:
            size = batch_size(inputs)
        target = bucket(size, self._cap)
        arrays = [inputs[k] for k in self._program.input_names]
        if target > size:  # repeat the last row: real values, no NaN from zeros
            pad = target - size
            arrays = [np.concatenate([v, np.repeat(v[-1:], pad, 0)]) for v in arrays]
        try:
            results = self._program.run(target, arrays)
        except ValueError as e:
            raise BundleError(f"running bundle {self._root} on batch {target}: {e}") from e
        fetched = dict(zip(self._program.output_names, results, strict=True))
        if target > size:
            return {k: np.asarray(fetched[k])[:size] for k in self._outputs}
        return {k: np.asarray(fetched[k]) for k in self._outputs}
