"""Setup, [4]: the data. `build_data` with this process's `Dist`, `derive`, and the checks on
the first batches of each split (their routing, shapes, and that every process agrees)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError, DataError, HookError, did_you_mean
from jaxnitro._src.data import grain_source
from jaxnitro._src.data import loader as data_mod
from jaxnitro._src.data.batches import batch_specs, check_batch, check_same_specs
from jaxnitro._src.data.splits import SplitSpec
from jaxnitro._src.dist import distributed
from jaxnitro._src.dist import sharding as sharding_mod
from jaxnitro._src.experiment import hooks
from jaxnitro._src.experiment.markers import replace

if TYPE_CHECKING:
    from jax.sharding import Mesh, NamedSharding

    from jaxnitro._src.core.types import Hooked, Source
    from jaxnitro._src.experiment.hooks import Route


@dataclasses.dataclass(frozen=True)
class Dist:
    """What `build_data(self, dist)` learns about the run, so each process loads its shard.

    With several processes each process's loader yields its own rows of every global batch
    (the global batch is the processes' batches in process order), so the batch size a
    loader gives is the global one divided by `data_count` (`process_count`, unless a `model`
    mesh axis spans processes: those feed identical rows).

    Example:
        >>> def build_data(self, dist):
        ...     rows = slice(dist.data_index, None, dist.data_count)  # this process's share
        ...     return {"train": jn.DataLoader({"x": x[rows], "y": y[rows]}, batch_size=64)}
    """

    process_index: int
    process_count: int
    n_devices: int  # of the mesh, over every process
    mesh: Any
    local_devices: tuple = ()  # this process's devices of the mesh
    # Which share of each global batch this process feeds: its position along the mesh's
    # `data` axis among `data_count` shares. The process index and count on a data mesh; with
    # a `model` axis spanning processes, the processes along it feed the same rows.
    data_index: int = 0
    data_count: int = 1


def data_share(mesh: Mesh, process: int) -> tuple[int, int]:
    """(index, count) of the share of each batch `process` feeds: its devices' positions
    along the `data` axis, as one block of the axis (the feed builds global arrays so)."""
    if "data" not in mesh.axis_names:
        return 0, 1
    axis = mesh.axis_names.index("data")
    mine = sorted({i[axis] for i, d in np.ndenumerate(mesh.devices) if d.process_index == process})
    if not mine:
        return 0, 1
    per = len(mine)
    return mine[0] // per, mesh.shape["data"] // per


def check_processes_agree(splits: Mapping, split_specs: Mapping[str, SplitSpec]) -> None:
    """With several processes: every process has the same splits, each with as many batches
    of the same shapes (else one would wait in a collective for a batch its peers never
    send); a last short evaluation batch is refused (its padding would be masked per process,
    which the eval program does not do)."""
    if jax.process_count() == 1:
        return
    mine = {
        name: {
            "batches": len(splits[name]) if hasattr(splits[name], "__len__") else None,
            "batch_size": info.batch_size,
            "fields": {f: [list(shape), str(dtype)] for f, (shape, dtype) in info.specs.items()},
        }
        for name, info in split_specs.items()
    }
    try:
        distributed.check_same(
            "splits",
            mine,
            what="the data (split: batches, batch size, per-sample fields)",
            fix="Give every process an equal share of every split (e.g. rows[dist."
            "process_index::dist.process_count] of a length that divides), with drop_last="
            "True for training.",
        )
    except distributed.DistributedError as e:
        raise DataError(str(e)) from e
    for name, src in splits.items():
        if name != "train" and getattr(src, "ragged", False):
            raise DataError(
                f"split {name!r} ends with a short batch ({src.num_samples} samples, "
                f"batch_size {src.batch_size}); with {jax.process_count()} processes every "
                f"batch must be full. Pick a batch size that divides each process's share, "
                f"or drop_last=True."
            )


def build_data(exp: Hooked, data: Any, dist: Dist, seed: int) -> dict[str, Any]:
    """The splits: `Nitro(data=...)` or `build_data(self, dist)`, checked as re-iterables."""
    splits = data if data is not None else exp.build_data(dist)
    if not isinstance(splits, Mapping):
        raise HookError(
            f"build_data must return a dict of splits like {{'train': loader, 'val': loader}}, "
            f"got {type(splits).__name__}."
        )
    splits = dict(splits)
    if splits and "train" not in splits:
        raise DataError(
            f"the data has splits {sorted(splits)} but no 'train' split, which is required."
            + did_you_mean("train", splits)
        )
    for name, src in splits.items():
        if isinstance(src, Iterator):
            raise DataError(
                f"split {name!r} is a one-shot iterator ({type(src).__name__}): it would be "
                f"empty after the first epoch. Pass a re-iterable (a list of batches or a "
                f"jn.DataLoader)."
            )
        if isinstance(src, data_mod.DataLoader) and src.seed is None:
            src.seed = seed  # the Nitro seed controls shuffling
        grain_source.check(name, src, dist)
    return splits


def derive(exp: Hooked, splits: Mapping[str, Source]) -> Hooked:
    """`derive(self, splits)` -> field updates (e.g. class weights), applied to the experiment."""
    fn = getattr(type(exp), "derive", None)
    if fn is None:
        return exp
    updates = fn(exp, splits) or {}
    if not isinstance(updates, Mapping):
        raise HookError(
            f"derive must return a dict field -> value, got {type(updates).__name__}; "
            f"return e.g. {{'class_weights': w}} (or None to change nothing)."
        )
    return replace(exp, **updates)


def device_array(name: str, value: Any, rep: NamedSharding) -> jax.Array:
    """A Device field's value as a strongly typed replicated array (a Python float would be
    weakly typed and could retrace on a change of type)."""
    arr = np.asarray(value)
    if arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    elif arr.dtype == np.int64:
        arr = arr.astype(np.int32)
    elif arr.dtype.kind not in "biuf":
        raise ConfigError(
            f"Device field {name!r} holds {value!r}, which is not numeric; give it a number or "
            f"an array, or mark it GraphConst/Host."
        )
    return sharding_mod.to_sharding(arr, rep)


def check_splits(
    splits: Mapping, routes: Mapping[str, Route], n_devices: int, position: tuple = (0, 0, None)
) -> dict[str, SplitSpec]:
    """Route every split's first batch through the hooks; check sizes and devices. The
    train split's batch is the one at `position` (a resume's)."""
    info = {
        split: _split_spec(split, src, routes, n_devices, position if split == "train" else None)
        for split, src in splits.items()
    }
    if "train" in info:  # every split feeds the same model: the same per-sample fields
        for split, sinfo in info.items():
            if split != "train":
                check_same_specs(sinfo.specs, info["train"].specs, split)
    return info


def _peek(split: str, src: Any, position: tuple | None = None) -> dict:
    """The first batch, iterating the source once (every later use reads the SplitSpec).
    A DataLoader or a grain split reads the batch at `position` (epoch, batch, state) alone."""
    epoch, start, state = position or (0, 0, None)
    if grain_source.kind(src) is not None:
        first = grain_source.peek(src, epoch, start, state)
        if first is None:
            raise DataError(f"split {split!r} is empty (the grain dataset yielded no batch).")
        return first
    if isinstance(src, data_mod.DataLoader):
        return src.first_batch()  # in this process: no transform workers start at setup
    it = iter(src)
    if it is iter(src):
        raise DataError(
            f"split {split!r} ({type(src).__name__}) returns the same iterator each time it is "
            f"iterated, so it would be empty after the first epoch. Make __iter__ start a new "
            f"pass (e.g. a generator function), or pass a jn.DataLoader or a list of batches."
        )
    first = next(it, None)
    close = getattr(it, "close", None)
    if close is not None:
        close()
    if first is None:
        raise DataError(
            f"split {split!r} is empty (it yielded no batch). Remove the split, or check "
            f"what build_data loads."
        )
    return first


def _split_spec(
    split: str, src: Any, routes: Mapping[str, Route], n_devices: int, position: Any = None
) -> SplitSpec:
    first = _peek(split, src, position)
    bs = check_batch(first, split)
    train = split == "train"
    if train and "train_step" in routes:  # a custom step names the fields it trains on
        needed: tuple[str, ...] = ("train_step",)
        hooks.check_batch(routes, first, split, hooks=needed)
        use, loss_ok = needed, False
    else:
        needed = ("forward", "loss", "train_metrics") if train else ("forward", "loss", "metrics")
        hooks.check_batch(routes, first, split, hooks=needed if train else ("forward", "metrics"))
        loss_ok = "loss" in routes and all(f in first for f in routes["loss"].required)
        use = needed if loss_ok else ("forward", "metrics")
    if train and isinstance(src, data_mod.DataLoader) and src.ragged:
        raise DataError(
            f"the 'train' split has {src.num_samples} samples, which batch_size="
            f"{src.batch_size} does not divide: the last train batch would be short "
            f"({src.num_samples % src.batch_size}) and need its own program. Pass "
            f"drop_last=True to the train DataLoader."
        )
    if bs % n_devices:
        raise DataError(
            f"the {split!r} batch size {bs} does not divide by the {n_devices} devices of the "
            f"data mesh. Use a batch size that is a multiple of {n_devices}."
        )
    return SplitSpec(
        batch_size=bs,
        fields=tuple(hooks.device_fields(routes, first, hooks=use)),
        keys=frozenset(first),
        has_loss=loss_ok,
        first=first,
        specs=batch_specs(first, split),
    )


def steps_per_epoch(splits: Mapping, accum: int) -> int | None:
    """Optimizer steps per epoch; `accum` must divide the batches of an epoch."""
    loader = splits.get("train")
    if loader is None or not hasattr(loader, "__len__"):
        return None
    batches = len(loader)
    if batches % accum:
        near = sorted(
            {d for d in range(1, batches + 1) if batches % d == 0},
            key=lambda d: (abs(d - accum), d),
        )[:3]
        raise ConfigError(
            f"accum={accum} does not divide the {batches} train batches of an epoch, so the "
            f"last optimizer step would be short. Use accum in {sorted(near)}, or change the "
            f"batch size or the number of samples (drop_last=True drops a final partial batch)."
        )
    return batches // accum
