"""Top-k checkpointing: atomic, checksummed, restorable into any pytree template.

Layout of a checkpoint directory (``TopKCheckpointer.dir``, by default ``<run_dir>/checkpoints``)::

    manifest.json                        # rows of complete checkpoints, oldest first
    epoch-0003-step-000420-acc=0.9512/
      arrays/                            # Orbax store of {"t<i>": {"l<j>": ndarray}}
      meta.json                          # written last (completeness marker): epoch, step,
                                         # metrics, user meta, leaf paths/shapes/dtypes, sha256

Trees are stored *flattened*, one array per leaf named by position, with their key paths in
``meta.json``. So any pytree can be saved (flax ``nnx.State``, optax NamedTuples, equinox
modules) without Orbax knowing the custom nodes, and ``load_checkpoint`` rebuilds each tree
with the caller's template treedef. No pickle anywhere: arrays go through Orbax, the rest JSON.
Scope: single-process saving; leaves are copied to host memory (numpy) first.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import warnings
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxnitro.errors import CheckpointError, CheckpointWarning, ConfigError, did_you_mean

__all__ = ["TopKCheckpointer", "load_checkpoint", "read_manifest", "verify_checkpoint"]

FORMAT_VERSION = 1
MANIFEST, META, ARRAYS = "manifest.json", "meta.json", "arrays"
_TMP = ".tmp-"  # in-progress or abandoned entries are named "<name>.tmp-<pid>"
_CORRUPT = ".corrupt-"  # checkpoints that failed verification are moved aside as "<name>.corrupt-<n>"
_MODES = ("min", "max")


class _QuietOrbax(logging.Filter):
    """Drop Orbax's INFO/WARNING chatter only, leaving every other absl user alone.

    Orbax logs through absl, whose Python logger is "absl" and whose records carry the real
    caller's file, so filtering on the path is precise and changes no global verbosity.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or "orbax" not in record.pathname


_absl_logger = logging.getLogger("absl")
if not any(isinstance(f, _QuietOrbax) for f in _absl_logger.filters):  # idempotent on reload
    _absl_logger.addFilter(_QuietOrbax())


class _QuietFailedRestore(logging.Filter):
    """A failed Orbax restore (a corrupted checkpoint, already reported as CheckpointError)
    leaves TensorStore futures whose exceptions asyncio logs again, at length, when they are
    collected. Drop exactly those records; every other asyncio message gets through."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "Future exception was never retrieved" not in str(record.msg):
            return True
        detail = str(record.msg) + str(record.exc_info[1] if record.exc_info else "")
        return "tensorstore_spec" not in detail


_asyncio_logger = logging.getLogger("asyncio")
if not any(isinstance(f, _QuietFailedRestore) for f in _asyncio_logger.filters):
    _asyncio_logger.addFilter(_QuietFailedRestore())


# ------------------------------------------------------------------------------ helpers
def _finite_or_none(name: str, value: Any) -> float | None:
    """JSON has no NaN/inf, and a non-finite metric cannot be ranked anyway."""
    try:
        value = float(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"metric {name!r}={value!r} is not a number; pass floats") from exc
    return value if math.isfinite(value) else None


def _fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (POSIX); skipped where dirs cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_json(path: Path, obj: Any) -> None:
    """Temp file + fsync + os.replace: readers see the old file or the new one, never half."""
    tmp = path.with_name(f"{path.name}{_TMP}{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _key_entry(k: Any) -> list:
    """JSON form of a key-path entry; the kind ("i"/"f" = list, "d"/"a" = dict) guides _nest."""
    tu = jax.tree_util
    if isinstance(k, tu.SequenceKey):
        return ["i", k.idx]
    if isinstance(k, tu.FlattenedIndexKey):
        return ["f", k.key]
    if isinstance(k, tu.GetAttrKey):
        return ["a", k.name]
    key = getattr(k, "key", str(k))
    return ["d", key if isinstance(key, str | int) else str(key)]


def _is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def _to_host(where: str, leaf: Any) -> tuple[np.ndarray, dict]:
    """Leaf -> (numpy array to store, JSON spec). Typed PRNG keys are stored as key_data."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        raise CheckpointError(f"leaf {where} is an abstract ShapeDtypeStruct; save real arrays")
    if _is_prng_key(leaf):
        impl = str(jax.random.key_impl(leaf))
        spec = {"shape": list(leaf.shape), "dtype": str(leaf.dtype), "prng_impl": impl}
        return np.asarray(jax.random.key_data(leaf)), spec
    arr = np.asarray(leaf)  # Python scalars become 0-d arrays
    if arr.dtype.kind in "OUS":  # (bfloat16 reports kind "V", so list the bad kinds)
        raise CheckpointError(f"leaf {where} ({type(leaf).__name__}) is not a numeric array")
    return arr, {"shape": list(arr.shape), "dtype": str(arr.dtype), "prng_impl": None}


def _checksum(paths: list[str], arrays: list[np.ndarray]) -> str:
    """sha256 over paths, dtypes, shapes and raw bytes, so edits to data or layout show."""
    h = hashlib.sha256()
    for p, a in zip(paths, arrays, strict=True):
        a = np.ascontiguousarray(a)
        h.update(f"{p}|{a.dtype}|{a.shape}\n".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


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
    if spec["prng_impl"] and _is_prng_key(template_leaf):
        arr = jax.random.wrap_key_data(arr, impl=spec["prng_impl"])
    sharding = getattr(template_leaf, "sharding", None)  # honour the caller's placement
    return jax.device_put(arr, sharding) if sharding is not None else jnp.asarray(arr)


def _assemble(ckpt: Path, name: str, template: Any, stored: dict[str, tuple]) -> Any:
    """Re-assemble `stored` ({keystr: (array, spec)}) with the template's treedef."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    wanted = {jax.tree_util.keystr(p): leaf for p, leaf in flat}
    problems = [f"{p}: missing from checkpoint" for p in wanted if p not in stored]
    problems += [f"{p}: in checkpoint but not in template" for p in stored if p not in wanted]
    for p, leaf in wanted.items():
        if p in stored:
            spec = stored[p][1]
            shape, dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
            # Python-scalar template leaves are weakly typed: compare their shape only.
            if shape != tuple(spec["shape"]) or (dtype is not None and str(dtype) != spec["dtype"]):
                problems.append(f"{p}: template {shape} {dtype}, "
                                f"checkpoint {tuple(spec['shape'])} {spec['dtype']}")
    if problems:
        more = f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise CheckpointError(
            f"checkpoint {ckpt}: tree {name!r} does not match its template:\n  "
            + "\n  ".join(problems[:5]) + more
            + "\nBuild the template from the same model/optimizer configuration that was saved.")
    return jax.tree_util.tree_unflatten(treedef, [_like(wanted[p], *stored[p]) for p in wanted])


def _orbax():
    import orbax.checkpoint as ocp  # deferred: importing Orbax is slow

    return ocp, ocp.Checkpointer(ocp.StandardCheckpointHandler())  # synchronous on purpose


def _write_checkpoint(target: Path, trees: dict[str, Any], record: dict) -> None:
    """Write the arrays (Orbax) and then meta.json into the new directory `target`."""
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
        ocp, ckptr = _orbax()
        with ckptr:
            ckptr.save(target / ARRAYS, args=ocp.args.StandardSave(item))
    _write_json(target / META, {**record, "trees": specs})


def _read_meta(ckpt: Path) -> dict:
    try:
        info = json.loads((ckpt / META).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt} is not a complete checkpoint (no {META}); pass a path "
                              "returned by TopKCheckpointer.save(), latest() or best()") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {ckpt} is corrupted (unreadable {META}: {exc})") from exc
    if info.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {ckpt} has format_version "
                              f"{info.get('format_version')!r}; this jaxnitro reads {FORMAT_VERSION}")
    return info


# ----------------------------------------------------------------------------- public API
def load_checkpoint(path: str | os.PathLike,
                    templates: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict]:
    """Load ``(trees, meta)`` from a checkpoint directory, verifying its checksums.

    Each tree named in ``templates`` (a pytree of arrays or ``jax.ShapeDtypeStruct``) comes back
    with the template's treedef; its leaves become jax arrays (on the template leaf's sharding,
    if any), while numpy and Python-scalar template leaves keep their kind. Trees without a
    template come back as nested dicts/lists of numpy arrays (PRNG keys as raw key data).
    ``meta`` is the user meta given to ``save`` plus "epoch", "step", "metrics" (user keys win).
    """
    ckpt = Path(path)
    info = _read_meta(ckpt)
    templates = templates or {}
    unknown = sorted(set(templates) - set(info["trees"]))
    if unknown:
        raise CheckpointError(f"checkpoint {ckpt} has no tree(s) {unknown}; it holds "
                              f"{sorted(info['trees'])}." + did_you_mean(unknown[0], info["trees"]))
    arrays: dict = {}
    if (ckpt / ARRAYS).exists():
        ocp, ckptr = _orbax()
        try:
            with ckptr:  # leaves were saved as numpy, so Orbax restores numpy without a target
                arrays = ckptr.restore(ckpt / ARRAYS)
        except Exception as exc:  # any storage-level failure means the same to the caller
            raise CheckpointError(f"checkpoint {ckpt} is corrupted (unreadable arrays: {exc})") from exc
    trees = {}
    for name, spec in info["trees"].items():
        leaves = spec["leaves"]
        try:
            stored = arrays.get(f"t{spec['index']}", {})
            values = [np.asarray(stored[f"l{j}"]) for j in range(len(leaves))]
        except (KeyError, TypeError) as exc:
            raise CheckpointError(f"checkpoint {ckpt} is corrupted (tree {name!r} lacks {exc})") from exc
        if _checksum([leaf["path"] for leaf in leaves], values) != spec["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt} is corrupted (checksum mismatch in tree {name!r})")
        if name in templates:
            stored = {leaf["path"]: (v, leaf) for leaf, v in zip(leaves, values, strict=True)}
            trees[name] = _assemble(ckpt, name, templates[name], stored)
        else:
            trees[name] = _nest([(leaf["keys"], v) for leaf, v in zip(leaves, values, strict=True)])
    return trees, {"epoch": info["epoch"], "step": info["step"], "metrics": info["metrics"],
                   **info["meta"]}


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Check a checkpoint end to end without a template; return its meta or raise CheckpointError.

    Reads ``meta.json``, restores every array and compares each tree's sha256 with the one
    recorded at save time, so a truncated, edited or half-deleted checkpoint is caught.
    """
    try:
        _, meta = load_checkpoint(path)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever broke, the checkpoint is unusable
        raise CheckpointError(f"checkpoint {path} is corrupted ({type(exc).__name__}: {exc})") from exc
    return meta


def read_manifest(dir: str | os.PathLike) -> list[dict]:
    """Rows of ``<dir>/manifest.json``, oldest first, without loading any array; [] if none."""
    path = Path(dir) / MANIFEST
    try:
        return list(json.loads(path.read_text(encoding="utf-8"))["checkpoints"])
    except FileNotFoundError:
        return []
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} is unreadable ({exc}); delete it and "
                              "call TopKCheckpointer.bind(), which rebuilds it from meta.json files"
                              ) from exc


class TopKCheckpointer:
    """Keep the ``k`` best checkpoints by ``metric`` (``mode`` "min"/"max") plus the newest."""

    def __init__(self, k: int = 3, metric: str = "val_loss", mode: str = "min",
                 dir: str | os.PathLike | None = None) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ConfigError(f"checkpoint k={k!r} is invalid; pass an int >= 1 (how many to keep)")
        if mode not in _MODES:
            raise ConfigError(f"checkpoint mode={mode!r} is invalid; valid modes are "
                              f"{', '.join(map(repr, _MODES))}." + did_you_mean(str(mode), _MODES, cutoff=0.4))
        if not isinstance(metric, str) or not metric:
            raise ConfigError(f"checkpoint metric={metric!r} is invalid; pass a name like 'val_loss'")
        self.k, self.metric, self.mode = k, metric, mode
        # Orbax requires absolute paths; resolve now so a later chdir cannot move the run.
        self.dir: Path | None = Path(dir).absolute() if dir is not None else None
        self._bound = False

    def bind(self, run_dir: str | os.PathLike) -> None:
        """Pick and create the directory, drop stale temp entries, reconcile the manifest."""
        if self.dir is None:
            self.dir = (Path(run_dir) / "checkpoints").absolute()
        d = self.dir
        if d.exists() and not d.is_dir():
            raise CheckpointError(f"checkpoint directory {d} exists as a file; remove it or pass dir=")
        try:
            d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CheckpointError(f"cannot create checkpoint directory {d} ({exc}); pass a writable dir=") from exc
        if not os.access(d, os.W_OK | os.X_OK):
            raise CheckpointError(f"checkpoint directory {d} is not writable; fix its permissions or pass dir=")
        for entry in d.iterdir():  # leftovers of a killed writer (one writer per directory)
            if _TMP in entry.name:
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        self._bound = True
        # Killed between the checkpoint's rename and the manifest write: the checkpoint is
        # complete but unlisted, so adopt it rather than lose or leak it. Also drop dangling rows.
        rows = self.records()
        listed = {r["name"] for r in rows}
        orphans = [p for p in d.iterdir() if p.name not in listed and _CORRUPT not in p.name
                   and (p / META).is_file()]
        if orphans or len(rows) != len(read_manifest(d)):
            adopted = sorted((self._row(p.name, _read_meta(p)) for p in orphans),
                             key=lambda r: (r["step"], r["time"]))
            self._write_manifest(rows + adopted)

    def _root(self) -> Path:
        if not self._bound:
            if self.dir is None:
                raise CheckpointError("TopKCheckpointer has no directory; call bind(run_dir) or pass dir=")
            self.bind(self.dir)
        return self.dir  # type: ignore[return-value]

    def _row(self, name: str, info: dict) -> dict:
        return {"name": name, "path": name, "epoch": info["epoch"], "step": info["step"],
                "metric": self.metric, "score": info["metrics"].get(self.metric),
                "metrics": info["metrics"], "time": info["time"]}

    def save(self, *, epoch: int, step: int, metrics: dict[str, float], trees: dict[str, Any],
             meta: dict) -> Path:
        """Write one checkpoint durably, then list it in the manifest, then apply retention."""
        root = self._root()
        raw = dict(metrics or {})
        clean = {str(k): _finite_or_none(k, v) for k, v in raw.items()}
        name = f"epoch-{int(epoch):04d}-step-{int(step):06d}"
        if self.metric in raw:  # the raw value, so "nan"/"inf" stay visible in the name
            name += "-{}={:.6g}".format(re.sub(r"[^A-Za-z0-9_.]", "_", self.metric)[:40],
                                        float(raw[self.metric]))
        base, n = name, 0
        while (root / name).exists():  # same epoch/step saved twice: keep both
            n += 1
            name = f"{base}-{n}"
        record = {"format_version": FORMAT_VERSION, "epoch": int(epoch), "step": int(step),
                  "metrics": clean, "time": datetime.now(UTC).isoformat(timespec="microseconds"),
                  "meta": meta or {}}
        try:
            json.dumps(record, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"checkpoint meta must be plain JSON (str/number/list/dict): {exc}") from exc
        tmp = root / f"{name}{_TMP}{os.getpid()}"
        try:
            _write_checkpoint(tmp, trees, record)
            os.replace(tmp, root / name)  # the checkpoint appears complete or not at all
            _fsync_dir(root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_manifest(self.records() + [self._row(name, record)])
        self._apply_retention()
        return root / name

    def _write_manifest(self, rows: list[dict]) -> None:
        _write_json(self._root() / MANIFEST, {"format_version": FORMAT_VERSION, "checkpoints": rows})

    def _apply_retention(self) -> None:
        rows = self.records()
        keep = {r["name"] for r in self._ranked(rows)[: self.k]} | {self._newest(rows)["name"]}
        doomed = [r for r in rows if r["name"] not in keep]
        if doomed:
            self._write_manifest([r for r in rows if r["name"] in keep])  # unlist, then delete
            for r in doomed:
                # Rename first so the removal is atomic for readers; an interrupted rmtree
                # leaves only a temp entry, which bind() cleans up.
                trash = self.dir / f"{r['name']}{_TMP}{os.getpid()}"
                os.replace(self.dir / r["path"], trash)
                shutil.rmtree(trash, ignore_errors=True)

    def _score(self, row: dict) -> float | None:
        # From the row's metrics, not its stored score, so a dir reused with another metric works.
        return row.get("metrics", {}).get(self.metric)

    def _ranked(self, rows: list[dict]) -> list[dict]:
        """Rows that have the metric, best first (stable sort: on ties the older wins)."""
        scored = [r for r in rows if self._score(r) is not None]
        return sorted(scored, key=self._score, reverse=self.mode == "max")

    @staticmethod
    def _newest(rows: list[dict]) -> dict | None:
        return max(enumerate(rows), key=lambda ir: (ir[1]["step"], ir[0]))[1] if rows else None

    def records(self) -> list[dict]:
        """Manifest rows whose checkpoint is complete on disk, oldest first."""
        root = self._root()
        return [r for r in read_manifest(root) if (root / r["path"] / META).is_file()]

    def latest(self) -> Path | None:
        """Newest complete checkpoint (highest step, then last written), or None."""
        row = self._newest(self.records())
        return self.dir / row["path"] if row else None

    def latest_valid(self, *, quarantine: bool = True) -> Path | None:
        """Newest checkpoint that verifies (meta.json and every checksum), or None.

        Newer checkpoints that fail verification (truncated, corrupted) are skipped with a
        `CheckpointWarning` naming each one and why; with ``quarantine`` (the default) each is
        also unlisted and renamed to ``<name>.corrupt-<n>`` (kept for inspection, never
        considered again, neither newest nor best). Costs one full read of the checkpoint.
        """
        root = self._root()
        rows = self.records()
        order = sorted(range(len(rows)), key=lambda i: (rows[i]["step"], i), reverse=True)
        skipped: list[tuple[str, Path, str]] = []
        found = None
        for i in order:
            path = root / rows[i]["path"]
            try:
                verify_checkpoint(path)
            except CheckpointError as exc:
                skipped.append((rows[i]["name"], path, str(exc)))
                continue
            found = path
            break
        moved = self._quarantine([name for name, _, _ in skipped]) if skipped and quarantine else {}
        for name, path, why in skipped:
            where = f"using {found.name} instead" if found is not None else "no valid checkpoint remains"
            aside = f" Moved aside to {moved[name]}." if name in moved else ""
            warnings.warn(f"skipping corrupted checkpoint {path} ({why}); {where}.{aside}",
                          CheckpointWarning, stacklevel=2)
        return found

    def _quarantine(self, names: list[str]) -> dict[str, Path]:
        """Unlist `names`, then rename their directories to `<name>.corrupt-<n>`."""
        root = self._root()
        bad = set(names)
        self._write_manifest([r for r in read_manifest(root) if r["name"] not in bad])
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
        """Best checkpoint by ``metric`` and ``mode``; None if no checkpoint has the metric."""
        ranked = self._ranked(self.records())
        return self.dir / ranked[0]["path"] if ranked else None
