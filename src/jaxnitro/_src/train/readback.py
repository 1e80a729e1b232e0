"""Reading step outputs back from the device: the epoch's in-flight calls, a chunk at a time.

Dispatches run ahead of the device; each call's outputs wait as an `InFlight` record until the
epoch reads a chunk of them back in one transfer: as columns over the chunk's steps
(`read_columns`, what the epoch builds its step lines from), or per call (`read_back`) turned
into per-step rows (`step_rows`) where a population's members or step callbacks need them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class InFlight(NamedTuple):
    """One dispatched train call whose outputs are not read back yet (a tuple: one is made
    per dispatch)."""

    step: int  # the optimizer step count after the call
    batch: int  # the batch position in the epoch after the call
    steps: int  # optimizer steps in the call (a fused call: steps_per_call)
    out: dict[str, Any]  # the call's outputs, on the device

    def first_output(self) -> Any:
        """One output array (None: the program returns none), to ask whether it is ready."""
        return next(iter(self.out.values()), None)


def failed_call(items: Sequence[InFlight]) -> tuple[int, int] | None:
    """The optimizer steps (first, last) of the oldest call in `items` whose outputs hold an
    error (an allocation that failed on the device), or None: each ran. Its error is why a
    later dispatch or read-back raised; the last dispatched step is not."""
    for item in items:
        try:
            jax.block_until_ready(item.out)
        except Exception:  # noqa: BLE001 - any failure of the call's execution
            return item.step - item.steps + 1, item.step
    return None


def _stacked(
    items: Sequence[InFlight], *, on_host: bool
) -> Iterator[tuple[int, list[str], np.ndarray]]:
    """Per run of equal shapes (a fused call and the single steps of an epoch's tail differ):
    the steps per call, the output names and their values on the host, shaped (calls,
    outputs, ...). On an
    accelerator: one device-side stack and one transfer, instead of a read per scalar. On a
    CPU (`on_host`) the outputs already lie in host memory and are read as they are: there
    the eager stack cost ~25 µs of the training thread per step, a read ~3 µs."""
    for steps, run in itertools.groupby(items, key=lambda item: item.steps):
        outs = [item.out for item in run]
        keys = list(outs[0])  # every output of one program has the same keys and shapes
        if on_host:
            if keys:  # one wait, for the run's newest call: each read that blocks costs the
                # training thread a wake-up (~10 µs a step in a busy epoch on 2 cores)
                try:
                    outs[-1][keys[0]].block_until_ready()
                except Exception:  # noqa: BLE001 - a call failed: the reads below raise the
                    pass  # first failed call's own error (a later call's names only its inputs)
            host = np.stack([np.asarray(o[k]) for o in outs for k in keys])
        else:
            flat = jnp.stack([o[k] for o in outs for k in keys])  # one device op, one transfer
            host = np.asarray(jax.device_get(flat))
        yield steps, keys, host.reshape((len(outs), len(keys)) + host.shape[1:])


def read_back(items: Sequence[InFlight], *, on_host: bool) -> list[dict[str, np.ndarray]]:
    """The outputs as host arrays, one dict per call (read as `_stacked` reads them)."""
    hosts: list[dict[str, np.ndarray]] = []
    for _, keys, host in _stacked(items, on_host=on_host):
        hosts += [{k: host[i, j] for j, k in enumerate(keys)} for i in range(host.shape[0])]
    return hosts


def read_columns(items: Sequence[InFlight], *, on_host: bool) -> dict[str, np.ndarray] | None:
    """The outputs of one scalar per step as columns: name -> (steps,) over every step of
    `items`, in step order (one transfer, as `read_back`). None when the calls' outputs
    differ in names or an output is not one value per step (the caller then reads per
    call)."""
    parts: dict[str, list[np.ndarray]] = {}
    names: list[str] | None = None
    for steps, keys, host in _stacked(items, on_host=on_host):
        if host.shape[2:] != ((steps,) if steps > 1 else ()):
            return None
        if names is None:
            names = keys
            parts = {k: [] for k in keys}
        elif keys != names:
            return None
        for j, k in enumerate(keys):
            parts[k].append(host[:, j].reshape(-1))  # (calls, steps per call) in step order
    return {k: v[0] if len(v) == 1 else np.concatenate(v) for k, v in parts.items()}


@dataclasses.dataclass(frozen=True)
class StepRow:
    """One optimizer step's outputs, read back."""

    step: int  # 1-based: the step count after it
    batch: int  # the batch position in the epoch before it
    values: dict[str, float]


def step_rows(
    item: InFlight, host: dict[str, np.ndarray], *, accum: int, members: bool
) -> Iterator[StepRow]:
    """A call's outputs as one row per optimizer step (a fused call returns one per step)."""
    steps = item.steps
    for j in range(steps):
        if members:
            values = member_row({k: np.asarray(v).reshape(steps, -1)[j] for k, v in host.items()})
        else:
            values = {
                k: float(np.asarray(v).reshape(-1)[j] if steps > 1 else v) for k, v in host.items()
            }
        yield StepRow(item.step - steps + 1 + j, item.batch - (steps - j) * accum, values)


def member_row(values: dict[str, np.ndarray]) -> dict[str, float]:
    """One step's outputs for every member (name -> (members,)) as `name/i` per member and
    the members' mean under the name (skipped: 1 only when every member skipped)."""
    row: dict[str, float] = {}
    skipped = values.get("skipped")
    for k, arr in values.items():
        for i, v in enumerate(arr):
            row[f"{k}/{i}"] = float(v)
        if k == "skipped":
            row[k] = float(np.all(arr > 0))
            continue
        kept = arr if skipped is None else arr[skipped == 0]
        finite = kept[np.isfinite(kept)]
        row[k] = float(finite.mean()) if finite.size else float("nan")
    return row
