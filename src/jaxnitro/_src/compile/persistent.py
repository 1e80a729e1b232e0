"""JAX's persistent compilation cache as jaxnitro uses it: what is in it, how often it served.

The cache itself is JAX's (entries keyed by the program text, the jax/jaxlib version, the
backend and XLA flags; least recently used entries evicted beyond its size cap, under a file
lock that makes concurrent processes safe). `devices.configure_cache` points JAX at the
directory, and `cache_guard` checks the path to it and each entry's signature at every use;
this module reads it for `jaxnitro cache info`, clears it for `jaxnitro cache clear`, and
keeps the hit rate across processes in one small file beside the entries
(`jaxnitro-stats.jsonl`: one line per process that compiled or loaded a program).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path

from jaxnitro._src.compile import cache, cache_guard

__all__ = ["CacheInfo", "clear", "info", "record_process", "use"]

STATS_FILE = cache_guard.STATS_FILE
_ENTRY = "-cache"  # JAX's suffixes: the executable, and its last access time for the LRU
_ATIME = "-atime"
_STATS_MAX_LINES = 2000


@dataclasses.dataclass(frozen=True)
class CacheInfo:
    """What `jaxnitro cache info` shows."""

    directory: str
    exists: bool
    entries: int
    size_bytes: int
    processes: int  # processes recorded in the stats file
    loaded: int  # programs they loaded from the cache
    compiled: int  # programs they compiled (and wrote, where JAX caches them)
    untrusted: tuple[str, ...] = ()  # why others could plant programs there (empty: none)

    @property
    def hit_rate(self) -> float | None:
        total = self.loaded + self.compiled
        return self.loaded / total if total else None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


def info(directory: str | os.PathLike) -> CacheInfo:
    """Entries, size and recorded hit rate of the cache in `directory`.

    Example:
        >>> info(default_cache_dir()).entries
        2
    """
    path = Path(directory)
    entries = size = 0
    if path.is_dir():
        for f in path.iterdir():
            if f.name.endswith(_ENTRY):
                entries += 1
            if f.is_file():
                size += f.stat().st_size
    processes = loaded = compiled = 0
    for row in _stats_rows(path):
        processes += 1
        loaded += int(row.get("loaded", 0))
        compiled += int(row.get("compiled", 0))
    untrusted = tuple(p.why for p in cache_guard.problems(path))
    return CacheInfo(
        str(path), path.is_dir(), entries, size, processes, loaded, compiled, untrusted
    )


def clear(directory: str | os.PathLike) -> int:
    """Remove every cache entry (and the recorded hit rate) in `directory`; returns how many
    entries were removed. Files that are not the cache's are left alone."""
    path = Path(directory)
    removed = 0
    if not path.is_dir():
        return 0
    for f in path.iterdir():
        if f.name.endswith(_ENTRY) or f.name.endswith(_ATIME) or f.name == STATS_FILE:
            with contextlib.suppress(FileNotFoundError):  # a concurrent clear or eviction
                f.unlink()
            removed += f.name.endswith(_ENTRY)
    return removed


def _stats_rows(path: Path) -> list[dict]:
    try:
        text = (path / STATS_FILE).read_text()
    except OSError:
        return []
    rows = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict):
                rows.append(row)
    return rows


_start = dict(cache.cache_stats())


def record_process(directory: str | None) -> None:
    """Append this process's loads and compiles to the stats file of `directory` (at exit;
    nothing when it neither compiled nor loaded). One short append: concurrent processes
    do not interleave within a line."""
    if directory is None:
        return
    now = cache.cache_stats()
    loaded = now["persistent_hits"] - _start["persistent_hits"]
    compiled = now["misses"] - _start["misses"] - loaded
    if loaded <= 0 and compiled <= 0:
        return
    line = json.dumps({"time": round(time.time(), 3), "loaded": loaded, "compiled": compiled})
    path = Path(directory) / STATS_FILE
    if cache_guard.problems(directory):  # the path turned untrusted: write nothing there
        return
    with contextlib.suppress(OSError):  # the cache is an optimisation: never fail the run
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
        finally:
            os.close(fd)
        if path.stat().st_size > 200 * _STATS_MAX_LINES:  # keep it small: the newest lines
            rows = path.read_text().splitlines()[-_STATS_MAX_LINES // 2 :]
            tmp = path.with_name(f".{STATS_FILE}.{os.getpid()}")
            tmp.write_text("\n".join(rows) + "\n")
            os.replace(tmp, path)


_in_use: dict[str, str | None] = {"dir": None}


def use(directory: str | None) -> None:
    """Note the directory this process caches in (`devices.configure_cache` calls this), so
    its loads and compiles are recorded there at exit."""
    _in_use["dir"] = directory


atexit.register(lambda: record_process(_in_use["dir"]))
