"""`@experiment`, the three field markers, and the compile view traced hooks run against.

A field is `GraphConst[T]` (a Python constant baked into the compiled program and part of its
key), `Device[T]` (a strongly typed traced input: change it without recompiling) or unmarked /
`Host[T]` (driver-only: invisible to the compiled program).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import enum
import functools
import inspect
import io
import textwrap
import tokenize
import typing
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Annotated, Any, TypeAlias, TypeVar, overload

from jaxnitro._src.core.errors import (
    ConfigArgumentError,
    ConfigError,
    HostFieldError,
    ReadOnlyError,
    did_you_mean,
)

GRAPH = "GraphConst"
DEVICE = "Device"
HOST = "Host"

#: Fields that set a `jn.Nitro` option (the driver reads them; baking one into a program
#: would be meaningless). The options are declared a layer up (`run.options`), which names
#: them here through `declare_driver_fields` as it is imported: `import jaxnitro` imports it
#: before any experiment class can be declared.
DRIVER_FIELDS: set[str] = set()


def declare_driver_fields(names: Iterable[str]) -> None:
    """Add the `jn.Nitro` options an experiment field may set (none of them can be GraphConst)."""
    DRIVER_FIELDS.update(names)


class _Marker:
    __slots__ = ("kind",)

    def __init__(self, kind: str):
        self.kind = kind

    def __repr__(self) -> str:
        return f"jn.{self.kind}"


def _marker_type(kind: str) -> type:
    marker = _Marker(kind)

    class _M:
        def __class_getitem__(cls, item):
            return typing.Annotated[item, marker]

        def __init_subclass__(cls, **kw):
            raise ConfigArgumentError(
                f"jn.{kind} is a field marker, not a base class; annotate a field with it: "
                f"name: jn.{kind}[T] = default."
            )

    _M.__name__ = _M.__qualname__ = kind
    _M.__doc__ = (
        f"Field marker: annotate a field as `jn.{kind}[T]` (see the module docstring).\n\n"
        f"Example:\n    >>> @jn.experiment\n    ... class Exp:\n"
        f"    ...     value: jn.{kind}[float] = 0.5\n"
    )
    return _M


_T = TypeVar("_T")

if TYPE_CHECKING:
    # What a type checker sees: `jn.GraphConst[int]` is `int` (PEP 593's `Annotated`, the way
    # checkers take metadata they do not understand). At run time the subscript builds the same
    # `Annotated[int, marker]` from the classes below, which also refuse a bare or a base use.
    GraphConst: TypeAlias = Annotated[_T, GRAPH]
    Device: TypeAlias = Annotated[_T, DEVICE]
    Host: TypeAlias = Annotated[_T, HOST]
else:
    GraphConst = _marker_type(GRAPH)
    Device = _marker_type(DEVICE)
    Host = _marker_type(HOST)


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """What `jn.fields(cls)` reports for one experiment field."""

    name: str
    type: Any
    marker: str  # "GraphConst" | "Device" | "Host"
    default: Any  # dataclasses.MISSING when the field is a required keyword
    doc: str | None


def fields(cls_or_instance) -> tuple[FieldInfo, ...]:
    """Describe an experiment's fields: name, type, marker, default, doc.

    Args:
        cls_or_instance: an experiment class or an instance of one.

    Returns:
        One `FieldInfo` per field, in declaration order.

    Raises:
        ConfigError: the class is not decorated with `@jn.experiment`.

    Example:
        >>> [f.marker for f in jn.fields(MnistMLP)]
        ['GraphConst', 'Device', 'Host']
    """
    cls = cls_or_instance if isinstance(cls_or_instance, type) else type(cls_or_instance)
    info = getattr(cls, "__jn_fields__", None)
    if info is None:
        raise ConfigError(
            f"{cls.__name__} is not an experiment. Decorate the class with @jn.experiment."
        )
    return tuple(info.values())


def is_experiment(obj) -> bool:
    """Whether `obj` is an experiment class (made by `@jn.experiment`) or an instance of one.

    Example:
        >>> is_experiment(MnistMLP), is_experiment(MnistMLP()), is_experiment(object)
        (True, True, False)
    """
    cls = obj if isinstance(obj, type) else type(obj)
    return hasattr(cls, "__jn_fields__")


def _split_annotation(ann) -> tuple[Any, str]:
    if typing.get_origin(ann) is typing.Annotated:
        base, *extras = typing.get_args(ann)
        kinds = [e.kind for e in extras if isinstance(e, _Marker)]
        if len(kinds) > 1 or (kinds and typing.get_origin(base) is typing.Annotated):
            raise ConfigError(
                f"a field carries more than one marker ({kinds}); use exactly one, e.g. "
                f"jn.GraphConst[int] or jn.Device[float]."
            )
        if kinds:
            inner_base, inner_kind = _split_annotation(base)
            if inner_kind != HOST or base is not inner_base:
                raise ConfigError(
                    "markers cannot be nested (e.g. GraphConst[Device[int]]); use one marker "
                    "per field, e.g. jn.GraphConst[int] or jn.Device[int]."
                )
            return base, kinds[0]
        return _split_annotation(base)
    if any(ann is marker for marker in (GraphConst, Device, Host)):
        name = ann.__name__
        raise ConfigError(f"bare jn.{name} needs a type: write jn.{name}[float].")
    return ann, HOST


def _field_docs(cls) -> dict[str, str]:
    """Docs from an attribute docstring (a string right after the field) or a trailing comment."""
    # Docs are best effort. SystemError: CPython 3.11's ast.parse can report "AST constructor
    # recursion depth mismatch" when threads parse at once (python/cpython#106905).
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError, SystemError):
        return {}
    docs: dict[str, str] = {}
    try:
        node = ast.parse(source).body[0]
        if not isinstance(node, ast.ClassDef):
            return {}
        body = node.body
        # Real comments only: a '#' inside a string default (`tag: str = "a#b"`) is not one.
        comments = {
            tok.start[0]: tok.string[1:].strip()
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        }
    except (SyntaxError, IndexError, AttributeError, tokenize.TokenError, SystemError):
        return {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        name = node.target.id
        nxt = body[i + 1] if i + 1 < len(body) else None
        if (
            isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[name] = inspect.cleandoc(nxt.value.value)
            continue
        if node.end_lineno in comments:
            docs[name] = comments[node.end_lineno]
    return docs


def _convert(name: str, kind: str, typ, value):
    """Typed conversion and validation of one field value; returns the converted value."""
    if value is None or typ is Any or not isinstance(typ, type):
        return value
    scalar = _SCALAR_CONVERTERS.get(typ)
    if scalar is not None:
        return scalar(name, kind, value)
    if typ is str and not isinstance(value, str):
        raise _declared(name, "str", value, "pass a string")
    if typ is tuple and isinstance(value, list):
        return tuple(value)
    if typ in (str, tuple) or kind != HOST:
        if not isinstance(value, typ) and not (kind == DEVICE and hasattr(value, "dtype")):
            raise _declared(name, typ.__name__, value, f"pass a {typ.__name__}")
    return value


def _declared(name: str, declared: str, value, fix: str) -> ConfigError:
    return ConfigError(
        f"field {name!r} is declared {declared} but got {value!r} ({type(value).__name__}); "
        f"{fix}, or change the field's annotation."
    )


def _to_bool(name: str, kind: str, value):
    if isinstance(value, bool) or (hasattr(value, "dtype") and str(value.dtype) == "bool"):
        return bool(value) if kind == GRAPH else value
    raise _declared(name, "bool", value, "pass True or False")


def _to_int(name: str, kind: str, value):
    if isinstance(value, bool):
        raise _declared(name, "int", value, "pass an integer (True/False are not counts)")
    if isinstance(value, int):
        return value
    if (isinstance(value, float) and value.is_integer()) or _is_int_scalar(value):
        return int(value)
    raise _declared(name, "int", value, "pass an integer, or declare the field float")


def _to_float(name: str, kind: str, value):
    if isinstance(value, bool):
        raise _declared(name, "float", value, "pass a number")
    if isinstance(value, (int, float)) or _is_real_scalar(value):
        return float(value)
    if kind == DEVICE and hasattr(value, "dtype"):  # a Device array of floats is fine
        return value
    raise _declared(name, "float", value, "pass a number")


_SCALAR_CONVERTERS = {bool: _to_bool, int: _to_int, float: _to_float}


def _is_int_scalar(v) -> bool:
    return (
        getattr(v, "shape", None) == () and getattr(getattr(v, "dtype", None), "kind", "") in "iu"
    )


def _is_real_scalar(v) -> bool:
    return (
        getattr(v, "shape", None) == () and getattr(getattr(v, "dtype", None), "kind", "") in "iuf"
    )


def check_hashable(name: str, value) -> None:
    """A GraphConst value must hash and compare by content, or cache keys would be unsound."""
    try:
        h = hash(value)
    except TypeError:
        raise ConfigError(
            f"GraphConst field {name!r} holds an unhashable {type(value).__name__} "
            f"({value!r:.80}). GraphConst values are part of the compile key and must hash by "
            f"content: use a tuple instead of a list, a frozen dataclass instead of a dict, or "
            f"mark the field jn.Device[...] if it is an array."
        ) from None
    try:
        twin = copy.deepcopy(value)
    except Exception:  # noqa: BLE001 - an uncopyable value cannot be checked; trust its hash
        return
    if hash(twin) != h or not (twin == value):
        raise ConfigError(
            f"GraphConst field {name!r} holds a {type(value).__name__} that hashes by identity, "
            f"not by content: two equal configs would compile twice and an edited one could reuse "
            f"a stale program. Give the type content-based __hash__/__eq__ (e.g. "
            f"@dataclass(frozen=True)) or use a tuple/str/int."
        )


def _type_hints(cls) -> dict[str, Any]:
    """Resolved annotations. A class defined in a script run by another module (`python -m
    cProfile script.py`, with `from __future__ import annotations`) has a `__module__` that
    is not its namespace; its methods' globals are."""
    try:
        return typing.get_type_hints(cls, include_extras=True)
    except NameError:
        fns = [v for v in vars(cls).values() if inspect.isfunction(v)]
        if not fns:
            raise
        return typing.get_type_hints(cls, globalns=fns[0].__globals__, include_extras=True)


_Cls = TypeVar("_Cls", bound=type)


@overload
def experiment(cls: _Cls, /) -> _Cls: ...
@overload
def experiment(cls: None = None, /) -> Callable[[_Cls], _Cls]: ...


# Checkers see the class as the frozen keyword-only dataclass it becomes (equinox's way):
# `Exp(width=256)` checks against the fields, `Exp(widht=256)` and `exp.width = 1` do not.
@typing.dataclass_transform(
    kw_only_default=True,
    frozen_default=True,  # (3.12's keyword; 3.11's dataclass_transform passes it on)
    field_specifiers=(dataclasses.field, dataclasses.Field),
)
def experiment(cls: Any = None, /) -> Any:
    """Make a class an experiment: a frozen keyword-only dataclass with marked fields.

    Args:
        cls: the class (`@jn.experiment` and `@jn.experiment()` both work).

    Returns:
        The class, now a frozen keyword-only dataclass that `jn.Nitro` accepts.

    Raises:
        ConfigError: `cls` is not a class, or a field's marker or default is invalid.

    Example:
        >>> @jn.experiment
        ... class MnistMLP:
        ...     width: jn.GraphConst[int] = 128
        ...     smoothing: jn.Device[float] = 0.05
        ...     max_epochs: int = 5
        >>> MnistMLP(width=256)
        MnistMLP(width=256, smoothing=0.05, max_epochs=5)
    """
    if cls is None:
        return experiment
    if not isinstance(cls, type):
        raise ConfigError(
            f"@jn.experiment decorates a class, got {type(cls).__name__}; put it on the line "
            f"above `class MyExperiment:`."
        )
    return _make_experiment(cls, _field_infos(cls))


def _field_infos(cls: type) -> dict[str, FieldInfo]:
    """The fields of an experiment class: inherited experiment fields first, then its own."""
    hints = _type_hints(cls)
    own = vars(cls).get("__annotations__", {})  # its own namespace: no inherited fields
    docs = _field_docs(cls)
    infos: dict[str, FieldInfo] = {}
    for base in reversed(cls.__mro__[1:]):
        infos.update(getattr(base, "__jn_fields__", {}))
    for name in own:
        if typing.get_origin(hints[name]) is typing.ClassVar:
            continue
        typ, kind = _split_annotation(hints[name])
        if kind == GRAPH and name in DRIVER_FIELDS:
            raise ConfigError(
                f"{cls.__name__}.{name} is a driver setting and cannot be GraphConst: the driver "
                f"reads it, the compiled program never does. Remove the marker (leave it Host)."
            )
        default = vars(cls).get(name, dataclasses.MISSING)
        if isinstance(default, (list, dict, set, bytearray)) or type(default).__name__ == "ndarray":
            kind_name = type(default).__name__
            raise ConfigError(
                f"{cls.__name__}.{name} has a mutable default ({kind_name}), which every "
                f"instance would share. Use a tuple (or a frozen dataclass), or build it per "
                f"instance: {name}: ... = dataclasses.field(default_factory=lambda: ...)."
            )
        if isinstance(default, dataclasses.Field):
            factory = default.default_factory
            default = default.default if factory is dataclasses.MISSING else factory()
        infos[name] = FieldInfo(name, typ, kind, default, docs.get(name))
    return infos


def _make_experiment(cls: Any, infos: dict[str, FieldInfo]) -> type:
    """Turn `cls` into the frozen keyword-only dataclass, its values checked on creation."""
    user_post_init = vars(cls).get("__post_init__")

    def __post_init__(self):
        for info in infos.values():
            value = _convert(info.name, info.marker, info.type, getattr(self, info.name))
            object.__setattr__(self, info.name, value)
            if info.marker == GRAPH:
                check_hashable(info.name, value)
        if user_post_init is not None:
            user_post_init(self)

    cls.__post_init__ = __post_init__
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    cls.__jn_fields__ = infos
    cls.__init__ = _checked_init(cls, cls.__init__)
    if "presets" not in vars(cls) and not hasattr(cls, "presets"):
        cls.presets = classmethod(lambda c: {})
    cls.from_preset = classmethod(_from_preset)
    return cls


def _checked_init(cls, init):
    """Unknown or positional arguments get the field list and a did-you-mean, not a bare
    TypeError."""

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        if args:
            raise ConfigArgumentError(
                f"{cls.__name__} takes keyword arguments only, e.g. {cls.__name__}("
                f"{next(iter(cls.__jn_fields__), 'field')}=...); got {len(args)} positional."
            )
        unknown = [k for k in kwargs if k not in cls.__jn_fields__]
        if unknown:
            raise ConfigArgumentError(
                f"{cls.__name__} has no field {unknown[0]!r}; fields: {sorted(cls.__jn_fields__)}."
                + did_you_mean(unknown[0], cls.__jn_fields__)
            )
        missing = [
            f.name
            for f in cls.__jn_fields__.values()
            if f.default is dataclasses.MISSING and f.name not in kwargs
        ]
        if missing:
            raise ConfigArgumentError(
                f"{cls.__name__} needs a value for field(s) {missing} (no default); pass "
                f"them as keywords, e.g. {cls.__name__}({missing[0]}=...), or give the "
                f"field a default."
            )
        init(self, **kwargs)

    return __init__


def _from_preset(cls, name: str, **overrides):
    """Build the experiment from one of `presets()`; keyword overrides win."""
    table = cls.presets()
    if name not in table:
        raise ConfigError(
            f"{cls.__name__} has no preset {name!r}; presets: {sorted(table)}."
            + did_you_mean(name, table)
        )
    known = cls.__jn_fields__
    for key in overrides:
        if key not in known:
            raise ConfigError(
                f"{cls.__name__}.from_preset({name!r}, ...) got an override for unknown field "
                f"{key!r}; fields: {sorted(known)}." + did_you_mean(key, known)
            )
    values = {**table[name], **overrides}
    for key in values:
        if key not in known:
            raise ConfigError(
                f"preset {name!r} of {cls.__name__} sets unknown field {key!r}; fields: "
                f"{sorted(known)}." + did_you_mean(key, known)
            )
    return cls(**values)


def field_values(exp, marker: str) -> dict[str, Any]:
    """The experiment's values of every field carrying `marker`, in declaration order.

    Example:
        >>> field_values(MnistMLP(), "GraphConst")
        {'width': 128}
    """
    return {f.name: getattr(exp, f.name) for f in fields(exp) if f.marker == marker}


def graph_key(exp) -> tuple:
    """The GraphConst part of a compile key: (field name, value) pairs."""
    return tuple(
        (k, (type(v).__name__, v) if not isinstance(v, enum.Enum) else v)
        for k, v in field_values(exp, GRAPH).items()
    )


class _HostRead:
    """Raises HostFieldError on read; the message names the field, the hook, and both fixes."""

    def __init__(self, cls_name: str, name: str, typ: Any):
        self.cls_name, self.name, self.typ = cls_name, name, typ

    def error(self, hook: str | None) -> HostFieldError:
        where = f"{hook}()" if hook else "a traced hook"
        tname = getattr(self.typ, "__name__", str(self.typ))
        return HostFieldError(
            f"{where} read Host field {self.name!r} of {self.cls_name} inside traced code. Host "
            f"fields are invisible to the compiled program. Mark it jn.GraphConst[{tname}] "
            f"(baked in; recompiles per value) or jn.Device[{tname}] (a traced input; no "
            f"recompile)."
        )


_VIEW_STATE = "_jn_view"
_view_classes: dict[type, type] = {}


def _view_class(cls: Any) -> type:
    """A subclass of the experiment whose field reads follow the marker rules.

    Being a real subclass keeps `self.helper(...)`, properties, `isinstance` and zero-argument
    `super()` working inside hooks.
    """
    view_cls = _view_classes.get(cls)
    if view_cls is not None:
        return view_cls
    infos = cls.__jn_fields__

    def __getattribute__(self, name):
        info = infos.get(name)
        if info is None:
            return object.__getattribute__(self, name)
        exp, device, hook = object.__getattribute__(self, _VIEW_STATE)
        if info.marker == GRAPH:
            return getattr(exp, name)
        if info.marker == DEVICE:
            return device[name]
        raise _HostRead(cls.__name__, name, info.type).error(hook)

    def __setattr__(self, name, value):
        raise ReadOnlyError(
            f"the experiment is read-only inside traced code (setting {name!r}): a traced hook "
            f"runs once, at compile time. Return the value from the hook instead (forward's "
            f"outputs reach loss and metrics), or keep it in a local variable."
        )

    def __repr__(self):
        return f"<compile view of {cls.__name__}>"

    view_cls = type(
        f"{cls.__name__}CompileView",
        (cls,),
        {
            "__getattribute__": __getattribute__,
            "__setattr__": __setattr__,
            "__repr__": __repr__,
            "__hash__": object.__hash__,
            "__eq__": object.__eq__,
            "__module__": cls.__module__,
        },
    )
    _view_classes[cls] = view_cls
    return view_cls


def CompileView(exp, device_values: dict[str, Any], hook: str | None = None):  # noqa: N802
    """What traced hooks see as `self`: GraphConst values, Device tracers, Host fields refused.

    `device_values` maps each Device field to its traced value; `hook` names the hook for
    error messages. Methods and properties of the experiment run against the same view.
    """
    view: Any = object.__new__(_view_class(type(exp)))
    object.__setattr__(view, _VIEW_STATE, (exp, device_values, hook))
    return view


def replace(exp, **changes):
    """`dataclasses.replace` for experiments, with the same validation.

    Example:
        >>> replace(MnistMLP(), width=256).width
        256
    """
    known = [f.name for f in fields(exp)]
    for key in changes:
        if key not in known:
            raise ConfigError(
                f"{type(exp).__name__} has no field {key!r}; fields: {sorted(known)}."
                + did_you_mean(key, known)
            )
    return dataclasses.replace(exp, **changes)
