"""What a program traces, fingerprinted: the hooks of each kind of program, the experiment's
methods, class values and model code they reach (`traced_code`), and their fingerprints
(`hook_prints`), which a program's key holds and an entry point compares to find an edit.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect as pyinspect
import types
from typing import TYPE_CHECKING, Any

from jaxnitro._src.compile import explain
from jaxnitro._src.compile.fingerprint import (
    fingerprint,
    fingerprint_reach,
    fingerprint_value,
    is_library_class,
)
from jaxnitro._src.experiment import models

if TYPE_CHECKING:
    from jaxnitro._src.programs.spec import ProgramSpec


_TRACED_HOOKS = ("forward", "loss", "metrics", "train_metrics", "train_step")
# The hooks each kind of program traces: a program's key holds their fingerprints only, so
# editing `metrics` never invalidates the train program.
_KIND_HOOKS = {
    "train": ("forward", "loss", "train_metrics"),
    "eval": ("forward", "loss", "metrics"),
    "predict": ("forward",),
}


def _kind_hooks(spec: ProgramSpec, kind: str) -> tuple[str, ...]:
    """The hooks a kind of program traces; a custom step's train program traces that hook
    (and what it reaches through `self`) instead of forward and loss."""
    if kind == "train" and "train_step" in spec.routes:
        return ("train_step",)
    return _KIND_HOOKS[kind]


def _code_names(code: Any) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def traced_functions(
    spec: ProgramSpec, hooks: tuple[str, ...] = _TRACED_HOOKS, gaps: list[str] | None = None
) -> dict[str, Any]:
    """The traced `hooks`, plus the experiment's methods and properties they reach via `self`.

    `self.helper(...)` is an attribute load, invisible to a function fingerprint; following
    the names the code loads (three levels) puts an edited helper method into the key. A
    method still unfollowed below that goes into `gaps` (the key cannot prove it unchanged).
    """
    out: dict[str, Any] = {}
    frontier = [h for h in hooks if h in spec.routes]
    fields = spec.cls.__jn_fields__
    for _ in range(3):
        nxt = []
        for name in frontier:
            if name in out or name in fields or name.startswith("__"):
                continue
            attr = pyinspect.getattr_static(spec.cls, name, None)
            fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
            if isinstance(fn, (functools.partial, functools.partialmethod)):
                # `loss = functools.partialmethod(generic, k=1.0)`: the partial is the hook
                # (its arguments are in its fingerprint); follow the function underneath
                out[name] = fn
                inner = _partial_root(fn)
                if pyinspect.isfunction(inner):
                    nxt += sorted(_code_names(inner.__code__))
                continue
            if not pyinspect.isfunction(fn):
                continue
            out[name] = fn
            nxt += sorted(_code_names(fn.__code__))
        frontier = nxt
    if gaps is not None:
        deeper = [n for n in frontier if n not in out and _is_method(spec.cls, n)]
        gaps += [f"method `{n}` below the three levels followed" for n in deeper[:1]]
    return out


def _is_method(cls: Any, name: str) -> bool:
    if name in cls.__jn_fields__ or name.startswith("__"):
        return False
    attr = pyinspect.getattr_static(cls, name, None)
    fn = attr.fget if isinstance(attr, property) else getattr(attr, "__func__", attr)
    return pyinspect.isfunction(fn) or isinstance(fn, (functools.partial, functools.partialmethod))


def _partial_root(fn: Any) -> Any:
    """The function under nested partials and partialmethods."""
    while isinstance(fn, (functools.partial, functools.partialmethod)):
        fn = fn.func
    return getattr(fn, "__func__", fn)


@dataclasses.dataclass(frozen=True, eq=False)
class ClassValue:
    """A class-level value of the experiment that traced code reads as `self.NAME` (not a
    field, not a method): `SCALE = 1.3`, `act = staticmethod(jnp.tanh)`."""

    value: Any


def class_values(spec: ProgramSpec, functions: dict[str, Any]) -> dict[str, ClassValue]:
    """``self.NAME`` -> the class-level value, for every name the traced `functions` load
    that the experiment's class (or a base) holds as a plain value or a callable that is not
    a Python function (a `jnp` function, a `functools.partial`, a wrapper object).

    A name loaded as an attribute of something else (`x.shape`) that the class also holds
    is keyed too: a harmless extra (it recompiles only when that class value changes).
    """
    fields = spec.cls.__jn_fields__
    names: set[str] = set()
    for fn in functions.values():
        code = getattr(_partial_root(fn), "__code__", None)
        if code is not None:
            names |= _code_names(code)
    out = {}
    for name in sorted(names):
        if name in fields or name in functions or name.startswith("__"):
            continue
        attr = pyinspect.getattr_static(spec.cls, name, _ABSENT)
        if attr is _ABSENT or isinstance(attr, (property, types.FunctionType)):
            continue
        inner = (
            getattr(attr, "__func__", attr)
            if isinstance(attr, (staticmethod, classmethod))
            else attr
        )
        if pyinspect.isfunction(inner):
            continue  # a static/class method: traced_functions follows it
        out[f"self.{name}"] = ClassValue(inner)
    return out


_ABSENT = object()


def model_classes(spec: ProgramSpec) -> dict[str, type]:
    """``model:Qualname`` -> every user class of the model (its modules), whose code the
    programs run: the model's key is its structure, which names the classes but not what
    their methods (and the helpers and module values those read) do."""
    return {
        f"model:{cls.__qualname__}": cls
        for cls in models.model_classes(spec.model)
        if not is_library_class(cls)
    }


def model_functions(spec: ProgramSpec) -> dict[str, Any]:
    """``model-fn:Owner.attr`` -> every user function the model holds as a value (an NNX
    module's `self.act = act`, a Linen module given `act=...`, an Equinox static field): the
    model's structure keys them by identity, so their code, globals and closures go here."""
    return {f"model-fn:{name}": fn for name, fn in models.held_functions(spec.model).items()}


def traced_code(
    spec: ProgramSpec, hooks: tuple[str, ...] = _TRACED_HOOKS, gaps: list[str] | None = None
) -> dict[str, Any]:
    """Everything whose content a program built from `hooks` depends on beyond its key's
    other parts: the hooks and the methods they reach (`traced_functions`), the class-level
    values they read through `self` (`class_values`), the model's classes (`model_classes`)
    and the functions the model holds (`model_functions`)."""
    functions = traced_functions(spec, hooks, gaps)
    return {
        **functions,
        **class_values(spec, functions),
        **model_classes(spec),
        **model_functions(spec),
    }


def code_print(obj: Any, gaps: list[str] | None = None) -> str:
    """The fingerprint of one entry of `traced_code` (what it cannot cover into `gaps`)."""
    if isinstance(obj, ClassValue):
        return fingerprint_value(obj.value, strict=False, gaps=gaps)
    return fingerprint(obj, gaps=gaps)


def hook_prints(spec: ProgramSpec, kind: str | None = None, gaps: list[str] | None = None) -> tuple:
    """(name, fingerprint) of everything a `kind` of program traces (all kinds: None); what
    the fingerprints cannot cover goes into `gaps`, each named with its entry."""
    hooks = _TRACED_HOOKS if kind is None else _kind_hooks(spec, kind)
    out = []
    for name, obj in traced_code(spec, hooks, gaps).items():
        found: list[str] = []
        out.append((name, code_print(obj, found)))
        if gaps is not None:
            gaps += [f"{why} (in {_shown(name)})" for why in found]
    return tuple(sorted(out))


def _traced_parts(spec: ProgramSpec, kind: str, gaps: list[str]) -> tuple[tuple, tuple, tuple]:
    """(`hook_prints`, then `explain.hook_parts`' hooks and helpers) of a kind of program, from
    one traversal of each traced entry (a program request pays it once)."""
    prints, own, reached = [], [], []
    for name, obj in traced_code(spec, _kind_hooks(spec, kind), gaps).items():
        found: list[str] = []
        if isinstance(obj, ClassValue):
            digest = fingerprint_value(obj.value, strict=False, gaps=found)
            own.append((name, digest))
        else:
            digest, reach = fingerprint_reach(obj, gaps=found)
            mine, theirs = explain.entry_parts(name, obj, reach, digest)
            own.append(mine)
            reached += theirs
        prints.append((name, digest))
        gaps += [f"{why} (in {_shown(name)})" for why in found]
    return tuple(sorted(prints)), tuple(own), tuple(reached)


def _shown(name: str) -> str:
    """A `traced_code` name as the user wrote it."""
    if name.startswith("model:"):
        return f"the model class `{name.removeprefix('model:')}`"
    if name.startswith("model-fn:"):
        return f"the function `{name.removeprefix('model-fn:')}` the model holds"
    return f"`{name}`"
