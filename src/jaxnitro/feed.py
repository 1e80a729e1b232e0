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


def eval_prepare(n, split: str, pad_to: int | None):
    """Host batch -> (device batch padded to `pad_to`, real rows), for eval and predict."""
    info = n.batch_info[split]

    def prepare(host):
        size = data_mod.check_batch(host, split, expect_fields=info["keys"])
        if pad_to is not None and size < pad_to:
            host = data_mod.pad_batch({k: host[k] for k in info["fields"]}, pad_to)
        return data_mod.place(host, info["fields"], n.batch_sharding), size

    return prepare


def units(source, size: int):
    """Group host batches into dispatch units of `size` (the last may be shorter)."""
    if size == 1:
        for b in source:
            yield [b]
        return
    unit = []
    for b in source:
        unit.append(b)
        if len(unit) == size:
            yield unit
            unit = []
    if unit:
        yield unit


def train_prepare(n, epoch: int):
    """Host unit -> [(device batch, packed hyperparameters, optimizer steps)], in order.

    Runs in the prefetch thread: checks, stacks (spc, accum, batch, ...) and transfers the
    batches, and evaluates the schedules for the unit's steps.
    """
    info = n.batch_info["train"]
    bs, accum, spc = info["batch_size"], n.accum, n.steps_per_call
    next_step = [n.host_step]

    constant: dict[int, jax.Array] = {}  # nothing scheduled: one device vector serves all steps

    def hyper_for(first: int, s: int):
        if not n.schedules.fns and s in constant:
            return constant[s]
        hv = np.stack([n.hyper_values(t) for t in range(first, first + s)]) if s > 1 \
            else n.hyper_values(first)
        arr = jax.device_put(hv, n._rep)
        if not n.schedules.fns:
            constant[s] = arr
        return arr

    def prepare(unit):
        for host in unit:
            size = data_mod.check_batch(host, "train", expect_fields=info["keys"])
            if size != bs:
                raise DataError(
                    f"a train batch of epoch {epoch + 1} has {size} samples, not {bs}: a short "
                    f"train batch would need its own program. Drop it (drop_last=True) or make "
                    f"the split divide by the batch size.")
        if len(unit) % accum:
            raise DataError(
                f"the train split ended with {len(unit) % accum} batch(es) that do not fill an "
                f"accumulation group of accum={accum}. Make the number of batches per epoch a "
                f"multiple of accum.")
        steps = len(unit) // accum
        groups = [(unit, spc)] if steps == spc else [
            (unit[i * accum:(i + 1) * accum], 1) for i in range(steps)]
        payloads = []
        for group, s in groups:
            lead = (s,) * (s > 1) + (accum,) * (accum > 1)
            batch = {}
            for f in info["fields"]:
                arr = np.stack([np.asarray(h[f]) for h in group]) if lead else np.asarray(group[0][f])
                batch[f] = jax.device_put(arr.reshape(lead + arr.shape[1 if lead else 0:]) if lead
                                          else arr, data_mod.batch_sharding(n.mesh, axis=len(lead)))
            first = next_step[0]
            next_step[0] += s
            payloads.append((batch, hyper_for(first, s), s))
        return payloads, len(unit)

    return prepare


