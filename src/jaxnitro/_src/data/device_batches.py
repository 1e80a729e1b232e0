"""An in-order train split's batches, put on the device once and taken from there.

A `jn.DataLoader` without shuffling over in-memory arrays reads the same rows in the same
order every epoch. Its batches are transferred once, in the shapes the train program takes
them ((steps, micro-batches, batch, ...), leading axes of size 1 dropped), and kept: a step
then takes its batch the way a hand loop with its batches already on the device does, with
no row gather and no copy inside the program (on XLA:CPU a gathered batch of 1024 × 784
floats costs about 1 ms a step, a quarter of that MLP's step).

A shuffled split keeps its arrays whole on the device instead and the train program gathers
each batch's rows (`programs/builders.py`): its batches differ every epoch.

The pieces are keyed by their first row. A piece is put when first asked for; one that
overlaps it (another `steps_per_call`, or the first epoch after a resume mid-epoch, whose
calls start at other rows) is dropped first, so the pieces never hold more than the arrays
once. Only the feed calls this, from one thread at a time.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping

import jax
import numpy as np


class DeviceBatches:
    """The batches of arrays `{field: (rows, ...)}` of `batch_size` rows, on the device."""

    def __init__(self, arrays: Mapping[str, np.ndarray], batch_size: int, sharding):
        self.arrays = dict(arrays)
        self.batch_size = batch_size
        self.sharding = sharding
        self.nbytes = sum(a.nbytes for a in self.arrays.values())
        self._pieces: dict[int, tuple[int, tuple[int, ...], dict]] = {}  # lo -> (hi, lead, arrays)
        self._starts: list[int] = []  # the pieces' first rows, sorted (they never overlap)
        self.puts = 0  # pieces transferred so far (a later epoch in order transfers none)

    def get(self, first_row: int, lead: tuple[int, ...]) -> dict:
        """The batch(es) of `prod(lead)` × `batch_size` rows from `first_row` on, shaped
        `lead + (batch_size, ...)`: the piece kept on the device, put there if missing."""
        kept = self._pieces.get(first_row)
        if kept is not None and kept[1] == lead:
            return kept[2]
        self.put([(first_row, lead)])
        return self._pieces[first_row][2]

    def put(self, wanted: list[tuple[int, tuple[int, ...]]]) -> int:
        """Put the pieces `[(first row, lead)]` that are not kept yet, in one transfer per
        field (much cheaper than one per piece for small batches); returns how many."""
        missing = []
        for lo, lead in wanted:
            kept = self._pieces.get(lo)
            if kept is None or kept[1] != lead:
                missing.append((lo, lo + math.prod(lead) * self.batch_size, lead))
        if not missing:
            return 0
        moved = {}
        for f, a in self.arrays.items():
            host = [
                a[lo:hi].reshape(lead + (self.batch_size,) + a.shape[1:])
                for lo, hi, lead in missing
            ]
            moved[f] = jax.device_put(host, self.sharding)
        for i, (lo, hi, lead) in enumerate(missing):
            self._drop_overlapping(lo, hi)
            self._pieces[lo] = (hi, lead, {f: moved[f][i] for f in self.arrays})
            bisect.insort(self._starts, lo)
        self.puts += len(missing)
        return len(missing)

    @property
    def kept_bytes(self) -> int:
        """The bytes of the pieces on the device now (at most `nbytes`)."""
        return sum(a.nbytes for _, _, p in self._pieces.values() for a in p.values())

    def _drop_overlapping(self, lo: int, hi: int) -> None:
        i = bisect.bisect_left(self._starts, hi)  # the pieces starting before `hi`...
        while i > 0:
            start = self._starts[i - 1]
            if self._pieces[start][0] <= lo:  # ...and ending after `lo` (sorted: stop here)
                break
            del self._pieces[start]
            del self._starts[i - 1]
            i -= 1
