"""Every public function documents its interface the Google way (optax's standard, which the
API reference renders): an `Args:` entry per parameter, and `Returns:` when it returns
something."""

from __future__ import annotations

import builtins
import inspect
import re

import pytest

import jaxnitro as jn

# A section header at the docstring's left margin: "Args:", "Returns:", "Raises:", ...
HEADER = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")
# An entry of a section: four spaces, the name (stars allowed: `*inputs`, `**kwargs`), a colon.
ENTRY = re.compile(r"^    (\*{0,2}\w+)(?: \([^)]*\))?:")


def public_functions() -> list[tuple[str, object]]:
    """The functions of `jn.__all__` (classes and modules left out)."""
    out = []
    for name in jn.__all__:
        obj = getattr(jn, name)
        if inspect.isfunction(inspect.unwrap(obj)):
            out.append((name, obj))
    return out


def sections(doc: str) -> dict[str, list[str]]:
    """The docstring's sections by header, each the (dedented) lines under it."""
    out: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in doc.splitlines():
        m = HEADER.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
        elif current is not None:
            if line and not line.startswith(" "):
                current = None  # prose after a section ends it
            else:
                current.append(line)
    return out


def documented(lines: list[str]) -> list[str]:
    return [m.group(1).lstrip("*") for line in lines if (m := ENTRY.match(line))]


def returns_something(fn: object) -> bool:
    annotation = inspect.signature(fn).return_annotation
    return annotation not in (None, "None")


def test_the_section_parser_reads_google_style():
    doc = (
        "Summary.\n\nArgs:\n    n: the run.\n    *inputs: more.\n        wrapped.\n"
        "    **kwargs: keywords.\n\nReturns:\n    A thing.\n\nExample:\n    >>> f(1)\n"
    )
    got = sections(doc)
    assert documented(got["Args"]) == ["n", "inputs", "kwargs"]
    assert got["Returns"] == ["    A thing.", ""]
    assert "Raises" not in got


def test_there_are_public_functions_to_check():
    names = {name for name, _ in public_functions()}
    assert {"train", "predict", "export_model", "lr_find", "apply"} <= names


@pytest.mark.parametrize(("name", "fn"), public_functions(), ids=[n for n, _ in public_functions()])
def test_a_public_function_documents_its_parameters_and_result(name, fn):
    doc = inspect.getdoc(fn) or ""
    found = sections(doc)
    params = list(inspect.signature(fn).parameters)
    if params:
        assert "Args" in found, f"jn.{name}: its docstring has no Args: section ({params})"
        listed = documented(found["Args"])
        missing = [p for p in params if p not in listed]
        assert not missing, f"jn.{name}: Args: does not name {missing}"
        unknown = [p for p in listed if p not in params]
        assert not unknown, f"jn.{name}: Args: names {unknown}, not parameters of it"
    if returns_something(fn):
        assert found.get("Returns"), f"jn.{name}: returns a value but has no Returns: section"
    for line in found.get("Raises", []):
        if m := ENTRY.match(line):
            raised = getattr(jn, m.group(1), None) or getattr(builtins, m.group(1), None)
            assert isinstance(raised, type) and issubclass(raised, BaseException), (
                f"jn.{name}: Raises: names {m.group(1)!r}, not an exception of jn. or builtins"
            )
