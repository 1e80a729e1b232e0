"""Command-line text → a field's declared type (`--width 256`, `--sizes 64,64`, `--mode fast`).

Scalars (bool, int, float, str, Path), enums (by member name or value), `Literal[...]`, `X | None`
("none"), and containers (tuple, list, set, dict, as a Python literal or a comma-separated list).
A field of any other type cannot be set from the shell and gets no option.
"""

from __future__ import annotations

import ast
import enum
import types
import typing
from pathlib import Path
from typing import Any

import click

from jaxnitro._src.core.words import bool_word, vocabulary
from jaxnitro._src.experiment.markers import FieldInfo

_CONTAINERS = (tuple, list, set, frozenset, dict)


def supported(typ) -> bool:
    """Whether a value of `typ` can be written on a command line."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if typ is Any or typ in (bool, int, float, str, Path) or typ in _CONTAINERS:
        return True
    if origin is typing.Literal:
        return True
    if origin in (typing.Union, types.UnionType):
        return all(a is type(None) or supported(a) for a in args)
    if origin in _CONTAINERS:
        return True
    return isinstance(typ, type) and issubclass(typ, enum.Enum)


def type_name(typ) -> str:
    """`int`, `float | None`, `tuple[int, ...]`, `Literal['a', 'b']`: the annotation as written."""
    if isinstance(typ, type) and not typing.get_args(typ):
        return typ.__name__
    return str(typ).replace("typing.", "")


def parse(typ, text: str) -> Any:
    """`text` as a value of `typ`; ValueError (saying what was expected) if it is not one.

    Example:
        >>> parse(int, "256"), parse(tuple[int, ...], "64,64"), parse(float | None, "none")
        (256, (64, 64), None)
    """
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and text.strip().lower() in ("none", "null"):
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return parse(option, text)
            except ValueError:
                continue
        raise ValueError(f"expected {type_name(typ)}")
    if origin is typing.Literal:
        for choice in args:
            if str(choice) == text or (isinstance(choice, str) and choice.lower() == text.lower()):
                return choice
        raise ValueError(f"expected one of {', '.join(map(repr, args))}")
    if typ in _CONTAINERS or origin in _CONTAINERS:
        return _container(origin or typ, args, text)
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        return _enum(typ, text)
    return _scalar(typ, text)


def _scalar(typ, text: str) -> Any:
    if typ is bool:
        word = bool_word(text)
        if word is not None:
            return word
        raise ValueError(f"expected {vocabulary()}")
    if typ is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            number = _float_or_none(text)
            if number is not None and number.is_integer():  # 1e3 is a count too
                return int(number)
            raise ValueError("expected an integer") from None
    if typ is float:
        number = _float_or_none(text)
        if number is None:
            raise ValueError("expected a number")
        return number
    if typ is Path:
        return Path(text)
    if typ is str:
        return text
    return _literal(text)  # Any: a Python literal, else the text itself


def _float_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def _enum(typ: type[enum.Enum], text: str) -> enum.Enum:
    for member in typ:
        if member.name.lower() == text.lower() or str(member.value) == text:
            return member
    raise ValueError(f"expected one of {', '.join(m.name for m in typ)}")


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text


def _container(kind: type, args: tuple, text: str) -> Any:
    value = _literal(text)
    if kind is dict:
        if not isinstance(value, dict):
            raise ValueError("expected a dict literal, e.g. \"{'a': 1}\"")
        return value
    if not isinstance(value, (tuple, list, set, frozenset)):
        value = [_literal(part.strip()) for part in split_list(text)] if text.strip() else []
    item = args[0] if args and (len(args) == 1 or args[-1] is Ellipsis) else None
    if item is not None and item is not Any:
        value = [parse(item, str(v)) if not isinstance(v, item) else v for v in value]
    return kind(value)


def from_json(typ, value: Any) -> Any:
    """A value read back from JSON (a checkpoint's config) as `typ`: lists become tuples
    where the field is a tuple (JSON has no tuples)."""
    kind = typing.get_origin(typ) or typ
    if isinstance(value, list) and kind in (tuple, frozenset, set):
        return kind(value)
    return value


def split_list(text: str) -> list[str]:
    """Split on top-level commas: `"(64,64),(128,128)"` → `["(64,64)", "(128,128)"]`."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


class FieldType(click.ParamType):
    """A field's declared type as a click parameter type: a bad value names the field, its
    marker and type, and the value (exit status 2)."""

    def __init__(self, info: FieldInfo, owner: str):
        self.info, self.owner = info, owner
        self.name = type_name(info.type)

    def describe(self) -> str:
        return f"field {self.info.name!r} of {self.owner} ({self.info.marker}[{self.name}])"

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        try:
            return parse(self.info.type, value)
        except ValueError as e:
            self.fail(f"{value!r} is not a valid {self.name} for {self.describe()}: {e}.")


class ListOf(click.ParamType):
    """Comma-separated values of one type (a sweep's grid axis): `0.0,0.05,0.1`."""

    def __init__(self, item: click.ParamType):
        self.item = item
        self.name = f"{getattr(item, 'name', 'value')},..."

    def convert(self, value, param, ctx):
        if not isinstance(value, str):
            return value
        parts = split_list(value)
        if not parts:
            self.fail(f"{value!r} holds no value; give one or more, comma-separated.")
        return [self.item.convert(p, param, ctx) for p in parts]
