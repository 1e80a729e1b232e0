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

A model's Triton ``config.pbtxt`` (or the ``config`` of a load request, Triton's JSON form)
is applied where this server has the knob: ``max_batch_size``, ``dynamic_batching``
(``max_queue_delay_microseconds``; ``preferred_batch_size`` only as the sizes it compiles)
and ``version_policy``; ``name``, ``platform``/``backend``, ``input`` and ``output`` are
checked against the model and its bundle. Anything else is refused with its name, never
ignored (`model_settings`).

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
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from jaxnitro.core.errors import ConfigError, did_you_mean
from jaxnitro.serve.errors import InvalidRequest, NotFound

log = logging.getLogger("jaxnitro.serve")

CONTROL_MODES = ("none", "poll", "explicit")
POLICY_FILE = "policy.json"
CONFIG_FILE = "config.pbtxt"
DEFAULT_POLICY: dict = {"latest": {"num_versions": 1}}
#: The default of ``--model-load-timeout``: seconds one version gets to load and warm up.
MODEL_LOAD_TIMEOUT_S = 600.0
#: The fields of Triton's model configuration this server applies or checks.
CONFIG_FIELDS = (
    "name",
    "platform",
    "backend",
    "max_batch_size",
    "dynamic_batching",
    "version_policy",
    "input",
    "output",
)
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
        if isinstance(versions, list):  # protobuf's JSON form writes int64 as strings
            versions = [int(v) if isinstance(v, str) and v.isdigit() else v for v in versions]
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


def repository_parameters(action: str, params: Mapping[str, Any]) -> dict:
    """The keyword arguments of `Repository.load`/`unload` from a request's parameters
    (Triton's: ``config`` on load, ``unload_dependents`` on unload); an `InvalidRequest`
    (400) naming what this server does not do, never a parameter ignored."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if action == "load" and key == "config":
            if isinstance(value, (str, bytes)):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise InvalidRequest(
                        f'the load parameter "config" is not JSON ({e}); send a model '
                        f"configuration in Triton's JSON form, e.g. "
                        f'{{"max_batch_size": 8}}.'
                    ) from None
            if not isinstance(value, dict):
                raise InvalidRequest(
                    f'the load parameter "config" is JSON {type(value).__name__}; send an object.'
                )
            out["config"] = value
        elif action == "load" and str(key).startswith("file:"):
            raise InvalidRequest(
                f"load parameter {key!r:.100}: this server does not load model files sent "
                f"with the request; put the bundle in the repository as <model>/<version>/ "
                f"and load the model by name."
            )
        elif action == "unload" and key == "unload_dependents":
            pass  # no model here has dependents (there are no ensembles): nothing more to do
        else:
            takes = '"config"' if action == "load" else '"unload_dependents"'
            raise InvalidRequest(
                f"{action} parameter {key!r:.100} is not supported; this server takes {takes}."
            )
    return out


def model_settings(doc: Mapping[str, Any], *, name: str, where: str) -> dict:
    """What a model configuration (Triton's JSON form) sets here: ``version_policy``,
    ``max_batch_size``, ``batching``, ``max_batch_delay_ms``, ``preferred``,
    ``io`` (input and output, checked against the bundle once loaded); a `ConfigError`
    naming ``where`` and each field this server does not apply."""
    unknown = [k for k in doc if k not in CONFIG_FIELDS]
    if unknown:
        raise ConfigError(
            f"{where}: {', '.join(map(repr, unknown))} not supported by jaxnitro serve, "
            f"which applies {', '.join(CONFIG_FIELDS)}; remove {_them(unknown)}."
        )
    out: dict[str, Any] = {}
    given = doc.get("name")
    if given not in (None, "", name):
        raise ConfigError(f"{where}: name {given!r:.100} is not the model's name {name!r}.")
    for key in ("platform", "backend"):
        if doc.get(key) not in (None, "", "jax"):
            raise ConfigError(
                f"{where}: {key} {doc[key]!r:.100}: this server runs jaxnitro bundles only "
                f'("jax"); leave it out.'
            )
    if "max_batch_size" in doc:
        size = doc["max_batch_size"]
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(
                f"{where}: max_batch_size {size!r:.40} must be an int >= 1 (a bundle always "
                f"takes a batch dimension)."
            )
        out["max_batch_size"] = size
    if "dynamic_batching" in doc:
        out.update(_dynamic_batching(doc["dynamic_batching"], where))
    if "version_policy" in doc:
        out["version_policy"] = parse_policy(
            doc["version_policy"], where=f"{where}: version_policy"
        )
    io = {k: doc[k] for k in ("input", "output") if k in doc}
    for key, tensors in io.items():
        ok = isinstance(tensors, list) and all(
            isinstance(t, dict) and set(t) <= {"name", "data_type", "dims"} for t in tensors
        )
        if not ok:
            raise ConfigError(
                f"{where}: {key} must be a list of {{name, data_type, dims}}; other fields "
                f"(reshape, format, ...) are not supported."
            )
    if io:
        out["io"] = io
    return out


def _them(names: list) -> str:
    return "it" if len(names) == 1 else "them"


def _dynamic_batching(batching: Any, where: str) -> dict:
    """The settings of a configuration's ``dynamic_batching``."""
    if not isinstance(batching, dict):
        raise ConfigError(f"{where}: dynamic_batching must be an object.")
    extra = [
        k for k in batching if k not in ("max_queue_delay_microseconds", "preferred_batch_size")
    ]
    if extra:
        raise ConfigError(
            f"{where}: dynamic_batching {', '.join(map(repr, extra))} not supported; this "
            f"server applies max_queue_delay_microseconds and preferred_batch_size."
        )
    delay = batching.get("max_queue_delay_microseconds", 0)
    if isinstance(delay, str) and delay.isdigit():  # protobuf's JSON form of a uint64
        delay = int(delay)
    if isinstance(delay, bool) or not isinstance(delay, int) or delay < 0:
        raise ConfigError(f"{where}: max_queue_delay_microseconds {delay!r:.40} must be >= 0.")
    preferred = batching.get("preferred_batch_size", [])
    if not (isinstance(preferred, list) and all(isinstance(p, int) for p in preferred)):
        raise ConfigError(f"{where}: preferred_batch_size must be a list of ints.")
    return {"batching": True, "max_batch_delay_ms": delay / 1e3, "preferred": sorted(preferred)}


def read_config(path: Path, *, name: str) -> dict:
    """The settings of a Triton ``config.pbtxt`` (protobuf text form), per `model_settings`."""
    from google.protobuf import json_format, text_format

    from jaxnitro.serve.proto import grpc_service_pb2 as pb

    try:
        text = path.read_text()
        message = text_format.Parse(text, pb.ModelConfig())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not readable ({e}).") from None
    except text_format.ParseError as e:
        raise ConfigError(
            f"{path}: {e}; jaxnitro serve applies {', '.join(CONFIG_FIELDS)} (a field it "
            f"does not know is refused, not ignored): remove the others."
        ) from None
    doc = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return model_settings(doc, name=name, where=str(path))


def check_io(config: Mapping[str, Any], io: Mapping[str, list], *, where: str) -> None:
    """A `ConfigError` unless the declared ``input``/``output`` are the model's own (as its
    configuration `ServedModel.config` writes them)."""
    for key, declared in io.items():
        have = {t["name"]: (t["data_type"], list(t["dims"])) for t in config[key]}
        want = {
            t.get("name"): (t.get("data_type", "TYPE_INVALID"), [int(d) for d in t.get("dims", [])])
            for t in declared
        }
        if want != have:
            raise ConfigError(
                f"{where}: {key} {want} does not match the bundle's {have}; leave {key} out "
                f"(the bundle defines it) or write the bundle's."
            )


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
        for version, model in list(loaded.items()):
            if (
                versions
                and model.settings is not None
                and _batching(model.settings) != _batching(settings)
            ):
                # its config.pbtxt (or a load's config) changed: it loads again with it
                log.info(
                    "model %s version %s: its configuration changed; loading it again",
                    quoted(name),
                    version,
                )
                del loaded[version]
                await self.runtime.retire(model)
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
