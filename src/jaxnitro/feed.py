"""Feeding a run's programs: host batches to device payloads, in the prefetch thread.

Train batches are grouped into dispatch units (`steps_per_call` × `accum` batches), checked,
stacked to (steps, micro-batches, batch, ...) and transferred, with the packed per-step
hyperparameters (scheduled rates, scalar Device values) evaluated for the unit's steps.
Everything here reads a `RunSpec`; nothing writes the handle.
"""

from __future__ import annotations

import jax
import numpy as np

from . import data as data_mod
from .errors import DataError


def put(spec, array, sharding):
    """To the device; on a single CPU device the compiled call takes numpy directly, which
    costs far less than an explicit transfer (the device memory *is* host memory). With
    several processes, `array` is this process's part and the result a global array."""
    if spec.direct_feed:
        return array
    if jax.process_count() > 1:
        return global_array(array, sharding)
    return jax.device_put(array, sharding)


def global_array(local: np.ndarray, sharding) -> jax.Array:
    """This process's rows -> the global array (the processes' rows in process order).

    A replicated input (hyperparameters) is the same on every process: each process places
    its copy, with no cross-process check. A batch passes `global_shape` explicitly: inferred,
    a process with other rows would silently build another global batch than its peers.
    """
    if sharding.is_fully_replicated:
        return jax.make_array_from_callback(local.shape, sharding, lambda index: local[index])
    shape = list(local.shape)
    axis, factor = _process_split(sharding)
    shape[axis] *= factor
    return jax.make_array_from_process_local_data(sharding, local, tuple(shape))


def _process_split(sharding) -> tuple[int, int]:
    """(the axis split over `data`, by how many process-local parts it is split): the data
    positions of the mesh over those this process addresses (with a `model` axis across
    processes, several processes hold the same rows)."""
    spec = tuple(sharding.spec)
    axis = next(i for i, entry in enumerate(spec) if entry == "data")
    mesh = sharding.mesh
    data = mesh.axis_names.index("data")
    me = jax.process_index()
    mine = {index[data] for index, d in np.ndenumerate(mesh.devices) if d.process_index == me}
    return axis, mesh.shape["data"] // max(1, len(mine))


class ShapeCheck:
    """With several processes, a batch whose shape differs from the other processes' fails
    naming both shapes, before it is turned into a global array (which would otherwise hang
    in the program's first collective, or compute on a batch the peers never saw).

    The shapes are compared through the coordination service (with a timeout) at the first
    batch of each feed and at every batch whose shape differs from the last compared one: a
    cost per distinct shape, not per batch. A process whose shape changes alone waits for
    its peers' report of the same batch; it never comes, and the timeout names both shapes.
    """

    def __init__(self, spec, split: str):
        self.active = jax.process_count() > 1
        self.split = split
        self.last: dict | None = None

    def __call__(self, index: int, batch: dict) -> None:
        if not self.active:
            return
        shapes = {f: [list(np.shape(a)), str(np.asarray(a).dtype)] for f, a in batch.items()}
        if shapes == self.last:
            return
        from . import distributed

        try:
            distributed.check_same(
                f"batch-shape/{self.split}/{index}",
                shapes,
                what=f"the shape of {self.split!r} batch {index} ({{field: [shape, dtype]}})",
                fix="Every process must yield batches of the same shape (the global batch is "
                "their concatenation): give each process an equal share of the rows, with "
                "drop_last=True for training.",
            )
        except distributed.DistributedError as e:
            if self.last is None or "waited for" not in str(e):
                raise DataError(str(e)) from e
            raise DataError(
                f"the {self.split!r} batch {index} of process {jax.process_index()} has "
                f"shape {shapes}, but its earlier batches had {self.last}, and the other "
                f"processes did not change shape at this batch (they still have "
                f"{self.last}). Every process must yield batches of the same shape: give "
                f"each an equal share of the rows (drop_last=True for training)."
            ) from e
        self.last = shapes


def eval_prepare(spec, split: str, pad_to: int | None):
    """Host batch -> (device batch padded to `pad_to`, real rows), for eval and predict."""
    info = spec.split_specs[split]
    index = [0]

    same = ShapeCheck(spec, split)

    def prepare(host):
        size = data_mod.check_batch(host, split, expect_fields=info.keys)
        data_mod.check_specs(host, split, index[0], info.specs)
        same(index[0], {f: host[f] for f in info.fields})
        index[0] += 1
        if pad_to is not None and size < pad_to:
            host = data_mod.pad_batch({k: host[k] for k in info.fields}, pad_to)
        return {f: put(spec, np.asarray(host[f]), spec.batch_sharding) for f in info.fields}, size

    return prepare


def train_units(spec, loader, start: int, epoch: int):
    """Dispatch units of `steps_per_call` × `accum` train batches from batch `start`, as
    ({field: (k, batch, ...)}, k). A DataLoader gathers each unit at once; any other source
    is checked batch by batch (fields, sizes) and stacked."""
    info = spec.split_specs["train"]
    size = spec.accum * spec.steps_per_call
    if isinstance(loader, data_mod.DataLoader):
        yield from loader.iter_stacked(start, size, info.fields)
        return
    bs = info.batch_size
    group: list = []
    for index, host in enumerate(data_mod.skip(loader, start), start):
        got = data_mod.check_batch(host, "train", expect_fields=info.keys)
        data_mod.check_specs(host, "train", index, info.specs)
        if got != bs:
            raise DataError(
                f"a train batch of epoch {epoch + 1} has {got} samples, not {bs}: a short "
                f"train batch would need its own program. Drop it (drop_last=True) or make "
                f"the split divide by the batch size."
            )
        group.append(host)
        if len(group) == size:
            yield _stack(group, info.fields), size
            group = []
    if group:
        yield _stack(group, info.fields), len(group)


def first_unit(spec, loader) -> tuple[dict, int]:
    """The first dispatch unit, for planning programs: a DataLoader gathers it (no side
    effects); any other source repeats its peeked first batch (only the shapes matter), so
    planning never iterates a source the run is about to train on."""
    info = spec.split_specs["train"]
    size = spec.accum * spec.steps_per_call
    if isinstance(loader, data_mod.DataLoader):
        return next(loader.iter_stacked(0, size, info.fields))
    k = min(size, len(loader)) if hasattr(loader, "__len__") else size
    return _stack([info.first] * k, info.fields), k


def _stack(group, fields) -> dict:
    if len(group) == 1:  # a view, no copy
        return {f: np.asarray(group[0][f])[None] for f in fields}
    return {f: np.stack([np.asarray(h[f]) for h in group]) for f in fields}


def train_prepare(spec, first_step: int, base):
    """A unit -> [(device batch, packed hyperparameters, optimizer steps)], in order.

    Runs in the prefetch thread: reshapes the unit to (steps, micro-batches, batch, ...)
    (leading axes of size 1 dropped), transfers it, and packs the per-step hyperparameters of
    its steps (from `first_step` on; `base` holds the unscheduled values).
    """
    accum, spc = spec.accum, spec.steps_per_call
    next_step = [first_step]
    hyper = _HyperFeed(spec, base)
    shardings: dict[int, object] = {}
    same = ShapeCheck(spec, "train")

    def prepare(item):
        stacked, k = item
        same(next_step[0], stacked)
        if k % accum:
            raise DataError(
                f"the train split ended with {k % accum} batch(es) that do not fill an "
                f"accumulation group of accum={accum}. Make the number of batches per epoch a "
                f"multiple of accum."
            )
        steps = k // accum
        # A tail that does not fill a call runs step by step (the single-step program).
        splits = [(0, spc)] if steps == spc else [(i * accum, 1) for i in range(steps)]
        payloads = []
        for offset, s in splits:
            lead = (s,) * (s > 1) + (accum,) * (accum > 1)
            sharding = shardings.get(len(lead))
            if sharding is None:
                sharding = shardings[len(lead)] = data_mod.batch_sharding(spec.mesh, axis=len(lead))
            batch = {}
            for f, arr in stacked.items():
                if not lead:  # one step, one micro-batch: the batch itself
                    batch[f] = put(spec, arr[offset], sharding)
                    continue
                part = arr[offset : offset + s * accum]
                batch[f] = put(spec, part.reshape(lead + part.shape[1:]), sharding)
            payloads.append((batch, hyper.at(next_step[0], s), s))
            next_step[0] += s
        return payloads, k

    return prepare


class _HyperFeed:
    """The packed hyperparameters of `s` steps from a step on, on the device. Nothing
    scheduled: one array per `s` serves every call."""

    def __init__(self, spec, base):
        self.spec, self.base = spec, base
        self.constant: dict[int, object] = {}

    def at(self, first: int, s: int):
        spec = self.spec
        scheduled = bool(spec.schedules.fns)
        if not scheduled and s in self.constant:
            return self.constant[s]
        pack = spec.hyper.pack
        hv = (
            np.stack([pack(t, spec.schedules, self.base) for t in range(first, first + s)])
            if s > 1
            else pack(first, spec.schedules, self.base)
        )
        # Scheduled or constant, the same kind of input: the program must not depend on it.
        arr = put(spec, hv, spec.replicated)
        if not scheduled:
            self.constant[s] = arr
        return arr
