"""The models a server holds: each bundle under its manifest name, what the protocol says
about it (metadata, readiness), and the checks that turn a decoded request into the arrays
the bundle takes, all done before a request is queued, so a bad request fails alone and
never takes a batch down with it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.export import load_bundle
from jaxnitro._src.serve import tensors
from jaxnitro._src.serve.codec import InferRequest, TensorIn
from jaxnitro._src.serve.errors import InvalidRequest, NotFound
from jaxnitro._src.serve.stats import ModelStats

#: The largest batch one compiled program takes when dynamic batching is off (the bundle's
#: own default); a larger request runs in pieces of this size.
DEFAULT_BUCKET_CAP = 256
PLATFORM = "jax"
#: A model call known to take at most this long runs on the event loop, not in the model's
#: worker thread: handing a call to the thread and back costs the loop about 0.1-0.2 ms
#: (two wake-ups and a GIL hand-off), as much as a small model's whole call, while blocking
#: the loop this long delays nothing noticeably (the hand-written server runs every call so).
INLINE_MAX_S = 1e-3


class Servable(Protocol):
    """What the server needs of a model: `jn.Bundle` has it (tests pass small fakes)."""

    @property
    def name(self) -> str: ...
    @property
    def inputs(self) -> Mapping[str, Any]: ...
    @property
    def outputs(self) -> Mapping[str, Any]: ...
    def __call__(self, **inputs: np.ndarray) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A request checked against its model: the arrays to run and the outputs to return."""

    inputs: dict[str, np.ndarray]
    rows: int
    outputs: list[str]


class ServedModel:
    """One bundle as the protocol sees it.

    Args:
        bundle: a loaded `jn.Bundle` (or anything `Servable`).
        bucket_cap: the largest batch one call runs (the bundle splits larger ones).
        max_tensor_bytes: the most bytes one decoded input may take.
    """

    def __init__(
        self,
        bundle: Servable,
        *,
        bucket_cap: int,
        max_tensor_bytes: int,
        name: str | None = None,
        version: str | None = None,
        max_batch_delay_ms: float = 0.0,
        batching: bool = False,
        version_policy: dict | None = None,
    ):
        self.bundle = bundle
        self.name = name or str(bundle.name)
        #: None: a bundle served alone (its manifest version, also answering to "1").
        self.repository_version = version
        self.version = version or _version(bundle)
        self.max_batch_delay_ms = max_batch_delay_ms
        self.batching = batching
        self.version_policy = version_policy or {"latest": {"num_versions": 1}}
        #: Whether its batching settings are its own (a repository model's config), not
        #: the server's.
        self.configured = False
        #: A repository version's settings (`jaxnitro._src.serve.repository.model_settings`).
        self.settings: dict | None = None
        self.stats = ModelStats()
        #: Requests holding this version (`Registry.acquire`): it is unloaded at 0.
        self.leases = 0
        self.drained: asyncio.Event | None = None
        self.batcher: Any = None  # the runtime's Batcher, once started
        self.inputs = dict(bundle.inputs)
        self.outputs = dict(bundle.outputs)
        self.bucket_cap = bucket_cap
        self.max_tensor_bytes = max_tensor_bytes
        self.ready = False
        self._compiled: tuple[int, ...] = ()
        self._buckets = self.bucket_sizes()
        self._seconds: dict[int, float] = {}  # bucket -> the latest call's time
        for kind, specs in (("input", self.inputs), ("output", self.outputs)):
            for key, spec in specs.items():
                if tensors.datatype_of(spec.dtype) is None:
                    raise ConfigError(
                        f"model {self.name!r}: {kind} {key!r} has dtype {spec.dtype}, which "
                        f"the Open Inference Protocol cannot carry (it has {list(tensors.DTYPES)}"
                        f"). Export with export_inputs/export_postprocess converting to one."
                    )
        self.executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=f"jaxnitro-serve-{self.name}-{self.version}"
        )

    # -- what the protocol says about it -----------------------------------------------------
    @property
    def versions(self) -> tuple[str, ...]:
        if self.repository_version is not None or self.version == "1":
            return (self.version,)
        return ("1", self.version)

    def metadata(self) -> dict:
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": PLATFORM,
            "inputs": [self._tensor(k, v) for k, v in self.inputs.items()],
            "outputs": [self._tensor(k, v) for k, v in self.outputs.items()],
        }

    def config(self) -> dict:
        """Triton's model configuration (as its REST JSON writes it): dims without the
        batch dimension, the compiled bucket sizes as preferred batch sizes."""

        def tensor(key: str, spec: Any) -> dict:
            datatype = tensors.datatype_of(spec.dtype)
            # the configuration's type names: TYPE_ + the API's, but BYTES is TYPE_STRING
            kind = "TYPE_STRING" if datatype == "BYTES" else f"TYPE_{datatype}"
            return {"name": key, "data_type": kind, "dims": list(spec.shape)}

        doc = {
            "name": self.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "version_policy": self.version_policy,
            "max_batch_size": self.bucket_cap,
            "input": [tensor(k, v) for k, v in self.inputs.items()],
            "output": [tensor(k, v) for k, v in self.outputs.items()],
        }
        if self.batching:
            doc["dynamic_batching"] = {
                "preferred_batch_size": self.bucket_sizes(),
                "max_queue_delay_microseconds": int(self.max_batch_delay_ms * 1e3),
            }
        return doc

    @staticmethod
    def _tensor(name: str, spec: Any) -> dict:
        return {
            "name": name,
            "datatype": tensors.datatype_of(spec.dtype),
            "shape": [-1, *spec.shape],
        }

    @property
    def compiled_batch_sizes(self) -> tuple[int, ...]:
        """The padded sizes compiled so far (read after each call, in the worker thread that
        changes them: reading the bundle's set from the event loop could race a compile)."""
        return self._compiled

    def bucket_sizes(self) -> list[int]:
        """The batch sizes a call can be padded to: powers of two up to the cap, and the cap."""
        sizes, b = [], 1
        while b < self.bucket_cap:
            sizes.append(b)
            b *= 2
        return [*sizes, self.bucket_cap]

    # -- running it (in the model's worker thread, or on the event loop when quick) -----------
    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        rows = next(iter(inputs.values())).shape[0]
        started = time.perf_counter()
        out = self.bundle(**inputs)
        self._compiled = tuple(getattr(self.bundle, "compiled_batch_sizes", ()))
        if not isinstance(out, Mapping):
            out = {next(iter(self.outputs)): out}
        # the manifest's dtype, which the metadata announced (a bundle returns it already)
        out = {k: np.asarray(out[k]).astype(v.dtype, copy=False) for k, v in self.outputs.items()}
        if rows <= self.bucket_cap:  # the latest time of a call padded to this bucket
            self._seconds[self._bucket(rows)] = time.perf_counter() - started
        return out

    def quick(self, rows: int) -> bool:
        """Whether a call on ``rows`` rows is known to take at most `INLINE_MAX_S` (its
        bucket's latest call did), so it may run on the event loop."""
        if rows > self.bucket_cap:
            return False
        return self._seconds.get(self._bucket(rows), math.inf) <= INLINE_MAX_S

    def _bucket(self, rows: int) -> int:
        return next(b for b in self._buckets if b >= rows)

    def warm_up(self, done: Callable[[int], None] | None = None) -> None:
        """Run every bucket size once, so no request waits for a compile. (That call's time
        includes the compile, so the first request of each size runs in the worker thread,
        and its time says whether the next ones are `quick`.) `done(size)` follows each."""
        for size in self.bucket_sizes():
            self.run(
                {k: np.zeros((size, *spec.shape), spec.dtype) for k, spec in self.inputs.items()}
            )
            if done is not None:
                done(size)

    # -- checking a request ------------------------------------------------------------------
    def prepare(self, request: InferRequest) -> Prepared:
        """The arrays for ``request``, or the `ServeError` that names what is wrong."""
        outputs = self._outputs(request)
        if request.raw_body is not None:
            arrays = self._raw(request.raw_body)
        else:
            arrays = self._inputs(request.inputs)
        rows = {k: v.shape[0] for k, v in arrays.items()}
        if len(set(rows.values())) > 1:
            raise InvalidRequest(
                f"inputs of model {self.name!r} have different batch sizes {rows}; every "
                f"input needs one row per example."
            )
        return Prepared(arrays, next(iter(rows.values())), outputs)

    def _outputs(self, request: InferRequest) -> list[str]:
        if request.outputs is None:
            return list(self.outputs)
        names = [o.name for o in request.outputs]
        for name in names:
            if name not in self.outputs:
                raise InvalidRequest(
                    f"model {self.name!r} has no output {name!r}; it has "
                    f"{list(self.outputs)}.{did_you_mean(name, self.outputs)}"
                )
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise InvalidRequest(f"output {dup!r} is requested more than once.")
        return names or list(self.outputs)

    def _inputs(self, given: Sequence[TensorIn]) -> dict[str, np.ndarray]:
        seen: dict[str, TensorIn] = {}
        for t in given:
            if t.name not in self.inputs:
                raise InvalidRequest(
                    f"model {self.name!r} has no input {t.name!r}; it takes "
                    f"{list(self.inputs)}.{did_you_mean(t.name, self.inputs)}"
                )
            if t.name in seen:
                raise InvalidRequest(f"input {t.name!r} is given more than once.")
            seen[t.name] = t
        missing = [k for k in self.inputs if k not in seen]
        if missing:
            raise InvalidRequest(
                f"model {self.name!r} expects {len(self.inputs)} input(s) but got "
                f"{len(seen)}: missing required input(s) {missing}."
            )
        return {k: self._tensor_value(seen[k]) for k in self.inputs}

    def _tensor_value(self, t: TensorIn) -> np.ndarray:
        spec = self.inputs[t.name]
        want = tensors.datatype_of(spec.dtype)
        if t.datatype != want:
            cast = "ml_dtypes.bfloat16" if want == "BF16" else f"np.{spec.dtype.name}"
            raise InvalidRequest(
                f"input {t.name!r} has datatype {t.datatype}, but model {self.name!r} expects "
                f"{want}; the server does not cast. Convert on the client: x.astype({cast})."
            )
        expected = (-1, *spec.shape)
        if len(t.shape) != len(expected) or tuple(t.shape[1:]) != spec.shape:
            raise InvalidRequest(
                f"unexpected shape for input {t.name!r} of model {self.name!r}: expected "
                f"{list(expected)}, got {list(t.shape)}."
            )
        if t.shape[0] < 1:
            raise InvalidRequest(
                f"input {t.name!r}: the batch dimension is 0; send at least one row."
            )
        if t.raw is not None:  # its size was checked against the shape: no allocation
            return tensors.from_bytes(t.name, t.raw, spec.dtype, t.shape)
        return tensors.from_list(
            t.name,
            t.data,
            spec.dtype,
            t.shape,
            limit=self.max_tensor_bytes,
            may_hold_bools=t.may_hold_bools,
        )

    def _raw(self, body: bytes) -> dict[str, np.ndarray]:
        if len(self.inputs) != 1:
            raise InvalidRequest(
                f"a raw binary request (Inference-Header-Content-Length: 0) needs a model with "
                f"one input; {self.name!r} takes {list(self.inputs)}: send a JSON header."
            )
        ((name, spec),) = self.inputs.items()
        row = max(1, tensors.element_count(spec.shape)) * spec.dtype.itemsize
        if len(body) % row:
            raise InvalidRequest(
                f"a raw binary request for input {name!r} ({spec.dtype}, {list(spec.shape)} per "
                f"row = {row} bytes) has {len(body)} bytes, not a whole number of rows."
            )
        shape = (len(body) // row, *spec.shape)
        return {name: tensors.from_bytes(name, body, spec.dtype, shape)}


def _version(bundle: Servable) -> str:
    manifest = getattr(bundle, "manifest", None)
    version = manifest.get("version") if isinstance(manifest, dict) else None
    return str(version) if isinstance(version, (str, int)) and str(version) else "1"


class Registry:
    """The served models by name and version, the version a request gets, and the leases
    that keep a version alive while a request holds it.

    Everything here runs on the event loop (no lock): a version is added before it warms
    up (not ready: no request without a version is routed to it), and removed from the
    table before it is drained, so no new request can reach a version being unloaded.
    """

    def __init__(self, models: Sequence[ServedModel] = ()):
        self.table: dict[str, dict[str, ServedModel]] = {}
        #: Why a known model has no version loaded (a repository's reasons), or None.
        self.why_not: Callable[[str], str | None] = lambda name: None
        for model in models:
            if model.name in self.table:
                raise ConfigError(
                    f"two bundles are named {model.name!r}; a server serves each name once. "
                    f"Export one with jn.export_model(..., name='other-name')."
                )
            self.add(model)

    def add(self, model: ServedModel) -> None:
        self.table.setdefault(model.name, {})[model.version] = model

    def remove(self, model: ServedModel) -> None:
        versions = self.table.get(model.name, {})
        if versions.get(model.version) is model:
            del versions[model.version]
        if not versions:
            self.table.pop(model.name, None)

    @property
    def models(self) -> dict[str, ServedModel]:
        """The version of each model a request without a version gets."""
        return {name: self.get(name) for name in self.table}

    def all(self) -> list[ServedModel]:
        """Every loaded version of every model."""
        return [m for versions in self.table.values() for m in versions.values()]

    @property
    def ready(self) -> bool:
        return all(any(m.ready for m in v.values()) for v in self.table.values())

    def get(self, name: str, version: str | None = None) -> ServedModel:
        versions = self.table.get(name)
        if not versions and (why := self.why_not(name)):
            raise NotFound(f"model {name!r:.100} has no version loaded: {why}")
        if not versions:
            raise NotFound(
                f"unknown model {name!r:.100}; this server has {sorted(self.table)}."
                f"{did_you_mean(name, self.table)}"
            )
        if version:
            model = versions.get(version) or next(
                (m for m in versions.values() if version in m.versions), None
            )
            if model is None:
                have = sorted({v for m in versions.values() for v in m.versions}, key=_order)
                raise NotFound(
                    f"model {name!r} has no version {version!r:.40}; this server has {have} "
                    f"(or leave the version out for the newest)."
                )
            return model
        ready = [m for m in versions.values() if m.ready]
        return max(ready or versions.values(), key=lambda m: _order(m.version))

    def acquire(self, name: str, version: str | None = None) -> ServedModel:
        """`get`, and hold the version until `release`: it is not unloaded meanwhile."""
        model = self.get(name, version)
        model.leases += 1
        return model

    @staticmethod
    def release(model: ServedModel) -> None:
        model.leases -= 1
        if model.leases == 0 and model.drained is not None:
            model.drained.set()

    def close(self) -> None:
        for model in self.all():
            model.executor.shutdown(wait=True)


def _order(version: str) -> tuple[int, str]:
    """Versions by number (a repository's are positive integers), then by text."""
    return (int(version), "") if version.isdigit() else (0, version)


def load_models(
    sources: Sequence[str | os.PathLike | Servable] | str | os.PathLike,
    *,
    bucket_cap: int | None,
    max_tensor_bytes: int,
    max_batch_delay_ms: float = 0.0,
) -> list[ServedModel]:
    """A `ServedModel` per bundle directory (or already loaded bundle)."""
    if isinstance(sources, (str, os.PathLike)):
        sources = [sources]
    if not sources:
        raise ConfigError("serve needs at least one bundle directory, e.g. serve(['bundles/m']).")
    cap = bucket_cap or DEFAULT_BUCKET_CAP
    models = []
    for source in sources:
        if isinstance(source, (str, os.PathLike)):
            bundle: Servable = load_bundle(Path(source), max_batch_size=cap)
        else:
            bundle = source
        models.append(
            ServedModel(
                bundle,
                bucket_cap=cap,
                max_tensor_bytes=max_tensor_bytes,
                batching=bucket_cap is not None,
                max_batch_delay_ms=max_batch_delay_ms,
            )
        )
    return models
