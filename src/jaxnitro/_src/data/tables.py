"""Row tables under `jn.DataLoader`: reading the rows of a batch, only the fields asked for.

A table is what a DataLoader samples from: `num_rows`, `fields` and `read(rows, fields)`, where
`rows` is a slice or an array of row indices. Two kinds:

- `ArrayTable`: a dict of batch-first arrays, in memory or memory-mapped (`np.load(path,
  mmap_mode="r")`, `np.memmap`). A memory-mapped array is never read whole: each batch reads
  its rows (in ascending order, so a shuffled batch touches the file front to back).
- `ArrowTable`: a Hugging Face `datasets.Dataset` (arrow-backed: from local files it is memory
  mapped) by column names. A batch is one arrow `take` of the selected columns, converted to
  numpy without going through Python objects.
"""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxnitro._src.core.errors import DataError


def is_hf_dataset(value) -> bool:
    """A Hugging Face `datasets.Dataset` (checked by type name: `datasets` is optional)."""
    return any(
        c.__name__ == "Dataset" and c.__module__.startswith("datasets.")
        for c in type(value).__mro__
    )


class ArrayTable:
    """Rows of a dict of batch-first numpy arrays (memory-mapped ones stay on disk)."""

    def __init__(self, arrays: Mapping[str, np.ndarray]):
        self.arrays = dict(arrays)
        self.fields = tuple(self.arrays)
        self.num_rows = int(next(iter(self.arrays.values())).shape[0])

    def read(self, rows, fields: Sequence[str]) -> dict[str, np.ndarray]:
        return {f: _take(self.arrays[f], rows) for f in fields}

    def describe(self) -> str:
        mapped = [f for f, v in self.arrays.items() if isinstance(v, np.memmap)]
        return f"memory-mapped {mapped}" if mapped else "in memory"

    def check_files(self) -> None:
        """Refuse a memory-mapped field whose file is shorter than its mapping: reading a
        page past the file's end kills the process with SIGBUS, with no message. Called
        before each pass reads a row (a file can shrink under a running job)."""
        for field, array in self.arrays.items():
            extent = file_extent(array)
            if extent is None or extent.actual >= extent.expected:
                continue
            raise DataError(
                f"DataLoader field {field!r} is memory-mapped from {extent.path}, which is "
                f"{extent.actual} bytes long, but its header and shape need "
                f"{extent.expected} bytes: the file was truncated (or rewritten) after it "
                f"was loaded. Reading its missing rows would kill this process with SIGBUS. "
                f"Write the file again in full (np.save), load it again with "
                f"np.load(path, mmap_mode='r'), and do not rewrite a data file while a run "
                f"reads it."
            )


@dataclasses.dataclass(frozen=True)
class FileExtent:
    """How long a memory-mapped array's file must be (bytes), and how long it is."""

    path: str
    expected: int
    actual: int


def file_extent(array: np.ndarray) -> FileExtent | None:
    """The file behind a memory-mapped array (a view of one too), the bytes its mapping
    covers and the bytes the file has now; None for an array in memory.

    The mapped file is asked through the map itself (Python's mmap keeps its own descriptor),
    so a file replaced under the same name is judged by the inode that is mapped.

    Example:
        >>> np.save("x.npy", np.zeros((1000, 8), np.float32))
        >>> e = file_extent(np.load("x.npy", mmap_mode="r"))
        >>> e.expected == e.actual == 128 + 1000 * 8 * 4
        True
    """
    base: object = array
    offset, path = None, "a memory-mapped file"
    while base is not None and not isinstance(base, mmap.mmap):
        if isinstance(base, np.memmap) and offset is None:
            offset = int(base.offset)  # views keep the offset of the map they come from
            path = str(base.filename)
        base = base.obj if isinstance(base, memoryview) else getattr(base, "base", None)
    if not isinstance(base, mmap.mmap):
        return None
    try:
        actual = base.size()
    except (OSError, ValueError):  # an anonymous (shared-memory) map, or a closed one
        return None
    # numpy maps from the offset rounded down to the allocation granularity; without an
    # np.memmap in the chain the start is unknown and taken as 0 (never a false refusal).
    start = 0 if offset is None else offset - offset % mmap.ALLOCATIONGRANULARITY
    return FileExtent(path, start + len(base), actual)


def _take(array: np.ndarray, rows) -> np.ndarray:
    if isinstance(rows, slice) or not isinstance(array, np.memmap):
        return array[rows]
    # Gather a memory map in file order (sequential reads), then put the rows back in place.
    order = np.argsort(rows, kind="stable")
    out = np.empty((len(rows),) + array.shape[1:], array.dtype)
    out[order] = array[rows[order]]
    return out


class ArrowTable:
    """Rows of a Hugging Face `datasets.Dataset`, column by column, as numpy arrays.

    Args:
        dataset: the `datasets.Dataset` (its indices mapping, from `select`/`shuffle`, holds).
        columns: the columns to use: a list of names, or {field: column} to rename; None
            uses every column.
    """

    def __init__(self, dataset, columns: Sequence[str] | Mapping[str, str] | None = None):
        names = list(dataset.column_names)
        if columns is None:
            mapping = {c: c for c in names}
        elif isinstance(columns, Mapping):
            mapping = dict(columns)
        elif isinstance(columns, (list, tuple)):
            mapping = {c: c for c in columns}
        else:
            raise DataError(
                f"DataLoader columns={columns!r}: give a list of column names, e.g. "
                f"columns=['image', 'label'], or a dict {{field: column}} to rename them."
            )
        missing = [c for c in mapping.values() if c not in names]
        if missing:
            from jaxnitro._src.core.errors import did_you_mean

            raise DataError(
                f"DataLoader columns {missing} are not in the dataset, whose columns are "
                f"{names}." + did_you_mean(missing[0], names)
            )
        if not mapping:
            raise DataError("DataLoader columns=[] selects nothing; name at least one column.")
        self.dataset = dataset
        self.columns = mapping
        self.fields = tuple(mapping)
        self.num_rows = len(dataset)
        self._arrow = dataset.with_format("arrow")
        self._specs: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        if self.num_rows:
            first = self.read(slice(0, 1), self.fields, _learn=True)
            self._specs = {f: (v.shape[1:], v.dtype) for f, v in first.items()}

    def read(self, rows, fields: Sequence[str], *, _learn: bool = False) -> dict[str, np.ndarray]:
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(self.num_rows))
        table = self._arrow[np.asarray(rows, dtype=np.int64)]
        out = {}
        for f in fields:
            out[f] = self._column(f, table.column(self.columns[f]), len(rows), _learn)
        return out

    def _column(self, field: str, column, n: int, learn: bool) -> np.ndarray:
        import pyarrow as pa

        col = column.combine_chunks()
        dims = []
        while (
            pa.types.is_list(col.type)
            or pa.types.is_large_list(col.type)
            or (pa.types.is_fixed_size_list(col.type))
        ):
            lengths = col.value_lengths().to_numpy(zero_copy_only=False)
            if len(lengths) and (lengths != lengths[0]).any():
                raise DataError(
                    f"column {self.columns[field]!r} holds lists of different lengths "
                    f"({sorted(set(lengths.tolist()))[:4]}...): a batch field needs one shape "
                    f"per sample. Pad or truncate it (dataset.map), or pass transform= to build "
                    f"fixed-shape arrays."
                )
            dims.append(int(lengths[0]) if len(lengths) else 0)
            col = col.flatten()
        values = col.to_numpy(zero_copy_only=False)
        if values.dtype == object or values.dtype.kind in "OUSV":
            raise DataError(
                f"column {self.columns[field]!r} has arrow type {column.type}, which is not "
                f"numeric (strings, images or structs cannot go to a device). Encode it as "
                f"numbers first (dataset.map to token ids or pixel arrays), or leave it out of "
                f"columns=."
            )
        shape = tuple(dims)
        if not learn and shape != self._specs[field][0]:
            raise DataError(
                f"column {self.columns[field]!r}: rows with per-sample shape {shape}, but the "
                f"first row has {self._specs[field][0]}. A batch field needs one shape per "
                f"sample: pad or truncate it (dataset.map), or pass transform= to fix it."
            )
        return values.reshape((n,) + shape)

    def describe(self) -> str:
        return f"datasets.Dataset columns {dict(self.columns)}"


def table_of(data, columns) -> Any:
    """The table behind a DataLoader's `data` (a dict of arrays or a `datasets.Dataset`)."""
    if is_hf_dataset(data):
        return ArrowTable(data, columns)
    if columns is not None:
        raise DataError(
            "DataLoader columns= selects the columns of a Hugging Face datasets.Dataset; for "
            "a dict of arrays pass only the fields you want in the dict."
        )
    return None
