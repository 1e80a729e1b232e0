"""A model repository, as Triton lays one out: ``DIR/<model>/<version>/`` where each version
directory is a bundle (`jn.export_model`) and versions are positive integers; an optional
``DIR/<model>/policy.json`` says which versions to serve.

Version policies (`jaxnitro._src.serve.modelconfig.parse_policy`) pick among the versions that
load: when the newest is broken, the intact older one serves.

Control modes (``--model-control-mode``): ``none`` loads every model at start and never
again; ``poll`` rescans every ``--repository-poll-secs`` and loads added versions, unloads
removed ones; ``explicit`` loads only the ``--load-model`` names and what the load API asks
for. The load and unload APIs answer only in ``explicit`` mode, as in Triton.

A model's Triton ``config.pbtxt`` (or the ``config`` of a load request) is applied or
refused (`jaxnitro._src.serve.modelconfig`); a version whose settings change loads again.

A version whose load does not finish within ``load_timeout`` (``--model-load-timeout``) is
marked UNAVAILABLE with that reason and abandoned (its thread cannot be stopped, and is left
to itself); each model loads under its own lock, so the others load and unload meanwhile.

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
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.serve.errors import InvalidRequest, NotFound
from jaxnitro._src.serve.modelconfig import (
    CONFIG_FILE,
    DEFAULT_POLICY,
    model_settings,
    parse_policy,
    read_config,
    select,
)

if TYPE_CHECKING:
    from jaxnitro._src.serve.registry import ServedModel

log = logging.getLogger("jaxnitro.serve")

CONTROL_MODES = ("none", "poll", "explicit")
POLICY_FILE = "policy.json"
#: The default of ``--model-load-timeout``: seconds one version gets to load and warm up.
MODEL_LOAD_TIMEOUT_S = 600.0
T = TypeVar("T")
_PLAIN = re.compile(r"[\w.\-/:~+@]+")


def quoted(name: str) -> str:
    """``name`` for a log line: as it is when plain, else quoted with its escapes shown (a
    newline or control character in a directory name cannot forge a line of output)."""
    return name if _PLAIN.fullmatch(name) else repr(name)


def printable(text: str) -> str:
    """``text`` (e.g. a reason, which may hold a path) on one line: control characters
    escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


async def in_daemon_thread(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a daemon thread of its own: one that never returns can be left
    behind (abandoned) without holding the interpreter's exit, as an executor's would."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting task
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(
        target=run, name=f"jaxnitro-load-{getattr(fn, '__name__', 'fn')}", daemon=True
    ).start()
    return await future


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
        make_model: ``(name, version, path, settings) -> ServedModel``, run in a thread
            (loads the bundle); ``settings`` is `model_settings`' dict with
            ``version_policy`` always set.
        mode: one of `CONTROL_MODES`.
        poll_secs: seconds between rescans in ``poll`` mode.
        load: the models ``explicit`` mode loads at start.
        policy: the version policy of the models without a policy.json.
        load_timeout: seconds one version gets to load and warm up.
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
        load_timeout: float = MODEL_LOAD_TIMEOUT_S,
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
        self.load_timeout = load_timeout
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
        #: The configuration a load request gave a model (until a load without one).
        self.overrides: dict[str, dict] = {}
        #: Versions whose load timed out, their threads left running.
        self.abandoned: set[tuple[str, int]] = set()
        #: The models with a version directory (at their latest sync).
        self._versioned: set[str] = set()
        # one lock per model: a load that hangs holds only its own model
        self._locks: dict[str, asyncio.Lock] = {}
        self._poller: asyncio.Task | None = None
        runtime.registry.why_not = self._why_not

    def _why_not(self, name: str) -> str | None:
        """The reasons the versions of a model this server means to serve are not loaded."""
        if name not in self.wanted:
            return None
        reasons = [
            f"version {v} {e.state}" + (f": {e.reason}" if e.reason else "")
            for (n, v), e in sorted(self.entries.items())
            if n == name
        ]
        return "; ".join(reasons) or "it has no version directory the policy serves"

    def _lock(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    @property
    def ready(self) -> bool:
        """Whether every model this server means to serve (with a version directory) has a
        version ready (Triton's readiness): a model whose versions all failed to load makes
        the server not ready."""
        table = self.runtime.registry.table
        named = self.wanted & self._versioned  # a directory without versions serves nothing
        return all(any(m.ready for m in table.get(name, {}).values()) for name in named)

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
                log.warning(
                    "model repository %s: %s; trying again at the next poll",
                    quoted(str(self.root)),
                    printable(str(e)),
                )

    async def sync_all(self) -> None:
        on_disk = await asyncio.to_thread(scan, self.root)
        names = set(self.wanted) | set(self.runtime.registry.table)

        async def sync(name: str) -> None:
            async with self._lock(name):
                await self._sync(name, on_disk.get(name))

        await asyncio.gather(*(sync(name) for name in sorted(names)))

    # -- the API -------------------------------------------------------------------------------
    async def load(self, name: str, *, config: dict | None = None) -> None:
        """Load (or reload: new versions in, removed ones out) the model ``name``; with
        ``config`` (Triton's JSON form), its settings override the model's own."""
        self._check_explicit("load")
        if config is not None:
            try:
                model_settings(config, name=name, where='the load parameter "config"')
            except ConfigError as e:
                raise InvalidRequest(str(e)) from None
        async with self._lock(name):
            on_disk = await asyncio.to_thread(scan, self.root)
            if name not in on_disk:
                raise NotFound(
                    f"no model {name!r:.100} in the repository {str(self.root)!r}; it has "
                    f"{sorted(on_disk)}.{did_you_mean(name, on_disk)}"
                )
            self.wanted.add(name)
            if config is None:
                self.overrides.pop(name, None)
            else:
                self.overrides[name] = config
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
        async with self._lock(name):
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
        it no longer serves: a replaced version goes only once a served one is ready. The
        policy picks among the versions that load: when one fails, it picks again without
        it (an intact older version serves while the newest is broken)."""
        versions = versions if name in self.wanted else None
        if versions:
            self._versioned.add(name)
        else:
            self._versioned.discard(name)
        try:
            settings = await asyncio.to_thread(self._settings, name) if versions else {}
        except ConfigError as e:
            log.warning("model %s: %s", quoted(name), printable(str(e)))
            for v in versions or {}:
                self.entries[(name, v)] = _Entry("UNAVAILABLE", str(e))
            return
        policy = settings.get("version_policy", self.policy)
        loaded = {int(v): m for v, m in self.runtime.registry.table.get(name, {}).items()}
        if versions:
            await self._retire_reconfigured(name, loaded, settings)
        broken: set[int] = set()
        while True:
            serve = select([v for v in versions or {} if v not in broken], policy)
            new = [
                v
                for v in serve
                if v not in loaded
                and self._should_try(name, v, versions, retry and v not in broken)
            ]
            # a version known broken (it failed, and its files have not changed) is not picked
            known = [v for v in serve if v not in loaded and v not in new]
            await asyncio.gather(*(self._load(name, v, versions[v], settings) for v in new))  # type: ignore[index]
            now = self.runtime.registry.table.get(name, {})
            failed = [v for v in [*new, *known] if str(v) not in now]
            if not failed:
                break
            broken.update(failed)
        await self._unload_unserved(name, versions, serve, loaded)

    async def _retire_reconfigured(
        self, name: str, loaded: dict[int, ServedModel], settings: dict
    ) -> None:
        """Retire (and drop from ``loaded``) the versions whose batching settings changed."""
        for version, model in list(loaded.items()):
            if model.settings is not None and _batching(model.settings) != _batching(settings):
                # its config.pbtxt (or a load's config) changed: it loads again with it
                log.info(
                    "model %s version %s: its configuration changed; loading it again",
                    quoted(name),
                    version,
                )
                del loaded[version]
                await self.runtime.retire(model)

    async def _unload_unserved(
        self,
        name: str,
        versions: dict[int, Path] | None,
        serve: list[int],
        loaded: dict[int, ServedModel],
    ) -> None:
        """Unload the ``loaded`` versions the policy no longer serves, once a served one is
        ready (or at once when their files are gone), and drop from the index the versions
        neither on disk nor loaded."""
        now = self.runtime.registry.table.get(name, {})
        some_ready = any(int(v) in serve and m.ready for v, m in now.items())
        for version, model in list(loaded.items()):
            gone = versions is None or version not in versions
            if version not in serve and (some_ready or gone):
                self.entries[(name, version)] = _Entry("UNLOADING")
                await self.runtime.retire(model)
                self.entries[(name, version)] = _Entry("UNAVAILABLE", "unloaded")
                log.info("model %s version %s: unloaded", quoted(name), version)
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

    def _settings(self, name: str) -> dict:
        """The model's settings: a load request's ``config``, else its ``config.pbtxt``
        (a ``version_policy`` there, else its ``policy.json``, else the server's)."""
        if name in self.overrides:
            settings = model_settings(
                self.overrides[name], name=name, where='the load parameter "config"'
            )
        elif (self.root / name / CONFIG_FILE).is_file():
            settings = read_config(self.root / name / CONFIG_FILE, name=name)
        else:
            settings = {}
        if "version_policy" not in settings:
            settings["version_policy"] = self._policy(name)
        return settings

    def _policy(self, name: str) -> dict:
        path = self.root / name / POLICY_FILE
        if not path.is_file():
            return self.policy
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: not readable JSON ({e}).") from None
        return parse_policy(doc, where=str(path))

    async def _load(self, name: str, version: int, path: Path, settings: dict) -> None:
        signature = await asyncio.to_thread(_signature, path)
        key = (name, version)
        self.entries[key] = _Entry("LOADING", signature=signature)
        log.info("model %s version %s: loading %s", quoted(name), version, quoted(str(path)))
        loading = asyncio.ensure_future(self._bring_in(name, version, path, settings))
        try:
            await asyncio.wait_for(loading, self.load_timeout)
        except TimeoutError:
            reason = (
                f"did not load and warm up within {self.load_timeout:g} s (jaxnitro serve "
                f"--model-load-timeout); abandoned"
            )
            self.entries[key] = _Entry("UNAVAILABLE", reason, signature)
            self.abandoned.add(key)
            log.warning("model %s version %s: %s", quoted(name), version, printable(reason))
            hung = self.runtime.registry.table.get(name, {}).get(str(version))
            if hung is not None:
                await self.runtime.abandon(hung)
            return
        except Exception as e:  # noqa: BLE001 - reported in the index; serving goes on
            reason = f"{type(e).__name__}: {e}"
            self.entries[key] = _Entry("UNAVAILABLE", reason, signature)
            log.warning("model %s version %s: failed to load: %s", quoted(name), version, reason)
            table = self.runtime.registry.table.get(name, {})
            broken = table.get(str(version))
            if broken is not None:  # loaded, but its warm-up failed: never route to it
                await self.runtime.retire(broken)
            return
        self.entries[key] = _Entry("READY", signature=signature)
        log.info("model %s version %s: ready", quoted(name), version)

    async def _bring_in(self, name: str, version: int, path: Path, settings: dict) -> None:
        """Load the bundle (in a daemon thread: one that hangs is left behind), check it
        against the settings, warm it up and put it in service."""
        model = await in_daemon_thread(self.make_model, name, str(version), path, settings)
        await self.runtime.add_version(model)


def _batching(settings: dict) -> dict:
    """The settings that a loaded version is built with (its version policy is not)."""
    return {k: v for k, v in settings.items() if k != "version_policy"}


def describe(root: os.PathLike) -> list[str]:
    """One line per model of a repository, for the start-up lines."""
    return [
        f"  {quoted(name)}: versions {sorted(versions) or '(none)'} in "
        f"{quoted(str(Path(root) / name))}"
        for name, versions in scan(Path(root)).items()
    ]
