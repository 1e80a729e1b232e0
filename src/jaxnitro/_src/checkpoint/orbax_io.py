"""The arrays of one checkpoint through Orbax: written (then read back, cheaply) and read in
exactly the shapes `meta.json` records. Paths Orbax would glob go through a plain symlink."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro._src.checkpoint.format import ARRAYS, META
from jaxnitro._src.checkpoint.format import Unverified as _Unverified
from jaxnitro._src.checkpoint.format import checksum as _checksum
from jaxnitro._src.checkpoint.format import key_entry as _key_entry
from jaxnitro._src.checkpoint.format import orbax_layout as _orbax_layout
from jaxnitro._src.checkpoint.format import record_hash as _record_hash
from jaxnitro._src.checkpoint.format import write_json as _write_json
from jaxnitro._src.checkpoint.leaves import _stored_layout, _to_host
from jaxnitro._src.checkpoint.messages import _short
from jaxnitro._src.checkpoint.quiet import _quiet_closed_loop
from jaxnitro._src.core.errors import CheckpointError
from jaxnitro._src.core.units import format_bytes

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from contextlib import AbstractContextManager

    # `Display.bar`: (label, total, lines=...) -> a context yielding advance(k=1, note="")
    Bar = Callable[..., AbstractContextManager[Callable[..., None]]]

_GLOB = frozenset("[]*?\\{}")
# A restore shown with a bar reads its arrays in parts of at least this many bytes (one Orbax
# call each, at most _MAX_PARTS of them); a smaller checkpoint is one part.
_PART_BYTES = 64 << 20
_MAX_PARTS = 32  # Orbax/TensorStore treat these as patterns in the paths they get


@contextlib.contextmanager
def _orbax_path(directory: Path) -> Iterator[Path]:
    """`directory`, or a glob-free symlink to it: Orbax globs paths (merging OCDBT files), so
    '[', '*', '?', '\\' or '{' in a run name would break the write or the restore."""
    if not _GLOB & set(str(directory)):
        yield directory
        return
    safe = Path(tempfile.mkdtemp(prefix="jaxnitro-"))
    try:
        if _GLOB & set(str(safe)):
            raise CheckpointError(
                f"the temporary directory {safe.parent} contains one of "
                f"{''.join(sorted(_GLOB))}; set TMPDIR to a plain path"
            )
        os.symlink(directory, safe / "c", target_is_directory=True)
        yield safe / "c"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(safe / "c")
        with contextlib.suppress(OSError):
            os.rmdir(safe)


def _orbax() -> tuple[Any, Any, Any]:
    import orbax.checkpoint as ocp  # deferred: importing Orbax is slow

    only = _this_process(ocp)
    handler = ocp.StandardCheckpointHandler(**only)
    return ocp, handler, ocp.Checkpointer(handler, **only)  # synchronous on purpose


def _this_process(ocp: Any) -> dict:
    """Orbax options for a write or read by this process alone. With several processes
    Orbax would otherwise wait for the others at its barriers: here the arrays are whole
    numpy copies, written by process 0 and read by each process on its own."""
    if jax.process_count() == 1:
        return {}
    me = jax.process_index()
    return {
        "multiprocessing_options": ocp.options.MultiprocessingOptions(
            primary_host=me, active_processes={me}, barrier_sync_key_prefix=f"jaxnitro-p{me}"
        )
    }


def _layout_diff(want: dict, got: dict) -> str:
    keys = sorted({(t, k) for t in {**want, **got} for k in {**want.get(t, {}), **got.get(t, {})}})
    diff = [
        f"{t}/{k}: stored {got.get(t, {}).get(k, 'nothing')}, "
        f"expected {want.get(t, {}).get(k, 'nothing')}"
        for t, k in keys
        if want.get(t, {}).get(k) != got.get(t, {}).get(k)
    ]
    return "; ".join(diff[:3]) + (f"; ... {len(diff) - 3} more" if len(diff) > 3 else "")


def _verify_written(ocp: Any, handler: Any, where: Path, item: dict) -> None:
    """Read back a fresh write cheaply: every leaf's shape/dtype, and the smallest leaf's bytes."""
    want = {
        t: {k: (a.shape, str(a.dtype)) for k, a in leaves.items()} for t, leaves in item.items()
    }
    got = _orbax_layout(handler, where)
    if got != want:
        raise _Unverified(f"the arrays did not read back as written ({_layout_diff(want, got)})")
    t, k = min(((t, k) for t in item for k in item[t]), key=lambda tk: item[tk[0]][tk[1]].nbytes)
    only = _this_process(ocp)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**only), **only) as reader:
        back = reader.restore(
            where,
            args=ocp.args.PyTreeRestore(
                item={t: {k: item[t][k]}},
                partial_restore=True,
                restore_args={t: {k: ocp.RestoreArgs(restore_type=np.ndarray)}},
            ),
        )
    if _checksum([""], [np.asarray(back[t][k])]) != _checksum([""], [item[t][k]]):
        raise _Unverified(f"array {t}/{k} did not read back as written")


def _write_checkpoint(target: Path, trees: dict[str, Any], record: dict) -> None:
    """Write the arrays (Orbax, then read back), then meta.json, into the new directory `target`."""
    target.mkdir(parents=True)
    item, specs = {}, {}
    for i, (tname, tree) in enumerate(trees.items()):
        paths, arrays, leaves = [], [], []
        for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:  # None is no leaf
            path = jax.tree_util.keystr(kp)
            arr, spec = _to_host(f"{tname}{path}", leaf)
            paths.append(path)
            arrays.append(arr)
            leaves.append({"path": path, "keys": [_key_entry(k) for k in kp], **spec})
        if arrays:  # Orbax rejects empty subtrees; a leafless tree lives in meta.json only
            item[f"t{i}"] = {f"l{j}": a for j, a in enumerate(arrays)}
        specs[tname] = {"index": i, "sha256": _checksum(paths, arrays), "leaves": leaves}
    if item:
        ocp, handler, ckptr = _orbax()
        with ckptr, _orbax_path(target) as where:
            ckptr.save(where / ARRAYS, args=ocp.args.StandardSave(item))
            _verify_written(ocp, handler, where / ARRAYS, item)
    info = json.loads(json.dumps({**record, "trees": specs}))  # the form a reader will hash
    _write_json(target / META, {**info, "record_sha256": _record_hash(info)})


def _read_arrays(ckpt: Path, info: dict, bar: Bar | None = None) -> dict:
    """Restore exactly the arrays meta.json describes, after Orbax's metadata agrees with it.
    With `bar` (a display's bar), the arrays are read in parts and the bar counts them."""
    want = {
        f"t{t['index']}": {f"l{j}": _stored_layout(leaf) for j, leaf in enumerate(t["leaves"])}
        for t in info["trees"].values()
        if t["leaves"]
    }
    if not want:
        return {}
    if not (ckpt / ARRAYS).is_dir():
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (no {ARRAYS}/ store); use another checkpoint"
        )
    ocp, handler, ckptr = _orbax()
    _quiet_closed_loop()
    try:
        with ckptr, _orbax_path(ckpt) as where:
            got = _orbax_layout(handler, where / ARRAYS)
            if got != want:  # read nothing sized by the store itself: it may be crafted
                raise CheckpointError(
                    f"checkpoint {ckpt} is corrupted (its arrays do not match "
                    f"{META}: {_layout_diff(want, got)}); use another checkpoint"
                )
            target = {
                t: {k: jax.ShapeDtypeStruct(s, jnp.dtype(d)) for k, (s, d) in leaves.items()}
                for t, leaves in want.items()
            }  # ShapeDtypeStruct targets restore as numpy
            if bar is not None:
                return _read_in_parts(ocp, where / ARRAYS, target, bar, ckpt.name)
            if any(t.get("sharded") for t in info["trees"].values()):
                return _read_as_numpy(ocp, where / ARRAYS, target)
            return ckptr.restore(where / ARRAYS, args=ocp.args.StandardRestore(target))
    except CheckpointError:
        raise
    except Exception as exc:  # any storage-level failure means the same to the caller
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (unreadable arrays: {_short(exc, within=ckpt)}); "
            "use another checkpoint"
        ) from exc


def _read_as_numpy(ocp: Any, where: Path, target: dict, *, partial: bool = False) -> dict:
    """Whole arrays as numpy from a store written by several processes (Orbax refuses to
    restore its sharded arrays onto targets without shardings); with `partial`, only the
    arrays `target` names."""
    only = _this_process(ocp)
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**only), **only) as reader:
        return reader.restore(
            where,
            args=ocp.args.PyTreeRestore(
                item=target, restore_args=as_numpy, partial_restore=partial
            ),
        )


def _nbytes(leaf: Any) -> int:
    return int(np.prod(leaf.shape, dtype=np.int64)) * jnp.dtype(leaf.dtype).itemsize


def _parts(target: dict) -> list[dict]:
    """`target`'s arrays ({tree: {leaf: ShapeDtypeStruct}}) in order, split into parts of
    about the same size: at least `_PART_BYTES` each, at most `_MAX_PARTS` of them."""
    leaves = [(t, k, v) for t, tree in target.items() for k, v in tree.items()]
    total = sum(_nbytes(v) for _, _, v in leaves)
    size = max(_PART_BYTES, -(-total // _MAX_PARTS))
    parts: list[dict] = [{}]
    filled = 0
    for t, k, v in leaves:
        if filled >= size:
            parts.append({})
            filled = 0
        parts[-1].setdefault(t, {})[k] = v
        filled += _nbytes(v)
    return parts


def _read_in_parts(ocp: Any, where: Path, target: dict, bar: Bar, name: str) -> dict:
    """The arrays of `target`, one part per Orbax call, under a bar that counts the parts and
    the bytes read (Orbax reads a whole restore in one call and reports nothing before it
    returns). Plain lines only for a checkpoint of several parts."""
    parts = _parts(target)
    total = sum(_nbytes(v) for part in parts for tree in part.values() for v in tree.values())
    out: dict = {}
    done = 0
    with bar(f"restoring {name}", len(parts), lines=len(parts) > 1) as advance:
        for part in parts:
            got = _read_as_numpy(ocp, where, part, partial=len(parts) > 1)
            for t, tree in got.items():
                out.setdefault(t, {}).update(tree)
                done += sum(_nbytes(a) for a in tree.values())
            advance(1, f"{format_bytes(done)} of {format_bytes(total)}")
    return out
