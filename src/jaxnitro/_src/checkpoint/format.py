"""The checkpoint format's pieces that both writers share: `checkpoint/store.py` (one process) and
`checkpoint/shards.py` (every process of a multi-process run writes its shards).

The entries of a checkpoint directory, how a leaf's key path and a PRNG key are recorded, the
checksums (of arrays and of meta.json itself), what Orbax recorded of a store, and the
temp-file + fsync + rename that makes every JSON write atomic.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from collections.abc import Iterator

MANIFEST, META, ARRAYS, LOCK = "manifest.json", "meta.json", "arrays", ".jaxnitro.lock"
TMP = ".tmp-"  # in-progress or abandoned entries are named "<name>.tmp-<pid>"
WRITING: set[str] = set()  # temp entries this process is writing now (never cleaned by bind)


def fsync_dir(path: Path) -> None:
    """Make renames inside `path` durable (POSIX); skipped where dirs cannot be opened."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def writing(tmp: Path) -> Iterator[Path]:
    """Mark `tmp` as being written by this process, so bind() here never removes it."""
    WRITING.add(str(tmp))
    try:
        yield tmp
    finally:
        WRITING.discard(str(tmp))


def write_json(path: Path, obj: Any) -> None:
    """Temp file + fsync + os.replace: readers see the old file or the new one, never half."""
    with writing(path.with_name(f"{path.name}{TMP}{os.getpid()}")) as tmp:
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=1, allow_nan=False)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    fsync_dir(path.parent)


class Unverified(Exception):
    """A fresh write did not read back as written (the message says how)."""


def key_entry(k: Any) -> list:
    """JSON form of a key-path entry; the kind ("i"/"f" = list, "d"/"a" = dict) guides the
    rebuilding of plain nested trees when a checkpoint is read without a template."""
    tu = jax.tree_util
    if isinstance(k, tu.SequenceKey):
        return ["i", k.idx]
    if isinstance(k, tu.FlattenedIndexKey):
        return ["f", k.key]
    if isinstance(k, tu.GetAttrKey):
        return ["a", k.name]
    key = getattr(k, "key", str(k))
    return ["d", key if isinstance(key, str | int) else str(key)]


def is_prng_key(x: Any) -> bool:
    dtype = getattr(x, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)


def checksum(paths: list[str], arrays: list[np.ndarray]) -> str:
    """sha256 over paths, dtypes, shapes and raw bytes, so edits to data or layout show."""
    h = hashlib.sha256()
    for p, a in zip(paths, arrays, strict=True):
        a = np.ascontiguousarray(a)
        h.update(f"{p}|{a.dtype}|{a.shape}\n".encode())
        h.update(a.reshape(-1).view(np.uint8).data)
    return h.hexdigest()


def record_hash(info: dict) -> str:
    """sha256 of meta.json's canonical JSON, less this hash and the trees' own sha256 fields
    (those verify themselves against the arrays: an edit shows as a checksum mismatch)."""
    body = {k: v for k, v in info.items() if k != "record_sha256"}
    body["trees"] = {
        n: {k: v for k, v in t.items() if k != "sha256"} for n, t in info["trees"].items()
    }
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def orbax_layout(handler: Any, where: Path) -> dict:
    """{"t<i>": {"l<j>": (shape, dtype)}} as Orbax's metadata records it (no array is read).
    From the handler: Checkpointer.metadata() would swallow the reason it cannot be read."""
    tree = handler.metadata(where).tree
    return {
        t: {k: (tuple(m.shape), str(np.dtype(m.dtype))) for k, m in leaves.items()}
        for t, leaves in tree.items()
    }
