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
import copy
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax

from jaxnitro._src.checkpoint.directory import _complete_dirs, _prepare_dir
from jaxnitro._src.checkpoint.format import MANIFEST, META
from jaxnitro._src.checkpoint.format import TMP as _TMP
from jaxnitro._src.checkpoint.format import WRITING as _WRITING
from jaxnitro._src.checkpoint.format import fsync_dir as _fsync_dir
from jaxnitro._src.checkpoint.format import write_json as _write_json
from jaxnitro._src.checkpoint.format import writing as _writing
from jaxnitro._src.checkpoint.leaves import stage
from jaxnitro._src.checkpoint.loading import load_checkpoint, verify_checkpoint
from jaxnitro._src.checkpoint.manifest import _BadManifest, _read_rows, read_manifest
from jaxnitro._src.checkpoint.messages import _write_failed
from jaxnitro._src.checkpoint.orbax_io import _write_checkpoint
from jaxnitro._src.checkpoint.quarantine import _first_valid, move_aside
from jaxnitro._src.checkpoint.record import (
    FORMAT_VERSION,
    _counters,
    _new_record,
    _read_meta,
    validate_int,
)
from jaxnitro._src.checkpoint.retention import kept, newest, ranked
from jaxnitro._src.core.errors import (
    CheckpointError,
    CheckpointWarning,
    ConfigError,
    check_int,
    check_mode,
    warn_user,
)

__all__ = [
    "TopKCheckpointer",
    "load_checkpoint",
    "read_manifest",
    "validate_int",
    "verify_checkpoint",
]


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

    A checkpoint saved with ``meta={"requested": True}`` (what ``handle.checkpoint()`` and the
    MCP ``checkpoint`` tool write) is kept as well, whatever its score, until the user deletes
    its directory; its manifest row says ``"requested": true``.

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

    def configured(self) -> TopKCheckpointer:
        """A copy with these settings (k, metric, mode, dir), bound to no run: what a handle
        checkpoints with (`n.checkpointer`), so the object passed as `checkpointer=` is never
        changed and may configure several runs.

        Example:
            >>> ck = jn.TopKCheckpointer(k=2)
            >>> n = jn.Nitro(exp, checkpointer=ck)
            >>> n.checkpointer is ck, ck.dir
            (False, None)
        """
        fresh = copy.copy(self)
        fresh._bound, fresh._writer, fresh.run_id = False, True, None
        fresh._pending, fresh._executor = None, None
        return fresh

    def monitor(self, metric: str) -> None:
        """Rank by `metric`: setup's choice when the user named none and the default
        (`val_loss`) is not among what validation produces."""
        self.metric = metric

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
                    "TopKCheckpointer has no directory; call bind(run_dir) or pass dir=. "
                    "A checkpointer passed to jn.Nitro(checkpointer=...) is left as it was: "
                    "the run's checkpoints are n.checkpointer.best() and .latest()."
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
            # asked for by the user: retention keeps it (`retention.kept`)
            "requested": info.get("meta", {}).get("requested") is True,
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
        from jaxnitro._src.checkpoint import shards as checkpoint_shards
        from jaxnitro._src.dist import distributed

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

    def _prepare(
        self, *, epoch: int, step: int, metrics: dict[str, float], meta: dict
    ) -> tuple[str, dict]:
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
        keep = kept(mine, k=self.k, metric=self.metric, mode=self.mode)
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
        row = newest(self._mine(self.records()))
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
        """Unlist `names` (plain entries, from validated rows), then move each one aside."""
        self._write_manifest([r for r in rows if r["name"] not in set(names)])
        return move_aside(self._root(), names)

    def best(self) -> Path | None:
        """Best checkpoint of this run by ``metric`` and ``mode``; None if none has a finite one.

        Example:
            >>> trees, meta = jn.load_checkpoint(ck.best(), {"params": params})
        """
        self.wait()
        best = ranked(self._mine(self.records()), self.metric, self.mode)
        return self.dir / best[0]["path"] if best else None
