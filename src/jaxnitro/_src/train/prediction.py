"""`jn.predict`: `forward` in inference mode on a dict batch or a loader, host outputs.

A dict batch of any size runs in one of a bounded set of programs: it is padded to a power of
two up to the train batch size (and split into pieces above it), and the padding rows are
sliced away on the host, so the number of real rows is never part of a program.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

import jax
import numpy as np

from jaxnitro._src.core.errors import DataError, closest
from jaxnitro._src.data import batches, feed
from jaxnitro._src.programs.builders import predict_program
from jaxnitro._src.programs.stale import check_stale
from jaxnitro._src.steps import ema, population

if TYPE_CHECKING:
    from typing import Any

    from jaxnitro._src.core.types import Batch, Source
    from jaxnitro._src.run.nitro import Nitro
    from jaxnitro._src.run.spec import RunSpec


def predict(n: Nitro, batch_or_loader: Any, *, weights: str | None = None) -> Any:
    """Run `forward` in inference mode; host outputs with any padding sliced away.

    A dict batch returns the outputs for it; a loader (any re-iterable of dict batches)
    returns a lazy iterator of per-batch outputs.

    Args:
        n: the run (`jn.Nitro`).
        batch_or_loader: a dict batch of arrays, or a re-iterable of them.
        weights: with `Nitro(ema=...)`, "ema" (the averaged weights) or "raw" (the trained
            ones); None: those validation uses.

    Returns:
        `forward`'s outputs as numpy arrays (for a loader: an iterator of them per batch).

    Raises:
        DataError: the input is a bare array rather than a dict batch, or a batch does not
            fit the split `forward` was compiled for.
        ConfigError: `n` is a population (use `jn.member`), or `weights` is not available.

    Example:
        >>> logits = jn.predict(n, {"x": x_test[:10]})
        >>> logits.shape
        (10, 10)
    """
    population.refuse(n, "jn.predict")
    check_stale(n.spec, n.programs)
    ema.pick(n, weights)  # a bad or unavailable choice fails here, not at the first batch
    if isinstance(batch_or_loader, Mapping):
        return _predict_batch(n, batch_or_loader, pad_to=None, weights=weights)
    if isinstance(batch_or_loader, (np.ndarray, jax.Array)) or not hasattr(
        batch_or_loader, "__iter__"
    ):
        fields = n.spec.routes["forward"].required
        raise DataError(
            f"predict takes a dict batch (or a loader of them), got a bare "
            f"{type(batch_or_loader).__name__}. forward() expects the field(s) {list(fields)}: "
            f"pass e.g. jn.predict(n, {{{fields[0]!r}: x}})."
            if fields
            else f"predict takes a dict batch, got {type(batch_or_loader).__name__}; pass a "
            f"dict of arrays."
        )
    return _predict_lazy(n, batch_or_loader, weights)


def _predict_lazy(n: Nitro, loader: Source, weights: str | None) -> Iterator:
    pad_to = getattr(loader, "batch_size", None)
    total = len(loader) if hasattr(loader, "__len__") else None
    with n.display.bar("predicting", total) as advance:  # closed with the iterator
        for batch in loader:
            out = _predict_batch(n, batch, pad_to=pad_to, weights=weights)
            advance(1)
            yield out


def _fields(n: Nitro, batch: Batch) -> list[str]:
    """The batch fields `forward` takes (a missing one is named, with a rename hint)."""
    route = n.spec.routes["forward"]
    missing = [f for f in route.required if f not in batch]
    if missing:
        hints = [(m, closest(m, batch, cutoff=0.5)) for m in missing]
        renames = [f"rename {got!r} to {m!r}" for m, got in hints if got]
        raise DataError(
            f"predict: forward() needs field(s) {missing}; the batch has {sorted(batch)}. "
            + ("; ".join(renames).capitalize() + "." if renames else f"Pass a dict with {missing}.")
        )
    return [f for f in batch if route.takes_all or f in route.required or f in route.optional]


def _predict_batch(
    n: Nitro, batch: Batch, *, pad_to: int | None, weights: str | None = None
) -> Any:
    spec = n.spec
    fields = _fields(n, batch)
    size = batches.check_batch({f: batch[f] for f in fields}, "predict")
    if "train" in spec.split_specs:
        batches.check_same_specs(
            batches.batch_specs({f: batch[f] for f in fields}, "predict"),
            spec.split_specs["train"].specs,
            "predict",
        )
    if pad_to is None:  # a dict batch of any size: a bounded set of programs
        cap = _predict_cap(spec)
        if size > cap:  # in pieces of the largest bucket, outputs joined (batch first)
            pieces = [
                _predict_batch(
                    n, {f: batch[f][i : i + cap] for f in fields}, pad_to=None, weights=weights
                )
                for i in range(0, size, cap)
            ]
            return jax.tree.map(lambda *xs: np.concatenate(xs, axis=0), *pieces)
        pad_to = _bucket(size, cap)
    target = pad_to if pad_to and size < pad_to else size
    rem = target % spec.n_devices
    if rem:
        target += spec.n_devices - rem
    host = batches.pad_batch({f: np.asarray(batch[f]) for f in fields}, target)
    dev = {f: feed.put(spec, host[f], spec.batch_sharding) for f in fields}
    params, model_state = ema.pick(n, weights)
    ts, extras = n.train_state.replace(params=params, state=model_state), n.device.extras
    prog = predict_program(spec, n.programs, ts, dev, extras)
    out = jax.device_get(prog(ts.params, ts.state, dev, extras))
    if target == size:
        return out
    return jax.tree.map(
        lambda a: a[:size] if getattr(a, "ndim", 0) and a.shape[0] == target else a, out
    )


def _predict_cap(spec: RunSpec) -> int:
    """The largest predict bucket: the train batch size (else the largest batch seen)."""
    sizes = [info.batch_size for info in spec.split_specs.values()]
    train = spec.split_specs["train"].batch_size if "train" in spec.split_specs else None
    return max(train or max(sizes, default=1), 1)


def _bucket(size: int, cap: int) -> int:
    """Powers of two up to `cap` (and `cap` itself): predict over arbitrary batch sizes
    compiles at most log2(cap) + 2 programs instead of one per size."""
    b = 1
    while b < size:
        b *= 2
    return min(b, cap)
