"""Top-k checkpointing: atomic, checksummed, restorable into any pytree template.

Layout of a checkpoint directory (``TopKCheckpointer.dir``, by default ``<run_dir>/checkpoints``)::

    manifest.json                        # rows of complete checkpoints, oldest first
    epoch-0003-step-000420-acc=0.9512/
      arrays/                            # Orbax store of {"t<i>": {"l<j>": ndarray}}
      meta.json                          # written last (completeness marker): epoch, step,
                                         # metrics, user meta, leaf paths/shapes/dtypes, sha256s

Trees are stored *flattened*, one array per leaf named by position, with their key paths in
``meta.json``. So any pytree can be saved (flax ``nnx.State``, optax NamedTuples, equinox
modules) without Orbax knowing the custom nodes, and ``load_checkpoint`` rebuilds each tree
with the caller's template treedef. No pickle anywhere: arrays go through Orbax, the rest JSON.
Nothing read from disk is trusted: meta.json is validated and hashed, manifest rows must name
plain entries of the directory, and arrays are read only in the shapes meta.json records.
Scope: POSIX; in one process leaves are copied to host memory (numpy) first. With several
processes (`jax.distributed`) every process calls `save` together and writes its own shards
(`checkpoint/shards.py`: per-shard checksums; process 0 names the checkpoint and writes
meta.json and the manifest; the directory must be on a filesystem every process sees). A load
reads whole arrays on each process and places each process's part of them.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

# The format's pieces shared with checkpoint_shards.py, under the private names this module
# (and its tests) have always used.
from jaxnitro.checkpoint.format import ARRAYS, LOCK, MANIFEST, META
from jaxnitro.checkpoint.format import TMP as _TMP
from jaxnitro.checkpoint.format import WRITING as _WRITING
from jaxnitro.checkpoint.format import Unverified as _Unverified
from jaxnitro.checkpoint.format import checksum as _checksum
from jaxnitro.checkpoint.format import fsync_dir as _fsync_dir
from jaxnitro.checkpoint.format import is_prng_key as _is_prng_key
from jaxnitro.checkpoint.format import key_entry as _key_entry
from jaxnitro.checkpoint.format import orbax_layout as _orbax_layout
from jaxnitro.checkpoint.format import record_hash as _record_hash
from jaxnitro.checkpoint.format import write_json as _write_json
from jaxnitro.checkpoint.format import writing as _writing
from jaxnitro.core.errors import (
    CheckpointError,
    CheckpointWarning,
    ConfigError,
    check_int,
    check_mode,
    did_you_mean,
    warn_user,
)
from jaxnitro.core.jsonable import jsonable, parse_json
from jaxnitro.core.units import format_bytes

__all__ = [
    "TopKCheckpointer",
    "load_checkpoint",
    "read_manifest",
    "validate_int",
    "verify_checkpoint",
]

FORMAT_VERSION = 1
_CORRUPT = (
    ".corrupt-"  # checkpoints that failed verification are moved aside as "<name>.corrupt-<n>"
)
_TMP_RE, _CORRUPT_RE = re.compile(r"\.tmp-(\d+)$"), re.compile(r"\.corrupt-\d+$")
_GLOB = frozenset("[]*?\\{}")  # Orbax/TensorStore treat these as patterns in the paths they get


class _QuietOrbax(logging.Filter):
    """Drop Orbax's INFO/WARNING chatter only, leaving every other absl user alone.

    Orbax logs through absl, whose Python logger is "absl" and whose records carry the real
    caller's file, so filtering on the path is precise and changes no global verbosity.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "orbax" not in record.pathname


class _QuietFailedRestore(logging.Filter):
    """A failed Orbax restore (a corrupted checkpoint, already reported as CheckpointError)
    leaves TensorStore futures whose exceptions asyncio logs again, at length, when they are
    collected. Drop exactly those records; every other asyncio message gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "Future exception was never retrieved" not in str(record.msg):
            return True
        detail = str(record.msg) + str(record.exc_info[1] if record.exc_info else "")
        return "tensorstore_spec" not in detail


for _name, _filter in (("absl", _QuietOrbax), ("asyncio", _QuietFailedRestore)):
    if not any(isinstance(f, _filter) for f in logging.getLogger(_name).filters):  # reload-safe
        logging.getLogger(_name).addFilter(_filter())


class _DropClosedLoopNoise:
    """``sys.unraisablehook`` wrapper for one known-harmless report, passing all others on.

    When a restore fails, Orbax closes its event loop while TensorStore reads it started are
    still in flight; each, on finishing, wakes the closed loop (``call_soon_threadsafe``) and
    TensorStore reports the RuntimeError as unraisable: a traceback per array, sometimes after
    the restore returned. The failure itself is reported once, as a CheckpointError.
    """

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, unraisable: Any) -> None:
        exc = unraisable.exc_value
        if (
            isinstance(exc, RuntimeError)
            and str(exc) == "Event loop is closed"
            and any(
                f.f_code.co_name == "call_soon_threadsafe"
                for f, _ in traceback.walk_tb(unraisable.exc_traceback)
            )
        ):
            return
        self.previous(unraisable)


def _quiet_closed_loop() -> None:
    if not isinstance(sys.unraisablehook, _DropClosedLoopNoise):
        sys.unraisablehook = _DropClosedLoopNoise(sys.unraisablehook)


# ------------------------------------------------------------------------------ helpers
def _metric_value(name: str, value: Any) -> float | None:
    """A metric as a float; NaN/inf as None (JSON has none, and they cannot be ranked)."""
    try:
        number = float(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"metric {name!r}={value!r} is not a number; pass floats (or 0-d arrays)"
        ) from exc
    return jsonable(number)


def _short(exc: BaseException | str, limit: int = 200, *, within: Path | None = None) -> str:
    """First line of an error, without TensorStore's multi-KB spec JSON, at most `limit` chars
    (paths `within` the checkpoint are shortened to "./...": the message names it already)."""
    text = re.sub(r"\s*\[tensorstore_spec='.*?'\]", "", str(exc), flags=re.S).strip()
    text = text.replace(f"{within}/", "./") if within is not None else text
    text = text.splitlines()[0] if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _write_failed(path: Path, exc: BaseException) -> CheckpointError:
    why = _short(exc) if isinstance(exc, _Unverified) else f"{type(exc).__name__}: {_short(exc)}"
    try:
        free = f"{format_bytes(shutil.disk_usage(path.parent).free)} free"
    except OSError:
        free = "free space unknown"
    return CheckpointError(
        f"cannot write checkpoint {path} ({why}); {free} on "
        f"{path.parent}. Nothing half-written was kept. Free disk space (or raise the quota), "
        "or pass TopKCheckpointer(dir=) on a larger disk."
    )


def _pid_alive(pid: int) -> bool:
    if os.name != "posix" or pid <= 0:
        return True  # unknown: keep (os.kill(pid, 0) would terminate a process on Windows)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OSError, OverflowError):  # PermissionError: alive, owned by another user
        return True
    return True


def _is_stale_temp(entry: Path) -> bool:
    """A `<name>.tmp-<pid>` entry whose writer is gone (dead process, or an earlier one of ours)."""
    m = _TMP_RE.search(entry.name)
    if not m:
        return False
    pid = int(m.group(1))
    if pid == os.getpid():  # a previous process with our pid (a restarted container)
        return str(entry) not in _WRITING
    return not _pid_alive(pid)


def _plain_name(name: Any) -> bool:
    """One ordinary path component: no separators, not '.'/'..', not absolute, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "\0" not in name
        and not any(sep in name for sep in {"/", "\\", os.sep, os.altsep or "/"})
    )


def _is_symlink(path: Path) -> bool:
    try:
        return path.is_symlink()
    except OSError:  # a name too long for the filesystem, say: not a usable entry either
        return True


@contextlib.contextmanager
def _orbax_path(directory: Path):
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


class _Staged:
    """A leaf already copied to the host (`stage`): its array to store and its JSON spec."""

    __slots__ = ("array", "spec")

    def __init__(self, array: np.ndarray, spec: dict):
        self.array, self.spec = array, spec


def stage(trees: dict[str, Any]) -> dict[str, Any]:
    """The trees with every leaf copied to host memory now (their device buffers may be
    donated to the next train step while a background write still runs)."""

    def copy(kp, leaf, name):
        arr, spec = _to_host(f"{name}{jax.tree_util.keystr(kp)}", leaf)
        return _Staged(np.array(arr, copy=True), spec)

    return {
        name: jax.tree_util.tree_map_with_path(lambda kp, x, n=name: copy(kp, x, n), tree)
        for name, tree in trees.items()
    }


def _to_host(where: str, leaf: Any) -> tuple[np.ndarray, dict]:
    """Leaf -> (numpy array to store, JSON spec). Typed PRNG keys are stored as key_data."""
    if isinstance(leaf, _Staged):
        return leaf.array, leaf.spec
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise CheckpointError(
            f"leaf {where} is an abstract ShapeDtypeStruct; save the real arrays (a "
            "ShapeDtypeStruct only describes one, e.g. as a load_checkpoint template)"
        )
    if _is_prng_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        spec = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "prng_impl": impl}
        return np.asarray(jax.random.key_data(leaf)), spec
    arr = np.asarray(leaf)  # Python scalars become 0-d arrays
    if arr.dtype.kind in "OUS":  # (bfloat16 reports kind "V", so list the bad kinds)
        raise CheckpointError(
            f"leaf {where} ({type(leaf).__name__}) is not a numeric array; keep strings and "
            "objects out of the saved trees (put plain values in meta=)"
        )
    return arr, {"shape": list(arr.shape), "dtype": str(arr.dtype), "prng_impl": None}


@functools.cache
def _key_data_layout(impl: str) -> tuple[tuple, str]:
    kd = jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0, impl=impl)))
    return tuple(kd.shape), str(kd.dtype)


def _stored_layout(leaf: dict) -> tuple[tuple, str]:
    """(shape, dtype) of the array Orbax holds for a meta.json leaf spec (keys as key data)."""
    if leaf["prng_impl"]:
        trailing, dtype = _key_data_layout(leaf["prng_impl"])
        return tuple(leaf["shape"]) + trailing, dtype
    return tuple(leaf["shape"]), str(jnp.dtype(leaf["dtype"]))


def _nest(entries: list[tuple[list, np.ndarray]]) -> Any:
    """Plain nested dicts/lists rebuilt from stored key paths (used when there is no template)."""
    if len(entries) == 1 and not entries[0][0]:
        return entries[0][1]  # the whole tree was a single leaf
    root: dict = {}
    for keys, value in entries:
        node = root
        for kind, key in keys[:-1]:
            node = node.setdefault((kind, key), {})
        node[tuple(keys[-1])] = value

    def freeze(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node and all(kind in ("i", "f") for kind, _ in node):
            return [freeze(node[k]) for k in sorted(node, key=lambda kk: kk[1])]
        return {key: freeze(v) for (_, key), v in node.items()}

    return freeze(root)


def _like(template_leaf: Any, arr: np.ndarray, spec: dict) -> Any:
    """Turn a restored array into the kind of value the template leaf is."""
    if isinstance(template_leaf, bool | int | float | complex):
        return type(template_leaf)(arr.item())
    if isinstance(template_leaf, np.ndarray | np.generic):
        return arr if isinstance(template_leaf, np.ndarray) else arr[()]
    value: Any = arr
    if spec["prng_impl"] and _is_prng_key(template_leaf):  # (wrap_key_data takes numpy too)
        value = jax.random.wrap_key_data(value, impl=spec["prng_impl"])
    sharding = getattr(template_leaf, "sharding", None)  # honour the caller's placement
    if sharding is None:
        return jnp.asarray(value)
    if not sharding.is_fully_addressable:  # several processes: each places its own part
        from jaxnitro.dist.sharding import to_sharding

        return to_sharding(value, sharding)
    return jax.device_put(value, sharding)


def _check_template(ckpt: Path, name: str, template: Any, leaves: list[dict]) -> None:
    """Compare a template with meta.json's leaf specs, before any array is read."""
    wanted = {
        jax.tree_util.keystr(p): leaf
        for p, leaf in jax.tree_util.tree_flatten_with_path(template)[0]
    }
    stored = {leaf["path"]: leaf for leaf in leaves}
    problems = [f"{p}: missing from checkpoint" for p in wanted if p not in stored]
    problems += [f"{p}: in checkpoint but not in template" for p in stored if p not in wanted]
    for p, leaf in wanted.items():
        if p in stored:
            spec = stored[p]
            shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
            # Python-scalar template leaves are weakly typed: compare their shape only.
            if shape != tuple(spec["shape"]) or (dtype is not None and str(dtype) != spec["dtype"]):
                problems.append(
                    f"{p}: template {shape} {dtype}, "
                    f"checkpoint {tuple(spec['shape'])} {spec['dtype']}"
                )
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {ckpt}: tree {name!r} does not match its template:\n  "
            + "\n  ".join(problems[:5])
            + more
            + "\nBuild the template from the same model/optimizer configuration that was saved."
        )


def _assemble(template: Any, stored: dict[str, tuple]) -> Any:
    """Re-assemble `stored` ({keystr: (array, spec)}, already checked) with the template's
    treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = [_like(leaf, *stored[jax.tree_util.keystr(p)]) for p, leaf in flat]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def _orbax():
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


def _bad_field(ckpt: Path, field: str, value: Any, want: str) -> CheckpointError:
    shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
    return CheckpointError(
        f"checkpoint {ckpt} is corrupted ({META} field {field!r} must be "
        f"{want}, got {shown}); use another checkpoint"
    )


def _is_int(value: Any, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def validate_int(
    meta: dict,
    key: str,
    path: str | os.PathLike,
    *,
    minimum: int = 0,
    maximum: int | None = None,
    default: int | None = None,
) -> int:
    """``meta[key]`` as an int in [``minimum``, ``maximum``], else a CheckpointError naming
    the field and path.

    A missing (or null) value gives ``default`` when one is given. For the user meta of a
    checkpoint, e.g. ``validate_int(meta, "batch_in_epoch", path, default=0)``.

    Example:
        >>> validate_int({"batch_in_epoch": 7}, "batch_in_epoch", "ckpt", default=0)
        7
    """
    value: Any = meta.get(key) if isinstance(meta, dict) else None
    if value is None and default is not None:
        return default
    if not _is_int(value, minimum) or (maximum is not None and value > maximum):
        bound = f" and <= {maximum}" if maximum is not None else ""
        raise _bad_field(Path(path), key, value, f"an int >= {minimum}{bound}")
    return int(value)


def _check_record(ckpt: Path, info: dict) -> None:
    """Types and ranges of the fields jaxnitro itself uses, each error naming its field."""
    for key in ("epoch", "step"):
        validate_int(info, key, ckpt)
    metrics = info.get("metrics")
    if not isinstance(metrics, dict) or not all(
        isinstance(k, str)
        and (v is None or (isinstance(v, int | float) and not isinstance(v, bool)))
        for k, v in metrics.items()
    ):
        raise _bad_field(ckpt, "metrics", metrics, "a dict of str -> float or null")
    for key, kind in (("meta", dict), ("time", str)):
        if not isinstance(info.get(key), kind):
            raise _bad_field(ckpt, key, info.get(key), f"a {kind.__name__}")
    trees = info.get("trees")
    if not isinstance(trees, dict) or not all(isinstance(t, dict) for t in trees.values()):
        raise _bad_field(ckpt, "trees", trees, "a dict of tree specs")
    indices = set()
    for name, t in trees.items():
        index, leaves = t.get("index"), t.get("leaves")
        if not _is_int(index) or index in indices:
            raise _bad_field(ckpt, f"trees.{name}.index", index, "a distinct int >= 0")
        indices.add(index)
        if not isinstance(t.get("sha256"), str) or not isinstance(leaves, list):
            raise _bad_field(ckpt, f"trees.{name}", t, "{index, sha256: str, leaves: list}")
        for j, leaf in enumerate(leaves):
            if not _leaf_spec_ok(leaf):
                raise _bad_field(
                    ckpt,
                    f"trees.{name}.leaves[{j}]",
                    leaf,
                    "{path, keys, shape: [int >= 0], dtype: str, prng_impl}",
                )


def _leaf_spec_ok(leaf: Any) -> bool:
    """Whether a meta.json leaf spec has the fields and types `_check_record` requires."""
    return (
        isinstance(leaf, dict)
        and isinstance(leaf.get("path"), str)
        and isinstance(leaf.get("dtype"), str)
        and isinstance(leaf.get("prng_impl", 0), str | None)
        and isinstance(leaf.get("shape"), list)
        and all(_is_int(n) for n in leaf["shape"])
        and isinstance(leaf.get("keys"), list)
        and all(
            isinstance(e, list)
            and len(e) == 2
            and e[0] in ("i", "f", "a", "d")
            and isinstance(e[1], str | int)
            for e in leaf["keys"]
        )
    )


def _read_meta(ckpt: Path) -> dict:
    """meta.json of a checkpoint, validated (see _check_record) and checked against its hash."""
    try:
        info = parse_json((ckpt / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(
            f"{ckpt} is not a complete checkpoint (no {META}); pass a path "
            "returned by TopKCheckpointer.save(), latest() or best()"
        ) from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (unreadable {META}: {_short(exc)}); use another "
            "checkpoint"
        ) from exc
    if not isinstance(info, dict):
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted ({META} is not a JSON object); use another checkpoint"
        )
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {ckpt} has format_version "
            f"{info.get('format_version')!r}; this jaxnitro reads {FORMAT_VERSION}. Load it "
            "with the jaxnitro version that wrote it"
        )
    _check_record(ckpt, info)
    # Checkpoints written before the record hash existed have none; any other is verified.
    if "record_sha256" in info:
        try:
            same = info.get("record_sha256") == _record_hash(info)
        except (TypeError, ValueError, RecursionError):
            same = False
        if not same:
            raise CheckpointError(
                f"checkpoint {ckpt} is corrupted ({META} does not match its "
                "record_sha256: it was edited or damaged); use another checkpoint"
            )
    return info


def _read_arrays(ckpt: Path, info: dict) -> dict:
    """Restore exactly the arrays meta.json describes, after Orbax's metadata agrees with it."""
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


def _read_as_numpy(ocp: Any, where: Path, target: dict) -> dict:
    """Whole arrays as numpy from a store written by several processes (Orbax refuses to
    restore its sharded arrays onto targets without shardings)."""
    only = _this_process(ocp)
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    with ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**only), **only) as reader:
        return reader.restore(
            where, args=ocp.args.PyTreeRestore(item=target, restore_args=as_numpy)
        )


# ----------------------------------------------------------------------------- public API
def load_checkpoint(
    path: str | os.PathLike, templates: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict]:
    """Load ``(trees, meta)`` from a checkpoint directory, verifying its checksums.

    Each tree named in ``templates`` (a pytree of arrays or ``jax.ShapeDtypeStruct``) comes back
    with the template's treedef; its leaves become jax arrays (on the template leaf's sharding,
    if any), while numpy and Python-scalar template leaves keep their kind. Trees without a
    template come back as nested dicts/lists of numpy arrays (PRNG keys as raw key data).
    ``meta`` is the user meta given to ``save`` plus "epoch", "step", "metrics" (user keys win).
    Templates are compared with meta.json before any array is read, and arrays are read only in
    the shapes meta.json records, so a mismatched or crafted checkpoint fails fast.

    Example:
        >>> trees, meta = jn.load_checkpoint(ck.best(), {"params": {"w": np.zeros(3)}})
        >>> trees["params"]["w"], meta["step"], meta["metrics"]
        (array([1., 1., 1.]), 100, {'acc': 0.91})
    """
    ckpt = Path(path).absolute()  # Orbax refuses relative paths; a relative one is fine here
    info = _read_meta(ckpt)
    templates = templates or {}
    _check_templates(ckpt, info, templates)
    try:
        arrays = _read_arrays(ckpt, info)
    except (KeyError, TypeError, ValueError) as exc:  # e.g. an unknown dtype or PRNG impl
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (bad leaf spec in {META}: {_short(exc)}); use "
            "another checkpoint"
        ) from exc
    trees = {
        name: _rebuild_tree(ckpt, name, spec, arrays, templates.get(name, _NO_TEMPLATE))
        for name, spec in info["trees"].items()
    }
    return trees, {
        "epoch": info["epoch"],
        "step": info["step"],
        "metrics": info["metrics"],
        **info["meta"],
    }


_NO_TEMPLATE = object()  # (None is a valid pytree template: the empty tree)


def _check_templates(ckpt: Path, info: dict, templates: dict[str, Any]) -> None:
    """Every template names a stored tree and matches its leaf specs (no array read yet)."""
    unknown = sorted(set(templates) - set(info["trees"]))
    if unknown:
        raise CheckpointError(
            f"checkpoint {ckpt} has no tree(s) {unknown}; it holds "
            f"{sorted(info['trees'])}; pass templates for those only."
            + did_you_mean(unknown[0], info["trees"])
        )
    for name, template in templates.items():
        _check_template(ckpt, name, template, info["trees"][name]["leaves"])


def _rebuild_tree(ckpt: Path, name: str, spec: dict, arrays: dict, template: Any) -> Any:
    """One stored tree, checksum-verified, in the template's structure (or as nested dicts)."""
    leaves = spec["leaves"]
    stored = arrays.get(f"t{spec['index']}", {})
    values = [np.asarray(stored[f"l{j}"]) for j in range(len(leaves))]
    if spec.get("sharded"):  # written by several processes: checksums per shard
        from jaxnitro.checkpoint import shards as checkpoint_shards

        checkpoint_shards.verify(ckpt, name, spec, values)
    elif _checksum([leaf["path"] for leaf in leaves], values) != spec["sha256"]:
        raise CheckpointError(
            f"checkpoint {ckpt} is corrupted (checksum mismatch in tree {name!r}); use "
            "another checkpoint"
        )
    pairs = list(zip(leaves, values, strict=True))
    if template is not _NO_TEMPLATE:
        return _assemble(template, {leaf["path"]: (v, leaf) for leaf, v in pairs})
    return _nest([(leaf["keys"], v) for leaf, v in pairs])


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint end to end without a template; return its meta or raise CheckpointError.

    Reads and validates ``meta.json``, restores every array (in the recorded shapes only) and
    compares each tree's sha256 with the one recorded at save time, so a truncated, edited or
    half-deleted checkpoint is caught.

    Example:
        >>> jn.checkpoint.verify_checkpoint(ck.latest())["step"]
        100
    """
    try:
        _, meta = load_checkpoint(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, the checkpoint is unusable
        raise CheckpointError(
            f"checkpoint {path} is corrupted ({type(exc).__name__}: {_short(exc)}); use "
            "another checkpoint"
        ) from exc
    return meta


class _BadManifest(Exception):
    """manifest.json cannot be used as it is (the reason is the message)."""


def _row_problem(row: Any) -> str | None:
    if not isinstance(row, dict):
        return f"a row is of type {type(row).__name__!r}, not an object"
    for key in ("epoch", "step"):
        if not _is_int(row.get(key)):
            return f"row {row.get('name')!r}: {key} is {row.get(key)!r}, not an int >= 0"
    metrics = row.get("metrics")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        return f"row {row.get('name')!r}: metrics is not a dict"
    if not isinstance(row.get("time"), str):
        return f"row {row.get('name')!r}: time is not a str"
    return None


def _read_rows(root: Path, *, quiet: bool = False) -> tuple[list[dict], int]:
    """(valid rows, number dropped); raises _BadManifest when the file cannot be used at all."""
    path = root / MANIFEST
    try:
        data = parse_json(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [], 0
    except (OSError, ValueError) as exc:
        raise _BadManifest(_short(exc)) from exc
    rows = data.get("checkpoints") if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise _BadManifest("no 'checkpoints' list")
    for row in rows:
        if problem := _row_problem(row):
            raise _BadManifest(problem)
    # A row may only name a plain entry of this directory: retention deletes and quarantine
    # renames `root / path`, so '../x', '/abs' or a symlink would reach outside it.
    good: list[dict] = []
    dropped: list[dict] = []
    for r in rows:
        (
            good
            if _plain_name(r.get("name"))
            and r.get("path") == r["name"]
            and not _is_symlink(root / r["name"])
            else dropped
        ).append(r)
    if dropped and not quiet:
        warn_user(
            f"checkpoint manifest {path}: ignoring {len(dropped)} row(s) whose name/path "
            f"is not a plain entry of {root} (e.g. {dropped[0].get('path')!r})",
            CheckpointWarning,
        )
    return good, len(dropped)


def read_manifest(dir: str | os.PathLike) -> list[dict]:
    """Rows of ``<dir>/manifest.json``, oldest first, without loading any array; [] if none.

    Rows that do not name a plain entry of ``dir`` are dropped with a CheckpointWarning; a
    manifest of the wrong shape raises CheckpointError.

    Example:
        >>> [(row["name"], row["score"]) for row in jn.read_manifest(ck.dir)]
        [('epoch-0001-step-000100-acc=0.91', 0.91)]
    """
    try:
        return _read_rows(Path(dir))[0]
    except _BadManifest as exc:
        raise CheckpointError(
            f"checkpoint manifest {Path(dir) / MANIFEST} is unreadable ({exc}); "
            "delete it and call TopKCheckpointer.bind(), which rebuilds it from "
            "meta.json files"
        ) from exc


def _complete_dirs(root: Path) -> list[Path]:
    """Finished checkpoint directories on disk (no temp entry, none moved aside, no symlink)."""
    if not root.is_dir():
        return []
    return [
        p
        for p in sorted(root.iterdir())
        if _TMP not in p.name
        and _CORRUPT not in p.name
        and not p.is_symlink()
        and (p / META).is_file()
    ]


def _allowed_entry(entry: Path, listed: set[str]) -> bool:
    """Whether `entry` is something jaxnitro puts in a checkpoint directory."""
    name = entry.name
    if name in (MANIFEST, LOCK) or _TMP_RE.search(name) or _CORRUPT_RE.search(name):
        return True
    if name.startswith(".nfs"):  # NFS keeps deleted-but-open files of ours under this name
        return True
    return (
        not entry.is_symlink() and entry.is_dir() and (name in listed or (entry / META).is_file())
    )


def _first_valid(root: Path, rows: list[dict]) -> tuple[Path | None, list[tuple[str, Path, str]]]:
    """The newest-written checkpoint of `rows` that verifies (or None), and the (name, path,
    why) of each newer one that did not."""
    # Newest written first, across every run in the directory: resuming continues the
    # run that wrote last, even if an older run reached a higher step.
    order = sorted(
        range(len(rows)), key=lambda i: (rows[i]["time"], rows[i]["step"], i), reverse=True
    )
    skipped: list[tuple[str, Path, str]] = []
    for i in order:
        path = root / rows[i]["path"]
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            why = str(exc).removeprefix(f"checkpoint {path} is ")  # the path is said below
            skipped.append((rows[i]["name"], path, _short(why, 300)))
            continue
        return path, skipped
    return None, skipped


def _prepare_dir(d: Path) -> None:
    """Create the checkpoint directory `d` writable, refuse foreign content in it, and drop
    the temp entries of writers that are gone (live writers' entries stay)."""
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(
            f"cannot create checkpoint directory {d} ({exc}); pass a writable dir="
        ) from exc
    if not os.access(d, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"checkpoint directory {d} is not writable; fix its permissions or pass dir="
        )
    try:
        listed = {r["name"] for r in _read_rows(d, quiet=True)[0]}
    except _BadManifest:
        listed = set()
    foreign = sorted(
        e.name + "/" * e.is_dir() for e in d.iterdir() if not _allowed_entry(e, listed)
    )
    if foreign:
        more = f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""
        raise CheckpointError(
            f"checkpoint directory {d} holds entries jaxnitro did not create: "
            f"{', '.join(map(repr, foreign[:3]))}{more}. Retention deletes inside it, so "
            f"pass an empty or new dir= (e.g. {d / 'checkpoints'}) or a run's checkpoints "
            "directory."
        )
    for entry in d.iterdir():  # leftovers of killed writers
        if _is_stale_temp(entry):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _counters(epoch: Any, step: Any) -> tuple[int, int]:
    """(epoch, step) as ints >= 0: what _read_meta would refuse is refused at save time."""
    try:
        counters = int(epoch), int(step)
    except (TypeError, ValueError, OverflowError):
        counters = (-1, -1)
    if min(counters) < 0:
        raise CheckpointError(
            f"checkpoint epoch and step must be ints >= 0; pass the run's "
            f"counters, got epoch={epoch!r}, step={step!r}"
        )
    return counters


def _free_name(root: Path, epoch: int, step: int, metric: str, metrics: dict) -> str:
    """`epoch-E-step-S[-metric=V]`, suffixed `-<n>` when that entry exists already."""
    name = f"epoch-{epoch:04d}-step-{step:06d}"
    if metric in metrics:  # the raw value, so "nan"/"inf" stay visible in the name
        name += "-{}={:.6g}".format(
            re.sub(r"[^A-Za-z0-9_.]", "_", metric)[:40], float(metrics[metric])
        )
    base, n = name, 0
    while (root / name).exists():  # same epoch/step saved twice: keep both
        n += 1
        name = f"{base}-{n}"
    return name


def _new_record(epoch: int, step: int, metrics: dict, meta: dict | None) -> dict:
    """The JSON record of a checkpoint (meta.json without its trees)."""
    record = {
        "format_version": FORMAT_VERSION,
        "epoch": epoch,
        "step": step,
        "metrics": {str(k): _metric_value(k, v) for k, v in metrics.items()},
        "time": datetime.now(UTC).isoformat(timespec="microseconds"),
        "meta": meta or {},
    }
    try:  # NaN/inf (a history row of a diverged step) as null, numpy values as numbers
        return jsonable(record)
    except RecursionError as exc:
        raise CheckpointError(
            "checkpoint meta contains itself (a cycle); pass plain JSON data (str/number/list/dict)"
        ) from exc


def _write_atomically(root: Path, name: str, trees: dict[str, Any], record: dict) -> None:
    """Write the checkpoint under a temp name, then rename it to `root / name`."""
    tmp = root / f"{name}{_TMP}{os.getpid()}"
    try:
        with _writing(tmp):
            _write_checkpoint(tmp, trees, record)
            os.replace(tmp, root / name)  # the checkpoint appears complete or not at all
        _fsync_dir(root)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        # Ctrl-C/exit propagate unchanged, as do our own errors (a leaf that is no array).
        if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
            raise
        raise _write_failed(root / name, exc) from exc


class TopKCheckpointer:
    """Keep the ``k`` best checkpoints by ``metric`` (``mode`` "min"/"max") plus the newest.

    Args:
        k: how many of the best checkpoints to keep (the newest is kept as well).
        metric: the metric to rank by, a key of the ``metrics`` given to ``save``.
        mode: "min" (lower is better, e.g. a loss) or "max" (higher is better).
        dir: the checkpoint directory; None: ``<run_dir>/checkpoints`` once bound to a run.

    Example:
        >>> ck = jn.TopKCheckpointer(k=2, metric="acc", mode="max", dir="/tmp/ckpts")
        >>> path = ck.save(epoch=1, step=100, metrics={"acc": 0.91},
        ...                trees={"params": {"w": np.ones(3)}}, meta={})
        >>> ck.best() == path, path.name
        (True, 'epoch-0001-step-000100-acc=0.91')
    """

    def __init__(
        self,
        k: int = 3,
        metric: str = "val_loss",
        mode: str = "min",
        dir: str | os.PathLike | None = None,
    ) -> None:
        k = check_int("TopKCheckpointer k", k, fix="pass how many checkpoints to keep, e.g. k=3")
        mode = check_mode("checkpoint mode", mode)
        if not isinstance(metric, str) or not metric:
            raise ConfigError(
                f"checkpoint metric={metric!r} is invalid; pass a name like 'val_loss'"
            )
        self.k, self.metric, self.mode = k, metric, mode
        # Orbax requires absolute paths; resolve now so a later chdir cannot move the run.
        self.dir: Path | None = Path(dir).absolute() if dir is not None else None
        self._bound, self._writer = False, True
        # The run whose checkpoints retention, latest() and best() manage. Several runs may
        # share a directory (a fresh run into an old run_dir): none deletes another's.
        self.run_id: str | None = None
        # A background save (save(..., background=True)): at most one in flight.
        self._pending: concurrent.futures.Future | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    def for_run(self, run_id: str | None) -> None:
        """Manage only the checkpoints of run `run_id` (None: every checkpoint, as before).

        Each checkpoint's meta names its run; a fresh run into a directory that holds an
        earlier run's checkpoints keeps its own top k and never deletes the others.

        Example:
            >>> ck.for_run("2024-06-01-run-a")  # retention now spares other runs' checkpoints
        """
        self.run_id = run_id

    def _mine(self, rows: list[dict]) -> list[dict]:
        return rows if self.run_id is None else [r for r in rows if r.get("run_id") == self.run_id]

    def bind(self, run_dir: str | os.PathLike, *, writer: bool = True) -> None:
        """Pick the directory; as the writer also create it, refuse foreign content, drop dead
        writers' temp entries and reconcile the manifest with the checkpoints on disk.

        With ``writer=False`` (a reader, e.g. an evaluation while a trainer runs) nothing on
        disk is created or changed, and a missing directory simply holds no checkpoint.

        Example:
            >>> ck = jn.TopKCheckpointer(metric="acc", mode="max")
            >>> ck.bind("runs/mnist")
            >>> ck.dir.name
            'checkpoints'
        """
        if self.dir is None:
            self.dir = (Path(run_dir) / "checkpoints").absolute()
        d = self.dir
        self._bound = False  # until this bind succeeds (a refused dir must not be written to)
        if d.exists() and not d.is_dir():
            raise CheckpointError(
                f"checkpoint directory {d} exists as a file; remove it or pass dir="
            )
        if not writer or jax.process_index() != 0:  # with several processes 0 writes
            self._bound, self._writer = True, False
            return
        _prepare_dir(d)
        self._bound, self._writer = True, True
        # Killed between the checkpoint's rename and the manifest write: the checkpoint is
        # complete but unlisted, so adopt it rather than lose or leak it. Also drop dangling rows.
        rows = self.records()
        listed = {r["name"] for r in rows}
        adopted = self._rows_from([p for p in _complete_dirs(d) if p.name not in listed])
        if adopted or len(rows) != len(_read_rows(d, quiet=True)[0]):
            self._write_manifest(rows + adopted)

    def _root(self) -> Path:
        if not self._bound:
            if self.dir is None:
                raise CheckpointError(
                    "TopKCheckpointer has no directory; call bind(run_dir) or pass dir="
                )
            self.bind(self.dir)
        return self.dir  # type: ignore[return-value]

    def _row(self, name: str, info: dict) -> dict:
        run_id = info.get("meta", {}).get("run_id")
        return {
            "name": name,
            "path": name,
            "epoch": info["epoch"],
            "step": info["step"],
            "metric": self.metric,
            "score": info["metrics"].get(self.metric),
            "metrics": info["metrics"],
            "time": info["time"],
            "run_id": run_id if isinstance(run_id, str) else None,
        }

    def _rows_from(self, dirs: list[Path]) -> list[dict]:
        """Rows for checkpoint directories from their meta.json, oldest first (bad ones warned)."""
        rows = []
        for p in dirs:
            try:
                rows.append(self._row(p.name, _read_meta(p)))
            except CheckpointError as exc:
                warn_user(f"not listing checkpoint {p}: {exc}", CheckpointWarning)
        return sorted(rows, key=lambda r: (r["step"], r["time"]))

    def save(
        self,
        *,
        epoch: int,
        step: int,
        metrics: dict[str, float],
        trees: dict[str, Any],
        meta: dict,
        background: bool = False,
    ) -> Path:
        """Write one checkpoint durably, then list it in the manifest, then apply retention.

        With several processes every process calls it and writes its own shards; process 0
        names the checkpoint and writes its meta.json and the manifest. Every process returns
        the path once the checkpoint is complete.

        `background=True` (one process) copies the arrays to host memory, returns the path,
        and writes in a background thread: training goes on meanwhile. One save is in flight
        at a time (the next, `wait()`, `latest()` and `best()` wait for it), so the host
        holds at most one staged copy; the write is as atomic as a foreground one.

        Example:
            >>> path = ck.save(epoch=1, step=100, metrics={"acc": 0.91},
            ...                trees={"params": {"w": np.ones(3)}}, meta={"note": "warmup"})
            >>> path.name
            'epoch-0001-step-000100-acc=0.91'
        """
        self.wait()
        if jax.process_count() > 1:
            return self._save_together(
                epoch=epoch, step=step, metrics=metrics, trees=trees, meta=meta
            )
        name, record = self._prepare(epoch=epoch, step=step, metrics=metrics, meta=meta)
        if not background:
            self._commit(name, trees, record)
            return self._root() / name
        staged = stage(trees)
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="jaxnitro-checkpoint"
            )
        self._pending = self._executor.submit(self._commit, name, staged, record)
        return self._root() / name

    def wait(self) -> None:
        """Finish the background save in flight, if any (re-raising its error).

        Example:
            >>> ck.save(epoch=1, step=10, metrics={}, trees=trees, meta={}, background=True)
            >>> ck.wait()  # the checkpoint is now complete on disk
        """
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _save_together(
        self, *, epoch: int, step: int, metrics: dict[str, float], trees: dict[str, Any], meta: dict
    ) -> Path:
        """`save` by every process of a multi-process run (see `checkpoint_shards`)."""
        from jaxnitro.checkpoint import shards as checkpoint_shards
        from jaxnitro.dist import distributed

        if meta is not None and not isinstance(meta, dict):
            raise CheckpointError(
                f"checkpoint meta must be a dict, got {type(meta).__name__}; pass meta={{...}}"
            )
        epoch, step = _counters(epoch, step)
        raw = dict(metrics or {})
        record = _new_record(epoch, step, raw, meta)  # (process 0's is written)

        def plan() -> list[str]:
            root = self._root()
            if not self._writer:
                raise CheckpointError(
                    f"this TopKCheckpointer is bound read-only to {root} "
                    "(bind(..., writer=False)); call bind(run_dir) to save"
                )
            name = _free_name(root, epoch, step, self.metric, raw)
            tmp = root / f"{name}{_TMP}{os.getpid()}"
            _WRITING.add(str(tmp))
            tmp.mkdir(parents=True)
            return [name, str(tmp)]

        name, tmp = distributed.decided_by_process_zero("checkpoint-plan", plan)
        target = self._root() / name
        try:
            checkpoint_shards.write(Path(tmp), trees, record)
        except BaseException as exc:
            if jax.process_index() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
                _WRITING.discard(tmp)
            if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
                raise
            raise _write_failed(target, exc) from exc

        def commit() -> None:
            os.replace(tmp, target)  # the checkpoint appears complete or not at all
            _WRITING.discard(tmp)
            _fsync_dir(target.parent)
            self._write_manifest(self.records() + [self._row(name, record)])
            self._apply_retention()

        distributed.decided_by_process_zero("checkpoint-commit", commit)
        return target

    def _prepare(self, *, epoch: int, step: int, metrics: dict[str, float], meta: dict):
        """(name, record) of a new checkpoint, checked before anything is written."""
        root = self._root()
        if not self._writer:
            raise CheckpointError(
                f"this TopKCheckpointer is bound read-only to {root} "
                "(bind(..., writer=False)); call bind(run_dir) to save"
            )
        if meta is not None and not isinstance(meta, dict):
            raise CheckpointError(
                f"checkpoint meta must be a dict, got {type(meta).__name__}; pass meta={{...}}"
            )
        epoch, step = _counters(epoch, step)
        raw = dict(metrics or {})
        record = _new_record(epoch, step, raw, meta)
        return _free_name(root, epoch, step, self.metric, raw), record

    def _commit(self, name: str, trees: dict[str, Any], record: dict) -> None:
        """Write the checkpoint atomically, list it, apply retention (maybe in the thread)."""
        root = self._root()
        _write_atomically(root, name, trees, record)
        self._write_manifest(self.records() + [self._row(name, record)])
        self._apply_retention()

    def _write_manifest(self, rows: list[dict]) -> None:
        path = self._root() / MANIFEST
        try:
            _write_json(path, {"format_version": FORMAT_VERSION, "checkpoints": rows})
        except Exception as exc:  # noqa: BLE001 - a full disk, mostly; say so
            raise _write_failed(path, exc) from exc

    def _apply_retention(self) -> None:
        root = self._root()
        rows = self.records()
        mine = self._mine(rows)  # another run's checkpoints are never this run's to delete
        newest = self._newest(mine)
        if newest is None:
            return
        keep = {r["name"] for r in self._ranked(mine)[: self.k]} | {newest["name"]}
        doomed = [r for r in mine if r["name"] not in keep]
        if doomed:
            gone = {r["name"] for r in doomed}
            self._write_manifest([r for r in rows if r["name"] not in gone])  # unlist, then delete
            for r in doomed:
                # Rename first so the removal is atomic for readers; an interrupted rmtree
                # leaves only a temp entry, which bind() cleans up.
                with _writing(root / f"{r['name']}{_TMP}{os.getpid()}") as trash:
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(root / r["path"], trash)
                    shutil.rmtree(trash, ignore_errors=True)

    def _score(self, row: dict) -> float | None:
        # From the row's metrics, not its stored score, so a dir reused with another metric works.
        # A missing, null or non-finite score is never "best": it is ranked after every number.
        value = row.get("metrics", {}).get(self.metric)
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            return None
        return value

    def _ranked(self, rows: list[dict]) -> list[dict]:
        """Rows with a finite metric, best first (stable sort: on ties the older wins)."""
        scored = [(score, r) for r in rows if (score := self._score(r)) is not None]
        scored.sort(key=lambda sr: sr[0], reverse=self.mode == "max")
        return [r for _, r in scored]

    @staticmethod
    def _newest(rows: list[dict]) -> dict | None:
        return max(enumerate(rows), key=lambda ir: (ir[1]["step"], ir[0]))[1] if rows else None

    def _manifest_rows(self) -> list[dict]:
        """Valid manifest rows; an unusable manifest is rebuilt from the meta.json files (and,
        by the writer, rewritten) rather than blocking every run in the directory."""
        root = self._root()
        try:
            rows, dropped = _read_rows(root)
        except _BadManifest as exc:
            warn_user(
                f"checkpoint manifest {root / MANIFEST} is unreadable ({exc}); rebuilt "
                f"it from the checkpoints' {META} files",
                CheckpointWarning,
            )
            rows, dropped = self._rows_from(_complete_dirs(root)), 1
        if dropped and self._writer:
            self._write_manifest(rows)
        return rows

    def records(self) -> list[dict]:
        """Manifest rows whose checkpoint is complete on disk, oldest first.

        Example:
            >>> [(r["step"], r["score"]) for r in ck.records()]
            [(100, 0.91)]
        """
        root = self._root()
        good, lost, seen = [], [], set()
        for r in self._manifest_rows():  # (first of duplicate names wins)
            if r["name"] in seen:
                continue
            seen.add(r["name"])
            if (root / r["path"] / META).is_file():
                good.append(r)
            elif (root / r["path"]).is_dir():  # listed, but its meta.json was deleted
                lost.append(r["name"])
        if lost:
            moved = self._quarantine(lost, good) if self._writer else {}
            aside = f"; moved aside to {', '.join(p.name for p in moved.values())}" if moved else ""
            warn_user(
                f"checkpoint(s) {', '.join(lost)} in {root} lost their {META} and are "
                f"ignored{aside}",
                CheckpointWarning,
            )
        return good

    def latest(self) -> Path | None:
        """Newest complete checkpoint of this run (highest step, then last written), or None.

        Example:
            >>> trees, meta = jn.load_checkpoint(ck.latest())
        """
        self.wait()
        row = self._newest(self._mine(self.records()))
        return self.dir / row["path"] if row else None

    def latest_valid(self, *, quarantine: bool = True) -> Path | None:
        """Newest checkpoint that verifies (meta.json and every checksum), or None.

        Newer checkpoints that fail verification (truncated, corrupted) are skipped with a
        `CheckpointWarning` naming each one and why; with ``quarantine`` (the default; never
        when bound with ``writer=False``) each is also unlisted and renamed to
        ``<name>.corrupt-<n>`` (kept for inspection, never considered again, neither newest nor
        best). Costs one full read of the checkpoint.

        Example:
            >>> path = ck.latest_valid()  # None when no checkpoint verifies
            >>> trees, meta = jn.load_checkpoint(path) if path is not None else ({}, {})
        """
        rows = self.records()
        found, skipped = _first_valid(self._root(), rows)
        moved = (
            self._quarantine([s[0] for s in skipped], rows)
            if skipped and quarantine and self._writer
            else {}
        )
        for name, path, why in skipped:
            where = (
                f"using {found.name} instead"
                if found is not None
                else "no valid checkpoint remains"
            )
            aside = f" Moved aside to {moved[name]}." if name in moved else ""
            warn_user(
                f"skipping corrupted checkpoint {path} ({why}); {where}.{aside}",
                CheckpointWarning,
            )
        return found

    def _quarantine(self, names: list[str], rows: list[dict]) -> dict[str, Path]:
        """Unlist `names` (plain entries, from validated rows), then rename each one
        `<name>.corrupt-<n>`."""
        root = self._root()
        self._write_manifest([r for r in rows if r["name"] not in set(names)])
        moved = {}
        for name in names:
            n = 0
            while (root / f"{name}{_CORRUPT}{n}").exists():
                n += 1
            with contextlib.suppress(OSError):
                os.replace(root / name, root / f"{name}{_CORRUPT}{n}")
                moved[name] = root / f"{name}{_CORRUPT}{n}"
        _fsync_dir(root)
        return moved

    def best(self) -> Path | None:
        """Best checkpoint of this run by ``metric`` and ``mode``; None if none has a finite one.

        Example:
            >>> trees, meta = jn.load_checkpoint(ck.best(), {"params": params})
        """
        self.wait()
        ranked = self._ranked(self._mine(self.records()))
        return self.dir / ranked[0]["path"] if ranked else None
