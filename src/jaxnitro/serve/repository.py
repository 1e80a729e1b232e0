"""A model repository, as Triton lays one out: ``DIR/<model>/<version>/`` where each version
directory is a bundle (`jn.export_model`) and versions are positive integers; an optional
``DIR/<model>/policy.json`` says which versions to serve.

Version policies (Triton's ``version_policy``, in its JSON form in ``policy.json``, or a
flag for the models without one): ``{"latest": {"num_versions": N}}`` (the default, N=1),
``{"all": {}}``, ``{"specific": {"versions": [1, 3]}}``; on the command line
``latest:N``, ``all``, ``specific:1,3``.

Control modes (``--model-control-mode``): ``none`` loads every model at start and never
again; ``poll`` rescans every ``--repository-poll-secs`` and loads added versions, unloads
removed ones; ``explicit`` loads only the ``--load-model`` names and what the load API asks
for. The load and unload APIs answer only in ``explicit`` mode, as in Triton.

A swap never fails a request: a new version is loaded and warmed up before requests are
routed to it, and only then is the version it replaces taken out and drained
(`Runtime.add_version`, `Runtime.retire`). A version that fails to load is reported in the
index with its reason, and what is serving keeps serving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from jaxnitro.core.errors import ConfigError, did_you_mean
from jaxnitro.serve.errors import InvalidRequest, NotFound

log = logging.getLogger("jaxnitro.serve")

CONTROL_MODES = ("none", "poll", "explicit")
POLICY_FILE = "policy.json"
DEFAULT_POLICY: dict = {"latest": {"num_versions": 1}}


def parse_policy(value: Any, *, where: str) -> dict:
    """Triton's JSON form of a version policy, from that form or ``latest:N``, ``all``,
    ``specific:1,3``; a `ConfigError` naming ``where`` otherwise."""
    fix = (
        'use {"latest": {"num_versions": 1}}, {"all": {}} or {"specific": {"versions": [1, 3]}}'
        " (on the command line: latest:1, all, specific:1,3)"
    )
    if isinstance(value, str):
        kind, _, arg = value.partition(":")
        try:
            if kind == "latest":
                value = {"latest": {"num_versions": int(arg or 1)}}
            elif kind == "all" and not arg:
                value = {"all": {}}
            elif kind == "specific":
                value = {"specific": {"versions": [int(v) for v in arg.split(",")]}}
        except ValueError:
            pass
    if not (isinstance(value, dict) and len(value) == 1):
        raise ConfigError(f"{where}: version policy {value!r:.200} is not one I know; {fix}.")
    ((kind, body),) = value.items()
    ok = isinstance(body, dict)
    if ok and kind == "latest":
        n = body.get("num_versions", 1)
        ok = isinstance(n, int) and not isinstance(n, bool) and n >= 1
        value = {"latest": {"num_versions": n}}
    elif ok and kind == "specific":
        versions = body.get("versions")
        ok = isinstance(versions, list) and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in versions
        )
        value = {"specific": {"versions": sorted(set(versions or []))}}
    elif kind != "all":
        ok = False
    if not ok:
        raise ConfigError(f"{where}: version policy {value!r:.200} is not valid; {fix}.")
    return value


def select(versions: list[int], policy: dict) -> list[int]:
    """The versions among ``versions`` that ``policy`` serves."""
    if "all" in policy:
        return sorted(versions)
    if "specific" in policy:
        return sorted(set(versions) & set(policy["specific"]["versions"]))
    return sorted(versions)[-policy["latest"]["num_versions"] :]


def scan(root: Path) -> dict[str, dict[int, Path]]:
    """``{model: {version: directory}}`` of a repository (directories only; a version
    directory is a positive integer, anything else is skipped)."""
    models: dict[str, dict[int, Path]] = {}
    for model_dir in sorted(root.iterdir()):
        if not model_dir.is_dir() or model_dir.name.startswith("."):
            continue
        versions = {}
        for entry in model_dir.iterdir():
            if entry.is_dir() and entry.name.isdigit() and int(entry.name) > 0:
                versions[int(entry.name)] = entry
        models[model_dir.name] = versions
    return models


def _signature(path: Path) -> tuple:
    """What changes when a version directory is rewritten: its files' names, sizes, times."""
    try:
        return tuple(
            sorted(
                (str(p.relative_to(path)), p.stat().st_size, p.stat().st_mtime_ns)
                for p in path.rglob("*")
                if p.is_file()
            )
        )
    except OSError:
        return ()


@dataclasses.dataclass
class _Entry:
    """What the index says of one version."""

    state: str  # LOADING, READY, UNLOADING, UNAVAILABLE
    reason: str = ""
    signature: tuple = ()


class Repository:
    """The repository's models, loaded and unloaded through ``runtime``.

    Args:
        root: the repository directory.
        runtime: the server's `Runtime` (the versions are served through it).
        make_model: ``(name, version, path, policy) -> ServedModel``, run in a thread
            (loads the bundle).
        mode: one of `CONTROL_MODES`.
        poll_secs: seconds between rescans in ``poll`` mode.
        load: the models ``explicit`` mode loads at start.
        policy: the version policy of the models without a policy.json.
    """

    def __init__(
        self,
        root: Path,
        *,
        runtime: Any,
        make_model: Any,
        mode: str = "none",
        poll_secs: float = 15.0,
        load: tuple[str, ...] = (),
        policy: dict | None = None,
    ):
        if mode not in CONTROL_MODES:
            raise ConfigError(
                f"model control mode {mode!r} is not one of {list(CONTROL_MODES)}."
                f"{did_you_mean(mode, CONTROL_MODES)}"
            )
        if not root.is_dir():
            raise ConfigError(
                f"model repository {str(root)!r} is not a directory; lay one out as "
                f"DIR/<model>/<version>/ with a bundle in each version directory."
            )
        self.root = root
        self.runtime = runtime
        self.make_model = make_model
        self.mode = mode
        self.poll_secs = poll_secs
        self.policy = policy or DEFAULT_POLICY
        on_disk = scan(root)
        missing = [name for name in load if name not in on_disk]
        if missing:
            raise ConfigError(
                f"--load-model {missing[0]!r}: no such model in {str(root)!r}; it has "
                f"{sorted(on_disk)}.{did_you_mean(missing[0], on_disk)}"
            )
        #: The models this server means to serve (explicit mode: those asked for).
        self.wanted: set[str] = set(load) if mode == "explicit" else set(on_disk)
        self.entries: dict[tuple[str, int], _Entry] = {}
        self._lock = asyncio.Lock()
        self._poller: asyncio.Task | None = None

    # -- the life cycle --------------------------------------------------------------------
    async def start(self) -> None:
        """Load what the mode serves at start; in ``poll`` mode, keep polling."""
        await self.sync_all()
        if self.mode == "poll":
            self._poller = asyncio.get_running_loop().create_task(self._poll())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            await asyncio.gather(self._poller, return_exceptions=True)
            self._poller = None

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_secs)
            try:
                self.wanted = set(await asyncio.to_thread(scan, self.root))
                await self.sync_all()
            except Exception as e:  # noqa: BLE001 - e.g. a directory being rewritten: next poll
                log.warning("model repository %s: %s; trying again at the next poll", self.root, e)

    async def sync_all(self) -> None:
        async with self._lock:
            on_disk = await asyncio.to_thread(scan, self.root)
            names = set(self.wanted) | set(self.runtime.registry.table)
            await asyncio.gather(*(self._sync(name, on_disk.get(name)) for name in names))

    # -- the API -------------------------------------------------------------------------------
    async def load(self, name: str) -> None:
        """Load (or reload: new versions in, removed ones out) the model ``name``."""
        self._check_explicit("load")
        async with self._lock:
            on_disk = await asyncio.to_thread(scan, self.root)
            if name not in on_disk:
                raise NotFound(
                    f"no model {name!r:.100} in the repository {str(self.root)!r}; it has "
                    f"{sorted(on_disk)}.{did_you_mean(name, on_disk)}"
                )
            self.wanted.add(name)
            await self._sync(name, on_disk[name], retry=True)
        if name not in self.runtime.registry.table:
            reasons = [
                f"version {v}: {e.reason}"
                for (n, v), e in sorted(self.entries.items())
                if n == name and e.reason
            ]
            raise InvalidRequest(
                f"failed to load model {name!r}: "
                + ("; ".join(reasons) or "it has no version directory the policy serves")
            )

    async def unload(self, name: str) -> None:
        """Unload every version of the model ``name`` (requests in flight finish first)."""
        self._check_explicit("unload")
        async with self._lock:
            if name not in self.wanted and name not in self.runtime.registry.table:
                raise NotFound(
                    f"model {name!r:.100} is not loaded; loaded: "
                    f"{sorted(self.runtime.registry.table)}."
                )
            self.wanted.discard(name)
            await self._sync(name, None)

    def _check_explicit(self, action: str) -> None:
        if self.mode != "explicit":
            raise InvalidRequest(
                f"cannot {action} a model: this server's model control mode is {self.mode!r};"
                f" start it with --model-control-mode explicit to {action} models by request."
            )

    def index(self, *, ready_only: bool = False) -> list[dict]:
        """Triton's repository index: every model and version, with state and reason."""
        out = []
        on_disk = scan(self.root)
        for name in sorted(set(on_disk) | {n for n, _ in self.entries}):
            listed = False
            for (n, version), entry in sorted(self.entries.items()):
                if n == name:
                    listed = True
                    out.append(
                        {
                            "name": name,
                            "version": str(version),
                            "state": entry.state,
                            "reason": entry.reason,
                        }
                    )
            if not listed:
                out.append(
                    {"name": name, "version": "", "state": "UNAVAILABLE", "reason": "not loaded"}
                )
        if ready_only:
            out = [e for e in out if e["state"] == "READY"]
        return out

    # -- bringing one model in line with its directory and policy ---------------------------
    async def _sync(
        self, name: str, versions: dict[int, Path] | None, *, retry: bool = False
    ) -> None:
        """Load the versions the policy serves and are not loaded yet, then unload those
        it no longer serves: a replaced version goes only once a served one is ready."""
        versions = versions if name in self.wanted else None
        try:
            policy = await asyncio.to_thread(self._policy, name) if versions else self.policy
        except ConfigError as e:
            log.warning("model %s: %s", name, e)
            for v in versions or {}:
                self.entries[(name, v)] = _Entry("UNAVAILABLE", str(e))
            return
        serve = select(list(versions or {}), policy)
        loaded = {int(v): m for v, m in self.runtime.registry.table.get(name, {}).items()}
        new = [v for v in serve if v not in loaded and self._should_try(name, v, versions, retry)]
        await asyncio.gather(*(self._load(name, v, versions[v], policy) for v in new))  # type: ignore[index]
        now = self.runtime.registry.table.get(name, {})
        some_ready = any(int(v) in serve and m.ready for v, m in now.items())
        for version, model in list(loaded.items()):
            gone = versions is None or version not in versions
            if version not in serve and (some_ready or gone):
                self.entries[(name, version)] = _Entry("UNLOADING")
                await self.runtime.retire(model)
                self.entries[(name, version)] = _Entry("UNAVAILABLE", "unloaded")
                log.info("model %s version %s: unloaded", name, version)
        # versions no longer on disk (or no longer wanted) and not loaded leave the index
        loaded_now = self.runtime.registry.table.get(name, {})
        for key in [k for k in self.entries if k[0] == name]:
            if (versions is None or key[1] not in versions) and str(key[1]) not in loaded_now:
                del self.entries[key]

    def _should_try(self, name: str, version: int, versions: Any, retry: bool) -> bool:
        """A version that failed is tried again when its files change (or on a load call)."""
        entry = self.entries.get((name, version))
        if entry is None or entry.state != "UNAVAILABLE" or retry or entry.reason == "unloaded":
            return True
        return _signature(versions[version]) != entry.signature

    def _policy(self, name: str) -> dict:
        path = self.root / name / POLICY_FILE
        if not path.is_file():
            return self.policy
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not readable JSON ({e}).") from None
        return parse_policy(doc, where=str(path))

    async def _load(self, name: str, version: int, path: Path, policy: dict) -> None:
        signature = await asyncio.to_thread(_signature, path)
        self.entries[(name, version)] = _Entry("LOADING", signature=signature)
        log.info("model %s version %s: loading %s", name, version, path)
        try:
            model = await asyncio.to_thread(self.make_model, name, str(version), path, policy)
            await self.runtime.add_version(model)
        except Exception as e:  # noqa: BLE001 - reported in the index; serving goes on
            reason = f"{type(e).__name__}: {e}"
            self.entries[(name, version)] = _Entry("UNAVAILABLE", reason, signature)
            log.warning("model %s version %s: failed to load: %s", name, version, reason)
            table = self.runtime.registry.table.get(name, {})
            broken = table.get(str(version))
            if broken is not None:  # loaded, but its warm-up failed: never route to it
                await self.runtime.retire(broken)
            return
        self.entries[(name, version)] = _Entry("READY", signature=signature)
        log.info("model %s version %s: ready", name, version)


def describe(root: os.PathLike) -> list[str]:
    """One line per model of a repository, for the start-up lines."""
    return [
        f"  {name}: versions {sorted(versions) or '(none)'} in {Path(root) / name}"
        for name, versions in scan(Path(root)).items()
    ]
