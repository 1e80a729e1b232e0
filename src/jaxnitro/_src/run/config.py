"""TOML config files: `run_dir/config.toml`, and `jaxnitro train --config FILE.toml`.

A config file holds `target = "pkg.mod:Class"` (or `"path/file.py:Class"`), an optional
`preset`, a `[fields]` table (the experiment's fields) and an `[options]` table (the value
options of `jn.Nitro`, declared in `run/options.py`). Every `jn.train` writes the resolved one
(every field, every value option, the jaxnitro version) to `run_dir/config.toml`, and
`jaxnitro train --config run_dir/config.toml` repeats the run. Read with `tomllib`, written
with `tomli_w`; a value TOML cannot hold (None, an object) is listed in a comment instead.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import tomllib
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import tomli_w

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.experiment.markers import fields
from jaxnitro._src.run import options

if TYPE_CHECKING:
    from jaxnitro._src.core.types import Experiment

KEYS = ("target", "preset", "jaxnitro_version", "fields", "options")
_SKIP = object()


def target_of(cls: type) -> str:
    """How TARGET names `cls`: `pkg.mod:Class`, or `path/file.py:Class` for a script or a
    single-file module (run by path, which needs no `sys.path` entry)."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    if file and (cls.__module__ == "__main__" or Path(file).stem == cls.__module__):
        path = Path(file).resolve()
        try:
            path = path.relative_to(Path.cwd())
        except ValueError:
            pass
        return f"{path.as_posix()}:{cls.__qualname__}"
    return f"{cls.__module__}:{cls.__qualname__}"


def toml_value(value: Any) -> Any:
    """`value` as TOML can hold it, or `_SKIP` (None, an object, a dict with other keys)."""
    if isinstance(value, (bool, int, float, str)) and not isinstance(value, enum.Enum):
        return value
    if isinstance(value, np.generic) and value.ndim == 0:
        return toml_value(value.item())
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        items = [toml_value(v) for v in value]
        return _SKIP if any(v is _SKIP for v in items) else items
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        table = {k: toml_value(v) for k, v in value.items()}
        return _SKIP if any(v is _SKIP for v in table.values()) else table
    return _SKIP


def run_config(exp: Experiment, given: Mapping[str, Any]) -> dict[str, Any]:
    """The resolved config of `jn.Nitro(exp, **given)`: target, every field, every value
    option (keyword > field > default) but those a field of the same name sets to the same
    value (`max_epochs`: under [fields] only); values TOML cannot hold go to
    `not_written`."""
    raw = options.resolve(exp, given)
    if raw["run_dir"] is None:
        raw["run_dir"] = f"runs/{type(exp).__name__}"
    skipped: dict[str, str] = {}
    out_fields: dict[str, Any] = {}
    for f in fields(exp):
        value = getattr(exp, f.name)
        out_fields[f.name] = toml_value(value)
        if out_fields[f.name] is _SKIP:
            skipped[f"fields.{f.name}"] = _what(value)
            del out_fields[f.name]
    out_options: dict[str, Any] = {}
    for o in options.OPTIONS:
        value = toml_value(raw[o.name]) if o.value else _SKIP
        if o.reads_field and o.name in out_fields and out_fields[o.name] == value:
            continue  # the field sets it: one entry, under [fields], not two
        if value is not _SKIP:
            out_options[o.name] = value
        elif raw[o.name] is not None and (given.get(o.name) is not None or o.value):
            skipped[f"options.{o.name}"] = _what(raw[o.name]) + ("" if o.value else ", Python only")
    from jaxnitro._src.core.version import __version__

    return {
        "target": target_of(type(exp)),
        "preset": None,
        "jaxnitro_version": __version__,
        "fields": out_fields,
        "options": out_options,
        "not_written": skipped,
    }


def _what(value: Any) -> str:
    return "None" if value is None else f"a {type(value).__name__}"


def to_toml(config: Mapping[str, Any]) -> str:
    """The config file's text: a header (with what could not be written), then the TOML."""
    head = [
        "# jaxnitro run config: `jaxnitro train --config config.toml` repeats this run",
        "# (flags win over this file: --run-dir DIR to write elsewhere).",
    ]
    for name, what in (config.get("not_written") or {}).items():
        head.append(f"# not written (no TOML value): {name} = {what}")
    body = {k: config[k] for k in KEYS if config.get(k) is not None}
    return "\n".join(head) + "\n\n" + tomli_w.dumps(body)


def write(run_dir: Path, config: Mapping[str, Any]) -> None:
    """`run_dir/config.toml`, replaced atomically. A file TARGET is written relative to
    `run_dir` (where `target_in` resolves it), so the run repeats from any directory."""
    path = Path(run_dir) / "config.toml"
    target = config.get("target")
    if isinstance(target, str) and _file_form(target):
        file, _, name = target.rpartition(":")
        at = Path(file).resolve() if Path(file).exists() else Path(file)
        with contextlib.suppress(ValueError):  # on another drive: stays absolute
            at = Path(os.path.relpath(at, Path(run_dir).resolve())) if at.is_absolute() else at
        config = {**config, "target": f"{Path(at).as_posix()}:{name}"}
    tmp = path.with_name(f".config.toml.{os.getpid()}.tmp")
    tmp.write_text(to_toml(config), encoding="utf-8")
    os.replace(tmp, path)


def target_in(data: Mapping[str, Any], path: Path) -> str | None:
    """The config file's `target`, a relative file path resolved against the file's own
    directory (as `run_dir/config.toml` records it); one that is not there is taken from
    the working directory, as a hand-written config beside the project may mean it."""
    target = data.get("target")
    if not isinstance(target, str) or not _file_form(target):
        return target
    file, _, name = target.rpartition(":")
    if Path(file).expanduser().is_absolute():
        return target
    beside = Path(os.path.normpath(Path(path).parent / file))
    return f"{beside.as_posix()}:{name}" if beside.is_file() or not Path(file).is_file() else target


def _file_form(target: str) -> bool:
    left = target.rpartition(":")[0]
    return left.endswith(".py") or "/" in left or os.sep in left


def read(path: Path) -> dict[str, Any]:
    """A config file, checked: known keys (did-you-mean), every option's value (each the
    way `jn.Nitro` checks it). A `ConfigError` names the file and the key."""
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as e:
        raise ConfigError(f"config file {path}: cannot read it ({e}).") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}.") from None
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not text (TOML is UTF-8; byte {e.object[e.start]:#04x} at "
            f"offset {e.start} is not); is it the right file? A config file looks like "
            f"`jaxnitro train TARGET --print-config` prints."
        ) from None
    for key in data:
        if key not in KEYS:
            raise ConfigError(
                f"config file {path}: unknown key {key!r}; a config file has {list(KEYS)}."
                + did_you_mean(key, KEYS)
            )
    for key, kind in (("target", str), ("preset", str), ("fields", dict), ("options", dict)):
        if key in data and not isinstance(data[key], kind):
            what = "a string" if kind is str else f"a table ([{key}])"
            raise ConfigError(
                f"config file {path}: {key} must be {what}, got {type(data[key]).__name__}."
            )
    for name, value in (data.get("options") or {}).items():
        option = options.lookup(name, where=f"config file {path}: [options]")
        if not option.value:
            raise ConfigError(
                f"config file {path}: [options] {name} cannot be set in a config file (its "
                f"value is a Python object); pass {name}=... to jn.Nitro in Python."
            )
        try:
            option.check(value)
        except ConfigError as e:
            raise ConfigError(f"config file {path}: [options] {name} = {value!r}: {e}") from None
    return data


def field_values(data: Mapping[str, Any], cls: type, path: Path) -> dict[str, Any]:
    """The `[fields]` of a config file as `cls`'s fields take them (lists become tuples
    where a field is a tuple); an unknown field is a `ConfigError` with a did-you-mean."""
    known = {f.name: f for f in fields(cls)}
    out = {}
    for name, value in (data.get("fields") or {}).items():
        if name not in known:
            raise ConfigError(
                f"config file {path}: [fields] {name!r} is no field of {cls.__name__}; its "
                f"fields: {sorted(known)}." + did_you_mean(name, known)
            )
        kind = typing.get_origin(known[name].type) or known[name].type
        if isinstance(value, list) and kind in (tuple, set, frozenset):
            value = kind(value)
        elif isinstance(value, str) and kind is Path:
            value = Path(value)
        out[name] = value
    return out
