"""`DataLoader`: batches from arrays or a Hugging Face dataset, re-iterable, with an
epoch-seeded shuffle and per-sample transforms; and where a resume starts reading a split
(`skip`, `replays`).

What a batch is and how it is checked lives in `batches`; feeding batches to the device
ahead of the step in `prefetch`.
"""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from jaxnitro._src.core.errors import DataError, check_int
from jaxnitro._src.data import tables

# train/epoch.py and run/setup/sequence.py still read these as `loader.X` (they belong to
# other open work); new code imports them from `batches` and `prefetch`.
from jaxnitro._src.data.batches import (
    as_array,
    batch_sharding,  # noqa: F401
)
from jaxnitro._src.data.prefetch import InlineFeed, Prefetcher  # noqa: F401


class DataLoader:
    """Batches from batch-first arrays or a Hugging Face dataset; re-iterable, with an
    epoch-seeded shuffle and optional per-sample transforms in worker processes.

    Args:
        data: {field: array}, every array with the same leading (sample) dimension. Arrays may
            be memory-mapped (`np.load(path, mmap_mode="r")`, `np.memmap`): only the rows of
            each batch are read. Or a Hugging Face `datasets.Dataset` (arrow-backed; from local
            files it stays on disk), read by column (`columns=`).
        batch_size: samples per batch.
        shuffle: reshuffle each epoch with a permutation seeded by (seed, epoch).
        drop_last: drop a final short batch (required for a training split that does not
            divide by the batch size: the compiled step has one batch shape).
        seed: shuffle (and transform) seed; None lets the driver derive it from
            `Nitro(seed=...)`.
        columns: for a `datasets.Dataset`: the columns to read (a list of names, or
            {field: column} to rename); None reads every column.
        transform: `fn(example, rng) -> example`, called once per sample on the host with the
            sample's fields (one row of each, as numpy arrays) and a `np.random.Generator`
            seeded by (seed, epoch, sample index): the result depends on nothing else, so it
            is the same whatever `workers` is, and a resume reproduces it. Every output field
            must have one shape per sample.
        workers: processes running `transform` (0: in this process). Workers are forked
            once, on the first iteration, and share the data with this process (nothing is
            copied or pickled to them); they write their batches into shared memory.
        worker_timeout: seconds a worker may spend on one sample (or on reading a batch's
            rows) before the pass fails with a DataError naming the sample; the workers are
            then stopped and the next pass starts new ones. None waits forever. A worker
            that dies (a signal, the out-of-memory killer) fails the pass at once, named.
            Only for workers >= 1: an in-process transform cannot be interrupted.

    Example:
        >>> x, y = np.zeros((100, 784), np.float32), np.zeros(100, np.int32)
        >>> loader = jn.DataLoader({"img": x, "label": y}, batch_size=32, shuffle=True)
        >>> len(loader), next(iter(loader))["img"].shape
        (4, (32, 784))
        >>> def flip(example, rng):  # one sample's fields, and its own generator
        ...     img = example["img"]
        ...     return {**example, "img": img[::-1] if rng.random() < 0.5 else img}
        >>> aug = jn.DataLoader({"img": x, "label": y}, 32, transform=flip, workers=2)
    """

    def __init__(
        self,
        data,
        batch_size: int,
        *,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int | None = None,
        columns=None,
        transform=None,
        workers: int = 0,
        worker_timeout: float | None = 300,
    ):
        batch_size = check_int(
            "DataLoader batch_size",
            batch_size,
            fix="pass the number of samples per batch, e.g. batch_size=32",
            error=DataError,
        )
        workers = check_int(
            "DataLoader workers",
            workers,
            minimum=0,
            fix="pass the number of transform processes, e.g. workers=2 (0: in this process)",
            error=DataError,
        )
        self.worker_timeout = _check_timeout(worker_timeout)
        table = tables.table_of(data, columns)
        if table is None:
            self.data = _arrays(data)
            table = tables.ArrayTable(self.data)
        else:
            self.data = data
        self.table = table
        self._check_files()  # before the probe reads sample 0
        self.num_samples: int = table.num_rows
        if self.num_samples == 0:
            raise DataError(
                f"DataLoader got 0 samples (fields {sorted(table.fields)} are all empty): it "
                f"would yield no batch. Check the loading or filtering that produced the data."
            )
        self.batch_size = batch_size
        self.shuffle, self.drop_last, self.seed = shuffle, drop_last, seed
        self.epoch = 0
        self.transform, self.workers = transform, workers
        self._pool: Any = None  # workers.TransformPool, started on the first iteration
        _check_transform(transform, workers)
        #: {field: (per-sample shape, dtype)} of the transform's output (None: no transform)
        self.out_specs = self._probe() if transform is not None else None
        self.fields: tuple[str, ...] = (
            tuple(self.out_specs) if self.out_specs is not None else table.fields
        )

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    @property
    def ragged(self) -> bool:
        """True when the last batch is shorter than batch_size."""
        return bool(self.num_samples % self.batch_size) and not self.drop_last

    def set_epoch(self, epoch: int) -> None:
        """Select the shuffle permutation of `epoch` (the driver calls this each epoch).

        Example:
            >>> loader.set_epoch(3)  # the next iteration uses epoch 3's permutation
        """
        self.epoch = int(epoch)

    def _order(self, epoch: int | None = None) -> np.ndarray | None:
        if not self.shuffle:
            return None
        seed = 0 if self.seed is None else self.seed
        epoch = self.epoch if epoch is None else epoch
        return np.random.default_rng([seed, epoch]).permutation(self.num_samples)

    def _rows(self, order, lo: int, hi: int):
        return slice(lo, hi) if order is None else order[lo:hi]

    def _check_files(self) -> None:
        """A memory-mapped file shorter than its header says is refused before a pass reads
        from it (a read past its end is a SIGBUS, which no message survives)."""
        if isinstance(self.table, tables.ArrayTable):
            self.table.check_files()

    def iter_from(self, start: int = 0, *, fields=None) -> Iterator[dict[str, np.ndarray]]:
        """Iterate the current epoch from batch index `start` (used to resume mid-epoch),
        reading only `fields` (None: every field). Nothing before `start` is read.

        Example:
            >>> sum(1 for _ in loader.iter_from(2)), len(loader)
            (2, 4)
        """
        self._check_files()
        order = self._order()
        fields = self.fields if fields is None else tuple(fields)
        bounds = [
            (i * self.batch_size, min((i + 1) * self.batch_size, self.num_samples))
            for i in range(start, len(self))
        ]
        if self.transform is None:
            for lo, hi in bounds:
                yield self.table.read(self._rows(order, lo, hi), fields)
            return
        rows = [self._rows(order, lo, hi) for lo, hi in bounds]
        yield from self._transformed(rows, fields)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self.iter_from(0)

    def first_batch(self) -> dict[str, np.ndarray]:
        """Batch 0 of the current epoch, read (and transformed) in this process."""
        self._check_files()
        order = self._order()
        rows = self._rows(order, 0, min(self.batch_size, self.num_samples))
        if self.transform is None:
            return self.table.read(rows, self.fields)
        seed = 0 if self.seed is None else self.seed
        return self.transform_rows(rows, self.epoch, seed, self.fields)

    def iter_stacked(self, start: int, count: int, fields) -> Iterator[tuple[dict, int]]:
        """From batch `start`, groups of up to `count` full batches as one array per field,
        shaped (k, batch_size, ...): one gather per group (a view when not shuffled).
        A final short batch (drop_last=False) is left out: train splits never have one."""
        self._check_files()
        order = self._order()
        full = self.num_samples // self.batch_size
        fields = tuple(fields)
        if self.transform is not None:
            rows = [
                self._rows(order, i * self.batch_size, (i + 1) * self.batch_size)
                for i in range(start, full)
            ]
            group: list = []
            for batch in self._transformed(rows, fields):
                group.append(batch)
                if len(group) == count:
                    yield {f: np.stack([b[f] for b in group]) for f in fields}, count
                    group = []
            if group:
                yield {f: np.stack([b[f] for b in group]) for f in fields}, len(group)
            return
        for i in range(start, full, count):
            k = min(count, full - i)
            lo, hi = i * self.batch_size, (i + k) * self.batch_size
            shape = (k, self.batch_size)
            read = self.table.read(self._rows(order, lo, hi), fields)
            yield {f: v.reshape(shape + v.shape[1:]) for f, v in read.items()}, k

    def iter_rows(self, start: int, count: int) -> Iterator[tuple[dict, int]]:
        """`iter_stacked`'s groups as the indices of their rows, {"rows": (k, batch_size)
        int32}: what a program gathers from arrays kept on the device (the same rows)."""
        order = self._order()
        bs, full = self.batch_size, self.num_samples // self.batch_size
        # The pass's indices, made once: each group is a view of them (no array per step).
        lo, hi = start * bs, full * bs
        rows = np.arange(lo, hi, dtype=np.int32) if order is None else order[lo:hi]
        rows = rows.astype(np.int32, copy=False).reshape(-1, bs)
        for i in range(0, full - start, count):
            yield {"rows": rows[i : i + count]}, min(count, full - start - i)

    def resident_arrays(self, fields) -> dict[str, np.ndarray] | None:
        """The arrays of `fields` when they can live on the device whole: in-memory numpy
        arrays read as they are (None for memory maps, tables and transformed rows)."""
        if self.transform is not None or not isinstance(self.table, tables.ArrayTable):
            return None
        arrays = {f: self.table.arrays[f] for f in fields}
        if any(type(a) is not np.ndarray for a in arrays.values()):  # np.memmap: stays on disk
            return None
        return arrays

    # -- transforms -----------------------------------------------------------------------
    def _probe(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Run the transform on sample 0 (at construction: a wrong transform fails here)."""
        example = {f: v[0] for f, v in self.table.read(slice(0, 1), self.table.fields).items()}
        out = self._apply(example, 0, 0, 0)
        return {f: (np.shape(v), np.asarray(v).dtype) for f, v in out.items()}

    def _apply(self, example: dict, seed: int, epoch: int, index: int) -> dict:
        out = self.transform(example, sample_rng(seed, epoch, index))
        if not isinstance(out, Mapping) or not out:
            raise DataError(
                f"DataLoader transform returned {type(out).__name__} for sample {index}; it "
                f"must return a non-empty dict of per-sample arrays, e.g. {{'img': img, "
                f"'label': label}}."
            )
        return {k: as_array(k, v) for k, v in out.items()}

    def transform_rows(
        self, rows, epoch: int, seed: int, fields, *, on_sample=None
    ) -> dict[str, np.ndarray]:
        """One batch: `rows` read, transformed sample by sample, `fields` stacked.
        `on_sample(index)`, if given, is called as each sample's transform begins."""
        index = np.arange(*rows.indices(self.num_samples)) if isinstance(rows, slice) else rows
        raw = self.table.read(rows, self.table.fields)
        specs = self.out_specs or {}
        outs = []
        for j, i in enumerate(index):
            if on_sample is not None:
                on_sample(int(i))
            out = self._apply({f: v[j] for f, v in raw.items()}, seed, epoch, int(i))
            check_sample(out, specs, int(i))
            outs.append(out)
        return {f: np.stack([o[f] for o in outs]) for f in fields}

    def _transformed(self, rows: list, fields) -> Iterator[dict[str, np.ndarray]]:
        seed = 0 if self.seed is None else self.seed
        if not self.workers:
            for r in rows:
                yield self.transform_rows(r, self.epoch, seed, fields)
            return
        if self._pool is None or not self._pool.alive:  # a dead or stuck worker stops a pool
            from jaxnitro._src.data.workers import TransformPool

            self._pool = TransformPool(self, self.workers, timeout=self.worker_timeout)
        yield from self._pool.map(rows, self.epoch, seed, fields)

    def close(self) -> None:
        """Stop the transform workers (they also stop with this process)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def describe(self) -> str:
        """One line for the binding report: where the rows come from and who transforms."""
        how = "" if self.transform is None else f", transform in {self.workers} worker(s)"
        if self.transform is not None and not self.workers:
            how = ", transform in-process"
        return f"jn.DataLoader ({self.table.describe()}{how})"

    def __repr__(self) -> str:
        return (
            f"DataLoader({self.num_samples} samples, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}, fields={sorted(self.fields)}"
            + (f", workers={self.workers}" if self.transform is not None else "")
            + ")"
        )


def _check_transform(transform: Any, workers: int) -> None:
    """A transform is callable; workers run one (without it they would have nothing to do)."""
    if transform is not None and not callable(transform):
        raise DataError(
            f"DataLoader transform={transform!r} is not callable; pass a function "
            f"fn(example: dict, rng: np.random.Generator) -> dict."
        )
    if workers and transform is None:
        raise DataError(
            f"DataLoader workers={workers} runs transforms in processes, but no transform= "
            f"is given: without one, batches are gathered in this process (workers=0)."
        )


def _check_timeout(value) -> float | None:
    """`worker_timeout` as seconds (a number > 0), or None (no limit)."""
    if value is None:
        return None
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise DataError(
            f"DataLoader worker_timeout={value!r} is invalid: give the seconds a transform "
            f"worker may spend on one sample, a number > 0 (default 300), or None to wait "
            f"forever."
        )
    return float(value)


def sample_rng(seed: int, epoch: int, index: int) -> np.random.Generator:
    """The generator a transform receives for one sample: Philox keyed by (seed, epoch),
    with the sample index in the counter's second word, so every sample has its own stream
    (the first word counts within it) and nothing depends on the order samples are seen.

    Example:
        >>> sample_rng(42, 0, 7).random() == sample_rng(42, 0, 7).random()
        True
    """
    mask = (1 << 64) - 1
    bits = np.random.Philox(key=[seed & mask, epoch & mask], counter=[0, index & mask, 0, 0])
    return np.random.Generator(bits)


def check_sample(out: Mapping, specs: Mapping, index: int) -> None:
    """A transformed sample has the fields, shapes and dtypes of sample 0's."""
    if set(out) != set(specs):
        raise DataError(
            f"DataLoader transform returned fields {sorted(out)} for sample {index}, but "
            f"{sorted(specs)} for sample 0: return the same fields for every sample."
        )
    for f, (shape, dtype) in specs.items():
        v = out[f]
        if v.shape != shape or v.dtype != dtype:
            raise DataError(
                f"DataLoader transform returned field {f!r} with shape {v.shape} and dtype "
                f"{v.dtype} for sample {index}, but {shape} and {dtype} for sample 0. Samples "
                f"are stacked into batches: give every sample the same shape and dtype (crop "
                f"or pad to a fixed size, cast with .astype)."
            )


def _arrays(data) -> dict[str, np.ndarray]:
    if not isinstance(data, Mapping) or not data:
        raise DataError(
            f"DataLoader takes a non-empty dict of arrays {{field: array}}, got "
            f"{type(data).__name__}. Example: jn.DataLoader({{'img': x, 'label': y}}, 32) "
            f"(a Hugging Face datasets.Dataset works too, read by columns=)."
        )
    arrays = {k: as_array(k, v) for k, v in data.items()}
    scalars = [k for k, v in arrays.items() if v.ndim == 0]
    if scalars:
        raise DataError(
            f"DataLoader field {scalars[0]!r} is a scalar, without the leading (sample) "
            f"dimension every field needs (batch dimension first). Give it one row per "
            f"sample (np.full(n, value), or np.asarray(per_sample_values)), or make it an "
            f"experiment field."
        )
    sizes = {k: v.shape[0] for k, v in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise DataError(
            f"DataLoader fields must share their leading (sample) dimension; got {sizes}. "
            f"Batch dimension comes first: give every field one row per sample (transpose "
            f"or slice the ones that differ)."
        )
    return arrays


def skip(source: Iterable, start: int) -> Iterator:
    """Iterate `source` from batch index `start`. A DataLoader or a sequence (a list of
    batches) starts there without reading what comes before; any other iterable replays its
    first `start` batches (setup says so when a resume would do that: `replays`)."""
    if isinstance(source, DataLoader):
        return source.iter_from(start)
    if isinstance(source, Sequence) and not isinstance(source, (str, bytes)):
        return (source[i] for i in range(start, len(source)))
    return itertools.islice(iter(source), start, None)


def replays(source) -> bool:
    """Whether resuming `source` mid-epoch replays (reads again) the batches before the
    position: true for an iterable that cannot report or seek to one."""
    from jaxnitro._src.data import grain_source

    if isinstance(source, DataLoader) or grain_source.kind(source) is not None:
        return False
    return not (isinstance(source, Sequence) and not isinstance(source, (str, bytes)))
