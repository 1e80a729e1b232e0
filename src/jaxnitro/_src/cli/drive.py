"""The tools `jaxnitro mcp` serves, as plain Python: set up runs, train them in the
background, steer, evaluate, predict, export, list and read them, every path confined to one
root directory.

Nothing here imports the `mcp` SDK (`cli/mcp.py` does, and only there): each tool is a
method of `Workspace` taking and returning JSON values, so it can be called and tested
without a server. A jaxnitro error is raised as it is; the server turns it into a tool error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import threading
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path, PurePath
from types import UnionType
from typing import Any, BinaryIO

import numpy as np

from jaxnitro._src.cli import values as values_mod
from jaxnitro._src.cli.confine import PathError, confine, open_inside, vet_module
from jaxnitro._src.core.errors import ConfigError, clip, did_you_mean
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.experiment.markers import DEVICE, fields
from jaxnitro._src.observe.runs import LOG_NAME, find_runs, run_info
from jaxnitro._src.run import options as opts
from jaxnitro._src.train import background

# Options that are paths (run_dir, checkpoint, resume): confined to the root like every
# other path, whether a tool's options, its fields (a field named like an option sets it), a
# preset or the class's defaults give them.
_PATH_OPTIONS = tuple(o.name for o in opts.OPTIONS if o.value and "path" in o.type.split(" | "))

__all__ = ["PathError", "Workspace", "options_schema"]


class Workspace:
    """The runs one `jaxnitro mcp` server drives, and the root every path stays under.

    Example:
        >>> ws = Workspace("/tmp/work")
        >>> run = ws.setup("examples/mnist.py:MnistMLP", options={"max_epochs": 1})
        >>> ws.train(run["id"])["phase"]
    """

    def __init__(self, root: str | Path = ".", *, max_runs: int = 4) -> None:
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise ConfigError(f"--root {str(root)!r} is not a directory; pass an existing one.")
        self.max_runs = max_runs  # runs training at once (each holds threads and memory)
        self._runs: dict[str, Any] = {}  # run id -> its jn.Nitro
        self._handles: dict[str, background.RunHandle] = {}
        self._classes: dict[str, tuple[int | None, Any]] = {}  # TARGET -> (file stamp, class)
        self._lock = threading.Lock()

    # -- paths --------------------------------------------------------------------------
    def path(self, value: str | os.PathLike, *, what: str) -> Path:
        """`value` (relative to the root, or absolute inside it) resolved; a `PathError`
        when it leaves the root: `..`, an absolute path elsewhere, a symlink pointing out."""
        return confine(self.root, value, what=what)

    # -- runs ---------------------------------------------------------------------------
    def _nitro(self, run_id: str):
        with self._lock:
            n = self._runs.get(run_id)
            known = sorted(self._runs)
        if n is None:
            raise ConfigError(
                f"no run {run_id!r} on this server; runs: {known or 'none (setup makes one)'}."
                + did_you_mean(run_id, known)
            )
        return n

    def _idle(self, run_id: str, what: str):
        """The run's handle, refused while it trains in the background."""
        n = self._nitro(run_id)
        handle = self._handles.get(run_id)
        if handle is not None and not handle.done:
            raise ConfigError(
                f"run {run_id} is training ({n.phase}, step {n.step}); {what} waits until it "
                f"ends. Call stop (or poll status until phase is Done) first."
            )
        return n

    def setup(
        self,
        target: str,
        preset: str | None = None,
        fields: dict[str, Any] | None = None,
        options: dict[str, Any] | None = None,
        overrides: str | None = None,
    ) -> dict[str, Any]:
        """Load TARGET, build the experiment and set up a run (nothing compiled)."""
        from jaxnitro._src.run.nitro import Nitro

        cls = self._load(target)
        infos = {f.name: f for f in _fields(cls)}
        given_fields = {k: self._field_json(infos, k, v) for k, v in (fields or {}).items()}
        given_options = dict(options or {})
        for name in given_options:
            _settable_option(name)
        for key, text in _overrides(overrides, infos, taken={**given_fields, **given_options}):
            if key in infos:
                given_fields[key] = _parse(infos[key].type, text, key)
            else:
                opt = opts.BY_NAME[key]
                assert opt.parse is not None
                given_options[key] = _parse_option(opt, text)
        own = {o.name for o in opts.OPTIONS}
        for name, value in given_fields.items():  # a field typed Path: a path like any other
            if _is_path_type(infos[name].type) and isinstance(value, str | os.PathLike):
                given_fields[name] = self.path(value, what=f"field {cls.__name__}.{name}")
        given_options.setdefault("progress", False)  # stdout is the protocol's
        try:
            exp = cls.from_preset(preset, **given_fields) if preset else cls(**given_fields)
        except TypeError as e:
            raise ConfigError(f"{cls.__name__}: {clip(str(e), 1000)}") from None
        # Every path option as the run will read it (keyword > field > default), confined.
        resolved = opts.resolve(exp, given_options)
        for name in _PATH_OPTIONS:
            value = resolved[name]
            if isinstance(value, str | os.PathLike) and not (name == "resume" and value == "auto"):
                what = (
                    name
                    if given_options.get(name) is not None
                    else f"{name} (set by the field {cls.__name__}.{name})"
                )
                given_options[name] = self.path(value, what=what)
        if given_options.get("run_dir") is None:
            given_options["run_dir"] = self._fresh_dir(cls.__name__)
        n = Nitro(exp, **{k: v for k, v in given_options.items() if k in own})
        run_id = background.run_id(n)
        with self._lock:
            self._runs[run_id] = n
        return {
            "id": run_id,
            "run_dir": str(n.run_dir),
            "experiment": cls.__name__,
            "fields": {f.name: _field_entry(f, exp, resolved) for f in _fields(cls)},
            "max_epochs": n.max_epochs,
            "total_steps": n.spec.total_steps,
            "splits": sorted(n.spec.splits),
        }

    def _load(self, target: str) -> Any:
        """TARGET's class; a file is loaded again only once it changed (loading it again
        re-defines the class, which the handles made from the old one would warn about)."""
        from jaxnitro._src.cli.target import load_target

        left, sep, name = target.rpartition(":")
        stamp = None
        if sep and (left.endswith(".py") or "/" in left):  # a file: confined like any path
            path = self.path(left, what="target file")
            target = f"{path}:{name}"
            stamp = path.stat().st_mtime_ns if path.is_file() else None
        cached = self._classes.get(target)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        try:
            cls = load_target(target, vet_module=lambda name: vet_module(self.root, name))
        except PathError:
            raise
        except Exception as e:  # a click.UsageError: its message says what is missing
            raise ConfigError(str(getattr(e, "message", e))) from None
        self._classes[target] = (stamp, cls)
        return cls

    def _fresh_dir(self, name: str) -> Path:
        base = self.root / "runs"
        for i in range(1, 10_000):
            path = base / f"{name}-{i}"
            if not path.exists():
                return path
        raise ConfigError(f"{base} holds 9999 runs of {name}; pass options.run_dir.")

    def _field_json(self, infos: Mapping[str, Any], name: str, value: Any) -> Any:
        if name not in infos:
            raise ConfigError(
                f"unknown field {name!r}; fields: {sorted(infos)}." + did_you_mean(name, infos)
            )
        return values_mod.from_json(infos[name].type, value)

    def train(self, run_id: str) -> dict[str, Any]:
        n = self._idle(run_id, "train")
        with self._lock:  # counted and started under the lock: two calls cannot both pass
            training = sorted(i for i, h in self._handles.items() if not h.done)
            if len(training) >= self.max_runs:
                raise ConfigError(
                    f"{len(training)} runs are training ({', '.join(training)}) and this server "
                    f"trains at most {self.max_runs} at once (jaxnitro mcp --max-runs "
                    f"{self.max_runs}); stop one (the stop tool) or wait until one ends, then "
                    f"call train again, or restart the server with a larger --max-runs."
                )
            handle = background.start(n)
            self._handles[run_id] = handle
        return handle.status()

    def status(self, run_id: str) -> dict[str, Any]:
        n = self._nitro(run_id)
        handle = self._handles.get(run_id)
        if handle is not None:
            return handle.status()
        return {"id": run_id, "phase": "Set up", "epoch": n.epoch, "step": n.step}

    def _handle(self, run_id: str, what: str) -> background.RunHandle:
        self._nitro(run_id)
        handle = self._handles.get(run_id)
        if handle is None or handle.done:
            raise ConfigError(
                f"run {run_id} is not training, so there is nothing to {what}; call train "
                f"first (status says where it is)."
            )
        return handle

    def stop(self, run_id: str, wait: bool = False, timeout: float = 300.0) -> dict[str, Any]:
        handle = self._handle(run_id, "stop")
        handle.stop()
        if wait:
            handle.wait(timeout)
        return handle.status()

    def checkpoint(self, run_id: str, timeout: float = 300.0) -> dict[str, Any]:
        path = self._handle(run_id, "checkpoint").checkpoint(wait=True, timeout=timeout)
        return {"id": run_id, "checkpoint": None if path is None else str(path)}

    def set_device(self, run_id: str, values: dict[str, Any]) -> dict[str, Any]:
        from jaxnitro._src.run.live import checked_device, set_device

        n = self._nitro(run_id)
        other = {f.name for f in _fields(n.experiment) if f.marker != DEVICE}
        if other & set(values):  # a GraphConst or host field: what the Python API says
            checked_device(n, {k: values[k] for k in values if k in other})
        infos = {f.name: f for f in _fields(n.experiment) if f.marker == DEVICE}
        given = {k: self._field_json(infos, k, v) for k, v in values.items()}
        handle = self._handles.get(run_id)
        if handle is not None and not handle.done:
            handle.set_device(**given)
            return {"id": run_id, "values": jsonable(given), "applies": "from the next step"}
        set_device(n, **given)
        return {"id": run_id, "values": jsonable(given), "applies": "now"}

    def set_lr(self, run_id: str, rate: float | dict[str, float]) -> dict[str, Any]:
        from jaxnitro._src.run.rates import set_lr

        handle = self._handles.get(run_id)
        if handle is not None and not handle.done:
            handle.set_lr(rate)
            return {"id": run_id, "rate": rate, "applies": "from the next step"}
        set_lr(self._nitro(run_id), rate)
        return {"id": run_id, "rate": rate, "applies": "now"}

    def validate(self, run_id: str) -> dict[str, Any]:
        from jaxnitro._src.train.evaluation import validate

        return {"metrics": jsonable(validate(self._idle(run_id, "validate")))}

    def evaluate(self, run_id: str, split: str = "test") -> dict[str, Any]:
        from jaxnitro._src.train.evaluation import evaluate

        return {
            "split": split,
            "metrics": jsonable(evaluate(self._idle(run_id, "evaluate"), split)),
        }

    def predict(self, run_id: str, inputs: dict[str, Any]) -> dict[str, Any]:
        from jaxnitro._src.train.prediction import predict

        n = self._idle(run_id, "predict")
        batch = {k: _array(v) for k, v in inputs.items()}
        return {"outputs": jsonable(predict(n, batch))}

    def export(self, run_id: str, directory: str, name: str | None = None) -> dict[str, Any]:
        from jaxnitro._src.export.writer import export_model

        n = self._idle(run_id, "export")
        out = self.path(directory, what="export directory")
        return {"bundle": str(export_model(n, out, name=name, platforms=("cpu",)))}

    def runs(self, directory: str = "runs") -> dict[str, Any]:
        where = self.path(directory, what="runs directory")
        ids = {str(n.run_dir.resolve()): run_id for run_id, n in self._runs.items()}
        found = find_runs(where) if where.is_dir() else []
        # A run whose log is a link out of the root is not read (nor listed).
        inside = [d for d in found if (d / LOG_NAME).resolve().is_relative_to(self.root)]
        rows = []
        for info in sorted(map(run_info, inside), key=lambda r: r.updated, reverse=True):
            row = info.to_dict()
            row["id"] = ids.get(str(Path(info.run_dir).resolve()))
            rows.append(row)
        return {"runs": rows}

    def inspect(self, run_id: str) -> dict[str, Any]:
        from jaxnitro._src.train.introspect import inspect

        n = self._idle(run_id, "inspect")
        report = inspect(n, show=False)
        from jaxnitro._src.train.introspect import memory_plan

        return {
            "programs": [jsonable(dataclasses.asdict(r)) for r in report.records],
            "notes": [note.strip() for note in report.notes],
            "memory": jsonable(dataclasses.asdict(memory_plan(n))),
        }

    def logs(self, run_id: str, lines: int = 20, context: str | None = None) -> dict[str, Any]:
        with self._read(run_id, LOG_NAME) as log:
            rows = [] if log is None else background.tail_rows(log, max(0, lines), context=context)
        return {"lines": rows}

    def metrics_text(self, run_id: str) -> str:
        """The run's metrics.jsonl ('' before it is written)."""
        with self._read(run_id, LOG_NAME) as log:
            return "" if log is None else log.read().decode("utf-8", errors="replace")

    def curves_png(self, run_id: str) -> bytes:
        """The run's curves.png, drawn from its metrics.jsonl when missing."""
        from jaxnitro._src.observe.plot import plot

        n = self._nitro(run_id)
        run_dir = self.path(n.run_dir, what="run_dir")
        self.path(run_dir / LOG_NAME, what="metrics log")  # plot reads it: no link out
        if not (run_dir / "curves.png").exists():
            plot([run_dir], out=self.path(run_dir / "curves.png", what="curves"))
        with self._read(run_id, "curves.png") as png:
            return b"" if png is None else png.read()

    @contextlib.contextmanager
    def _read(self, run_id: str, name: str) -> Iterator[BinaryIO | None]:
        """A file of the run's directory open for reading (None while it does not exist);
        a `PathError` when it is a link out of the root (planted after setup)."""
        path = self._nitro(run_id).run_dir / name
        if not os.path.lexists(path):
            yield None
            return
        with open_inside(self.root, path, what=f"run {run_id}'s {name}") as f:
            yield f


def _array(value: Any) -> np.ndarray:
    """A JSON array as the model takes it: JSON numbers are float64, JAX computes in float32
    unless x64 is on."""
    import jax

    arr = np.asarray(value)
    if arr.dtype == np.float64 and not jax.config.read("jax_enable_x64"):
        arr = arr.astype(np.float32)
    return arr


def _field_entry(f: Any, exp: Any, resolved: Mapping[str, Any]) -> dict[str, Any]:
    """A field as `setup` shows it; a field named like a value option that the option's
    keyword overrides (`options.max_epochs` over the field) says what the run uses."""
    value = getattr(exp, f.name)
    entry = {"marker": f.marker, "type": values_mod.type_name(f.type), "value": _value_json(value)}
    option = opts.BY_NAME.get(f.name)
    if option is not None and option.reads_field and resolved[f.name] != value:
        entry["run_uses"] = _value_json(resolved[f.name])  # jn.Nitro's keyword wins
    return entry


def _value_json(value: Any) -> Any:
    """A field's value as JSON (a path as its text)."""
    return os.fspath(value) if isinstance(value, PurePath) else jsonable(value)


def _is_path_type(typ: Any) -> bool:
    """Whether a field's type is a path (`Path`, `Path | None`, ...)."""
    kinds = typing.get_args(typ) if typing.get_origin(typ) in (typing.Union, UnionType) else (typ,)
    return any(isinstance(k, type) and issubclass(k, os.PathLike | PurePath) for k in kinds)


def _settable_option(name: str) -> opts.Option:
    """A run option a tool may set: a value option (JSON can carry it)."""
    opt = opts.lookup(name, where="setup's options")
    if not opt.value:
        names = [o.name for o in opts.OPTIONS if o.value]
        raise ConfigError(
            f"option {name!r} takes a Python object ({opt.type}) and cannot be set here; "
            f"options a tool sets: {names}."
        )
    return opt


def _fields(cls_or_exp) -> tuple:
    return fields(cls_or_exp)


_KEY = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", re.S)


def _overrides(text: str | None, infos: Mapping[str, Any], *, taken: Mapping[str, Any]):
    """`"a=1, b=[1, 2]"` as (key, value text) pairs; an unknown key, a key given twice (or
    also as a typed argument) is a ConfigError naming the valid keys."""
    if not text or not text.strip():
        return []
    valid = sorted(infos) + [o.name for o in opts.OPTIONS if o.value]
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    for part in values_mod.split_list(text):
        m = _KEY.match(part)
        if m is None:
            raise ConfigError(
                f"overrides: {part!r} is not key=value; write e.g. 'width=64, max_epochs=3'."
            )
        key, value = m.group(1), m.group(2).strip()
        if key not in valid:
            raise ConfigError(
                f"overrides: unknown key {key!r}; fields and options: {valid}."
                + did_you_mean(key, valid)
            )
        if key in seen or key in taken:
            raise ConfigError(
                f"overrides: {key!r} is given twice"
                + (" (also as a typed argument)" if key in taken else "")
                + "; give each key once."
            )
        seen.add(key)
        out.append((key, value))
    return out


def _parse(typ, text: str, key: str) -> Any:
    try:
        return values_mod.parse(typ, text)
    except ValueError as e:
        raise ConfigError(f"overrides: {key}={text!r}: {e}.") from None


def _parse_option(opt: opts.Option, text: str) -> Any:
    assert opt.parse is not None
    try:
        return opt.parse(text)
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"overrides: {opt.name}={text!r}: {e}") from None


# -- JSON schemas from the option declarations ---------------------------------------------
def _type_schema(part: str) -> dict[str, Any] | None:
    part = part.strip()
    simple: dict[str, dict[str, Any]] = {
        "int": {"type": "integer"},
        "float": {"type": "number"},
        "bool": {"type": "boolean"},
        "str": {"type": "string"},
        "path": {"type": "string"},
        "list[str]": {"type": "array", "items": {"type": "string"}},
        "dict": {"type": "object"},
    }
    if part in simple:
        return simple[part]
    if len(part) > 1 and part[0] == part[-1] == "'":
        return {"const": part[1:-1]} if ":" not in part else {"type": "string"}
    return None  # a Python object (a Sharding, a Logger): not JSON


def options_schema() -> dict[str, Any]:
    """A JSON schema of the run options a tool sets (each value option, typed and
    documented from `run/options.py`)."""
    props: dict[str, Any] = {}
    for o in opts.OPTIONS:
        if not o.value:
            continue
        kinds = [s for s in (_type_schema(p) for p in o.type.split(" | ")) if s is not None]
        kinds.append({"type": "null"})
        default = o.default if isinstance(o.default, int | float | str | bool) else None
        props[o.name] = {"anyOf": kinds, "description": o.doc, "default": default}
    return {"type": "object", "properties": props, "additionalProperties": True}
