"""grain as a split: a `grain.MapDataset`, `grain.IterDataset` or `grain.DataLoader` that
yields dict batches, returned from `build_data` as it is.

- **MapDataset** (random access, finite, of batches): epoch e is its elements e·L … e·L+L−1
  of `ds.repeat(reseed_each_epoch=True)` (grain's own notion of epochs), so shuffles and
  random maps differ per epoch; a position is a batch index, and a resume reads from it
  directly (`ds[i:]`: nothing before it is read).
- **IterDataset / DataLoader** (streams): each epoch is one pass of a fresh iterator. The
  iterator's state after every batch travels with the batch to the loop, which saves the
  state of the last batch it trained on in the checkpoint (grain's state is JSON: no pickle);
  a resume restores it with `set_state`, so reading continues at the saved position.

grain is an optional extra (`pip install 'jaxnitro[grain]'`); nothing here imports it until a
split is one of its types.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Generator, Mapping
from typing import Any

from jaxnitro._src.core.errors import DataError, warn_user

_MAP_THREADS = 4  # threads reading a MapDataset's batches ahead


def kind(src) -> str | None:
    """'map', 'iter' or 'loader' for a grain split; None for anything else."""
    names = {c.__name__ for c in type(src).__mro__ if c.__module__.startswith("grain.")}
    if "MapDataset" in names:
        return "map"
    if "IterDataset" in names:
        return "iter"
    if "DataLoader" in names:
        return "loader"
    return None


def _grain():
    try:
        import grain
    except ImportError as e:  # pragma: no cover - only without the extra
        raise DataError(
            "grain splits and jn.shard_options need grain: pip install 'jaxnitro[grain]'."
        ) from e
    return grain


def shard_options(dist):
    """grain's shard options for this process (from `dist` in `build_data`): each process
    reads only its shard of the records.

    Args:
        dist: the `jn.Dist` that `build_data(self, dist)` receives.

    Returns:
        A `grain.sharding.ShardOptions` for this process's shard (the remainder dropped, so
        every process reads as many records).

    Example:
        >>> def build_data(self, dist):
        ...     sampler = grain.samplers.IndexSampler(
        ...         len(source), shard_options=jn.shard_options(dist), shuffle=True, seed=0,
        ...         num_epochs=1)
    """
    grain = _grain()
    return grain.sharding.ShardOptions(
        shard_index=dist.process_index, shard_count=dist.process_count, drop_remainder=True
    )


def check(split: str, src, dist) -> None:
    """At setup: a map dataset is finite; a loader is sharded as the processes are."""
    k = kind(src)
    if k == "map" and len(src) >= 2**62:
        raise DataError(
            f"split {split!r} is an infinite grain.MapDataset (repeated without a count): an "
            f"epoch would never end. Return the dataset of one epoch (jaxnitro repeats it, "
            f"reseeding each epoch), or slice it: ds[:n_batches]."
        )
    if k == "loader" and dist.process_count > 1:
        sampler = getattr(src, "_sampler", None)
        opts = getattr(sampler, "_shard_options", None) or getattr(src, "_shard_options", None)
        count = getattr(opts, "shard_count", 1)
        if count != dist.process_count:
            raise DataError(
                f"split {split!r}: the grain.DataLoader is sharded {count} way(s), but the run "
                f"has {dist.process_count} processes: each would read the same records. Pass "
                f"shard_options=jn.shard_options(dist) to its IndexSampler."
            )


def describe(src) -> str:
    """One line for the binding report (the worker processes, where grain has them)."""
    k = kind(src)
    if k == "loader":
        mp = getattr(src, "_multiprocessing_options", None)
        n = getattr(mp, "num_workers", 0)
        return f"grain.DataLoader ({n} worker process(es))"
    if k == "map":
        return (
            f"grain.MapDataset ({len(src)} batches per epoch, read ahead by {_MAP_THREADS} "
            f"threads in-process)"
        )
    return "grain.IterDataset"


def _epoch_view(src, epoch: int, start: int):
    """Epoch `epoch` of a map dataset from batch `start`, as an iterable."""
    n = len(src)
    return src.repeat(None, reseed_each_epoch=True)[epoch * n + start : (epoch + 1) * n]


def batches(
    src, epoch: int, start: int, state: Mapping | None
) -> Generator[tuple[Any, Any], None, None]:
    """(batch, state after it) from batch `start` of `epoch`, or from the saved iterator
    `state` (streams); the state is None for a map dataset (its position is the index)."""
    if kind(src) == "map":
        # A few batches ahead in a few threads (grain's default, 500 elements in 16 threads,
        # would hold 500 batches); for processes, pass an IterDataset with mp_prefetch or a
        # grain.DataLoader with worker_count.
        grain = _grain()
        options = grain.ReadOptions(num_threads=_MAP_THREADS, prefetch_buffer_size=2 * _MAP_THREADS)
        for batch in _epoch_view(src, epoch, start).to_iter_dataset(options):
            yield batch, None
        return
    it = iter(src)
    loader = kind(src) == "loader"
    if state is not None:
        it.set_state(json.dumps(state).encode() if loader else dict(state))
    elif start:
        warn_user(
            f"resuming a grain {type(src).__name__} at batch {start} without its saved "
            f"iterator state (the checkpoint predates it): replaying {start} batches.",
        )
        it = itertools.islice(it, start, None)
    for batch in it:
        raw = it.get_state() if hasattr(it, "get_state") else None
        yield batch, (json.loads(raw) if isinstance(raw, (bytes, str)) else raw)


def peek(src, epoch: int, start: int, state: Mapping | None):
    """The batch training would read first (at a resume: the saved position's), read alone."""
    if kind(src) == "map":
        return _epoch_view(src, epoch, start)[0] if start < len(src) else src[0]
    gen = batches(src, epoch, start, state)
    try:
        first = next(gen, None)
    finally:
        gen.close()
    return None if first is None else first[0]
