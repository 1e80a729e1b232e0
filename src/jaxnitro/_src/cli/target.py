"""TARGET: the experiment class a command runs, `path/to/file.py:Class` or `pkg.module:Class`."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import click

from jaxnitro._src.core.errors import clip, did_you_mean
from jaxnitro._src.experiment.markers import is_experiment

FORMS = "path/to/file.py:Class or pkg.module:Class"


class TargetError(click.UsageError):
    """A TARGET that does not name an experiment class (exit status 2)."""


def looks_like_target(token: str) -> bool:
    """Whether a command-line token has TARGET's shape (used to find it among field options)."""
    left, sep, right = token.rpartition(":")
    return bool(sep and left and right and right.replace(".", "").replace("_", "").isalnum())


def load_target(target: str, *, vet_module: Callable[[str], None] | None = None) -> type:
    """The experiment class `target` names; a `TargetError` says what was not found.

    A file is loaded by path (its directory goes on `sys.path`, as `python file.py` would put
    it, so it can import its neighbours); a module is imported (the working directory is on
    `sys.path`, as with `python -m`). With `vet_module`, a module is first passed to it (it
    raises to refuse one) and the working directory is not put on `sys.path`: `jaxnitro mcp`
    imports only modules of its root or of trusted installed places.

    Example:
        >>> load_target("examples/mnist.py:MnistMLP").__name__
        'MnistMLP'
    """
    left, sep, name = target.rpartition(":")
    if not sep or not left or not name:
        raise TargetError(
            f"TARGET {_show(target)} names no class: write {FORMS}, e.g. "
            f"examples/mnist.py:MnistMLP."
        )
    is_file = left.endswith(".py") or "/" in left or os.sep in left
    if is_file:
        module = _load_file(left, target)
    else:
        if vet_module is not None:
            vet_module(left)
        module = _import(left, target, cwd=vet_module is None)
    obj: object = module
    for part in name.split("."):  # Outer.Inner works too
        if not hasattr(obj, part):
            found = [k for k, v in vars(module).items() if is_experiment(v) and inspect.isclass(v)]
            raise TargetError(
                f"{clip(left)} has no class {_show(name)} (TARGET {_show(target)}); "
                f"experiments in it: {sorted(found) or 'none'}."
                + did_you_mean(name, found)
                + f" TARGET is {FORMS}."
            )
        obj = getattr(obj, part)
    if not (inspect.isclass(obj) and is_experiment(obj)):
        raise TargetError(
            f"{clip(target)} is {type(obj).__name__ if not inspect.isclass(obj) else 'a class'} "
            f"{_show(name)}, not an experiment; decorate the class with @jn.experiment (TARGET is "
            f"{FORMS})."
        )
    return obj


def _load_file(path_str: str, target: str) -> ModuleType:
    path = Path(path_str).expanduser()
    if not path.is_file():
        raise TargetError(
            f"no file {_show(path_str)} (TARGET {_show(target)}, from {Path.cwd()}); TARGET "
            f"is {FORMS}."
        )
    path = path.resolve()
    name = path.stem if path.stem.isidentifier() else "jaxnitro_target"
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != str(path):
        name = f"jaxnitro_target_{name}"  # never shadow an imported module of that name
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise TargetError(
            f"{clip(path_str)} cannot be loaded as a Python file (TARGET {_show(target)})."
        )
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and type hints look the module up by name
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _import(module_name: str, target: str, *, cwd: bool) -> ModuleType:
    if cwd and "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name + ".").startswith(e.name + "."):
            raise  # the module exists and one of its own imports is missing: show that
        raise TargetError(
            f"no module {_show(module_name)} (TARGET {_show(target)}; {clip(repr(e.name))} not "
            f"found); TARGET is {FORMS}."
        ) from None


def _show(value: str) -> str:
    """A value the caller gave, quoted and cut (`core.errors.clip`) for an error message."""
    return clip(repr(value))
