"""A model's configuration, as Triton writes it: a ``config.pbtxt`` in the model's directory
(protobuf text) or the ``config`` parameter of a load request (its JSON form), and the other
parameters of the repository API. What this server has a knob for is applied
(``max_batch_size``, ``dynamic_batching``, ``version_policy``), what describes the model is
checked against it (``name``, ``platform``/``backend``, ``input``, ``output``), and anything
else is refused with its name: never accepted and ignored.

Version policies (Triton's ``version_policy``, in its JSON form in ``policy.json`` or
``config.pbtxt``, or a flag for the models without one): ``{"latest": {"num_versions": N}}``
(the default, N=1), ``{"all": {}}``, ``{"specific": {"versions": [1, 3]}}``; on the command
line ``latest:N``, ``all``, ``specific:1,3``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.serve.errors import InvalidRequest

CONFIG_FILE = "config.pbtxt"
DEFAULT_POLICY: dict = {"latest": {"num_versions": 1}}
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

    from jaxnitro._src.serve.proto import grpc_service_pb2 as pb

    try:
        text = path.read_text()
        message = text_format.Parse(text, pb.ModelConfig())
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not readable ({e}).") from None
    except text_format.ParseError as e:
        raise ConfigError(
            f"{path}: {str(e).rstrip('.')}; jaxnitro serve applies "
            f"{', '.join(CONFIG_FIELDS)} (a field it does not know is refused, not "
            f"ignored): remove the others."
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
