"""Feeding a run's programs: host batches to device payloads, in the prefetch thread.

Train batches are grouped into dispatch units (`steps_per_call` × `accum` batches), checked,
stacked to (steps, micro-batches, batch, ...) and transferred, with the packed per-step
hyperparameters (scheduled rates, scalar Device values) evaluated for the unit's steps.
"""

from __future__ import annotations

import jax
import numpy as np

from . import data as data_mod
from .errors import DataError


def _put(n, array, sharding):
    """To the device; on a single CPU device the compiled call takes numpy directly, which
    costs far less than an explicit transfer (the device memory *is* host memory)."""
    return array if n.direct_feed else jax.device_put(array, sharding)


def eval_prepare(n, split: str, pad_to: int | None):
    """Host batch -> (device batch padded to `pad_to`, real rows), for eval and predict."""
    info = n.batch_info[split]
    index = [0]

    def prepare(host):
        size = data_mod.check_batch(host, split, expect_fields=info["keys"])
        data_mod.check_specs(host, split, index[0], info["specs"])
        index[0] += 1
        if pad_to is not None and size < pad_to:
            host = data_mod.pad_batch({k: host[k] for k in info["fields"]}, pad_to)
        return {f: _put(n, np.asarray(host[f]), n.batch_sharding) for f in info["fields"]}, size

    return prepare


def train_units(n, loader, start: int, epoch: int):
    """Dispatch units of `steps_per_call` × `accum` train batches from batch `start`, as
    ({field: (k, batch, ...)}, k). A DataLoader gathers each unit at once; any other source
    is checked batch by batch (fields, sizes) and stacked."""
    info = n.batch_info["train"]
    size = n.accum * n.steps_per_call
    if isinstance(loader, data_mod.DataLoader):
        yield from loader.iter_stacked(start, size, info["fields"])
        return
    bs = info["batch_size"]
    group: list = []
    for index, host in enumerate(data_mod.skip(loader, start), start):
        got = data_mod.check_batch(host, "train", expect_fields=info["keys"])
        data_mod.check_specs(host, "train", index, info["specs"])
        if got != bs:
            raise DataError(
                f"a train batch of epoch {epoch + 1} has {got} samples, not {bs}: a short "
                f"train batch would need its own program. Drop it (drop_last=True) or make "
                f"the split divide by the batch size."
            )
        group.append(host)
        if len(group) == size:
            yield _stack(group, info["fields"]), size
            group = []
    if group:
        yield _stack(group, info["fields"]), len(group)


def first_unit(n, loader) -> tuple[dict, int]:
    """The first dispatch unit, for planning programs: a DataLoader gathers it (no side
    effects); any other source repeats its peeked first batch (only the shapes matter), so
    planning never iterates a source the run is about to train on."""
    info = n.batch_info["train"]
    size = n.accum * n.steps_per_call
    if isinstance(loader, data_mod.DataLoader):
        return next(loader.iter_stacked(0, size, info["fields"]))
    k = min(size, len(loader)) if hasattr(loader, "__len__") else size
    return _stack([info["first"]] * k, info["fields"]), k


def _stack(group, fields) -> dict:
    if len(group) == 1:  # a view, no copy
        return {f: np.asarray(group[0][f])[None] for f in fields}
    return {f: np.stack([np.asarray(h[f]) for h in group]) for f in fields}


def train_prepare(n, epoch: int):
    """A unit -> [(device batch, packed hyperparameters, optimizer steps)], in order.

    Runs in the prefetch thread: reshapes the unit to (steps, micro-batches, batch, ...)
    (leading axes of size 1 dropped), transfers it, and evaluates the schedules for its steps.
    """
    accum, spc = n.accum, n.steps_per_call
    next_step = [n.host_step]
    constant: dict[int, object] = {}  # nothing scheduled: one vector serves every step
    shardings: dict[int, object] = {}

    def hyper_for(first: int, s: int):
        if not n.schedules.fns and s in constant:
            return constant[s]
        hv = (
            np.stack([n.hyper_values(t) for t in range(first, first + s)])
            if s > 1
            else n.hyper_values(first)
        )
        # Scheduled or constant, the same kind of input: the program must not depend on it.
        arr = _put(n, hv, n._rep)
        if not n.schedules.fns:
            constant[s] = arr
        return arr

    def prepare(item):
        stacked, k = item
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
                sharding = shardings[len(lead)] = data_mod.batch_sharding(n.mesh, axis=len(lead))
            batch = {}
            for f, arr in stacked.items():
                if not lead:  # one step, one micro-batch: the batch itself
                    batch[f] = _put(n, arr[offset], sharding)
                    continue
                part = arr[offset : offset + s * accum]
                batch[f] = _put(n, part.reshape(lead + part.shape[1:]), sharding)
            first = next_step[0]
            next_step[0] += s
            payloads.append((batch, hyper_for(first, s), s))
        return payloads, k

    return prepare
