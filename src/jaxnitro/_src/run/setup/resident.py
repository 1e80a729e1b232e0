"""Setup, [7]: the train split kept on the device when it fits (`resident_data`), cut into
batches there once per epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.data import batches
from jaxnitro._src.data import loader as data_mod
from jaxnitro._src.data.device_batches import DeviceBatches
from jaxnitro._src.dist.devices import replicated
from jaxnitro._src.run.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Mapping

    from jax.sharding import Mesh

    from jaxnitro._src.core.types import Source
    from jaxnitro._src.data.splits import SplitSpec
    from jaxnitro._src.run.setup.data import Dist
    from jaxnitro._src.steps.population import Population

#: The share of the device's capacity the train arrays may take to stay on it by default.
RESIDENT_FRACTION = 0.25

#: The smallest call's worth of batches (steps_per_call × accum batches, all fields) an
#: in-order split is cut into on the device; below it the batches are gathered in the program
#: like a shuffled split's. Measured on a 2-core CPU: each piece put costs about 85 µs and
#: gathering about 0.35 ms per MB in the step, so a piece from about 256 KiB repays its
#: transfer within the first epoch (at 100 KiB, cut and gathered batches train equally fast
#: and gathering sets up faster).
CUT_MIN_CALL_BYTES = 256 * 1024


def resident_data(
    s: Settings,
    splits: Mapping[str, Source],
    split_specs: Mapping[str, SplitSpec],
    mesh: Mesh,
    dist: Dist,
    pop: Population | None,
) -> tuple[Any, Any]:
    """(the train arrays placed on the device whole, the train batches cut on the device),
    at most one of them set; (None, None): each batch is sent. By default when the train
    split is a `jn.DataLoader` over in-memory arrays, the run has one device and one process,
    and the arrays take at most `RESIDENT_FRACTION` of the device's capacity;
    `data_on_device=True` requires it, False turns it off. A shuffled split keeps its arrays
    whole and the train program gathers each batch's rows; an in-order one is cut into its
    batches once (`data/device_batches.py`) when a call's batches take at least
    `CUT_MIN_CALL_BYTES`.
    Either way the same rows, bitwise."""
    arrays = _resident_arrays(s, splits, split_specs, mesh, dist, pop)
    if arrays is None:
        return None, None
    loader = splits["train"]
    spc = s.steps_per_call if isinstance(s.steps_per_call, int) else 1  # "auto": not known
    call_bytes = s.accum * spc * loader.batch_size * sum(a[:1].nbytes for a in arrays.values())
    if loader.shuffle or call_bytes < CUT_MIN_CALL_BYTES:
        rep = replicated(mesh)
        return {f: jax.device_put(a, rep) for f, a in arrays.items()}, None
    kept = DeviceBatches(arrays, loader.batch_size, batches.batch_sharding(mesh))
    return None, kept


def _resident_arrays(
    s: Settings,
    splits: Mapping[str, Source],
    split_specs: Mapping[str, SplitSpec],
    mesh: Mesh,
    dist: Dist,
    pop: Population | None,
) -> Mapping[str, Any] | None:
    """The train split's host arrays when they can stay on the device, else None."""
    if s.data_on_device is False or "train" not in splits:
        return None
    loader, info = splits["train"], split_specs["train"]
    arrays = (
        loader.resident_arrays(info.fields) if isinstance(loader, data_mod.DataLoader) else None
    )
    why = None
    if arrays is None:
        why = "the train split is not a jn.DataLoader over in-memory numpy arrays"
    elif mesh.size != 1 or dist.process_count != 1:
        why = f"the run has {mesh.size} devices over {dist.process_count} process(es)"
    elif pop is not None:
        why = "a population trains on the arrays as they are sent"
    if why is None and arrays is not None:
        from jaxnitro._src.compile.memory import device_capacity, format_bytes

        size = sum(a.nbytes for a in arrays.values())
        capacity, source = device_capacity(mesh.devices.flat[0], s.memory_budget)
        if size > RESIDENT_FRACTION * capacity and s.data_on_device is not True:
            return None  # does not fit comfortably: send the batches
        if size > capacity:
            why = f"its arrays take {format_bytes(size)}, more than the {source}"
    if why is not None or arrays is None:
        if s.data_on_device:
            raise ConfigError(
                f"data_on_device=True, but {why}. Drop the option (batches are then sent "
                f"per step), or train from a jn.DataLoader over numpy arrays on one device."
            )
        return None
    return arrays
