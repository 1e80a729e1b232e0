"""What a code object reads: its digest, the globals it loads, its attribute paths.

A code object is immutable, so what is read from it is computed once per object for the whole
process (the cache entry dies with the code object).
"""

from __future__ import annotations

import collections
import dis
import functools
import sys
import types
import weakref

from jaxnitro._src.compile.digests import _h
from jaxnitro._src.compile.fingerprint_values import _Values

# Opcodes that read a module-level name (LOAD_NAME: class bodies and module code), read a
# closure cell, and read an attribute of what is on top of the stack.
_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME", "LOAD_FROM_DICT_OR_GLOBALS"})
_DEREF_LOADS = frozenset({"LOAD_DEREF", "LOAD_CLASSDEREF", "LOAD_FROM_DICT_OR_DEREF"})
_ATTR_LOADS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_MAX_CHAIN = 4  # `a.b.c.d.e`: attributes followed after the global

_codes: dict[int, tuple[weakref.ref, str, frozenset[str], frozenset[tuple], frozenset[tuple]]] = {}


def _code_info(
    code: types.CodeType,
) -> tuple[str, frozenset[str], frozenset[tuple], frozenset[tuple]]:
    """(digest, global names, bare loads, attribute paths) of a code object and the code
    nested in it.

    A code object is immutable, so this is computed once per object for the whole process.
    Global names are those the bytecode loads as globals; attribute names (`self.tol`) are
    not among them, though the digest covers them. A bare load, ``("global", name)`` or
    ``("deref", name)``, is a load not followed by an attribute read (a call, an argument, a
    store). A path is ``(kind, root, attrs)``: a global (``"global"``) or closure cell
    (``"deref"``) `root` followed right away by attribute reads `attrs` (``losses.penalty``,
    ``pkg.sub.fn``), or ``("super", "__class__", (name,))`` for ``super().name``.
    """
    entry = _codes.get(id(code))
    if entry is not None and entry[0]() is code:
        return entry[1:]
    names, bare, paths = _scan_loads(code)
    consts = []
    doc = _docstring_slot(code)
    for i, const in enumerate(code.co_consts):  # lambdas, comprehensions and inner defs here
        if i == 0 and doc:
            digest = "docstring"  # never loaded by the code: editing it changes nothing
        elif isinstance(const, types.CodeType):
            digest, inner_names, inner_bare, inner_paths = _code_info(const)
            names |= inner_names
            bare |= inner_bare
            paths |= inner_paths
        else:  # code constants are immutable, so this digest holds as long as the code
            digest = _Values().value(const, -1, strict=False)
        consts.append(digest)
    # No co_filename, co_firstlineno or line table: moving code must not change it.
    digest = _h(
        "code",
        code.co_qualname,
        code.co_code,
        code.co_exceptiontable,
        repr((code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)),
        "\0".join(code.co_names),
        "\0".join(code.co_varnames),
        "\0".join(code.co_freevars),
        "\0".join(code.co_cellvars),
        *consts,
    )
    result = (digest, frozenset(names), frozenset(bare), frozenset(paths))
    try:
        ref = weakref.ref(code, functools.partial(_forget_code, id(code)))
    except TypeError:
        return result
    _codes[id(code)] = (ref, *result)
    return result


_COMPREHENSIONS = frozenset({"<listcomp>", "<dictcomp>", "<setcomp>", "<genexpr>"})


def _docstring_slot(code: types.CodeType) -> bool:
    """Whether `co_consts[0]` is the function's docstring slot. A function's first constant
    is its docstring, or None without one (before Python 3.14, which keeps it out of
    `co_consts` unless used); comprehensions and class bodies have no such slot. (A None there
    that the code also loads is seen in the bytecode, which then differs.)"""
    return (
        bool(code.co_consts)
        and (code.co_consts[0] is None or isinstance(code.co_consts[0], str))
        and bool(code.co_flags & 0x1)  # CO_OPTIMIZED: a function, not module or class code
        and code.co_name not in _COMPREHENSIONS
        and sys.version_info < (3, 14)
    )


def _scan_loads(code: types.CodeType) -> tuple[set[str], set[tuple], set[tuple]]:
    """(global names, bare loads, attribute paths) of one code object's own bytecode (see
    `_code_info`; nested code objects are scanned by their own call)."""
    names: set[str] = set()
    bare: collections.Counter = collections.Counter()
    paths: set[tuple] = set()
    root: tuple[str, str] | None = None
    attrs: list[str] = []
    zero_arg_super = False

    def close() -> None:
        if attrs and root is not None:  # (attrs only ever follow a root)
            paths.add((*root, tuple(attrs)))
        elif root is not None:
            bare[root] += 1

    for ins in dis.get_instructions(code):
        op = ins.opname
        if op == "EXTENDED_ARG":
            continue
        if root is not None and op in _ATTR_LOADS and len(attrs) < _MAX_CHAIN:
            attrs.append(ins.argval)
            continue
        if zero_arg_super:  # `super()` (3.11: PRECALL 0, CALL 0), then `.name` or not
            if op in ("PRECALL", "CALL") and ins.arg == 0:
                continue
            zero_arg_super = False
            if op in _ATTR_LOADS:
                paths.add(("super", "__class__", (ins.argval,)))
                continue
            bare["deref", "__class__"] += 1  # `s = super()`: any attribute of the class
        close()
        root, attrs = None, []
        if op in _GLOBAL_LOADS:
            names.add(ins.argval)
            if ins.argval == "super" and "__class__" in code.co_freevars:
                zero_arg_super = True  # two-argument super() loads its class explicitly
            else:
                root = ("global", ins.argval)
        elif op in _DEREF_LOADS:
            root = ("deref", ins.argval)
        elif op == "LOAD_SUPER_ATTR":  # 3.12: super, __class__ and self loaded, then this
            paths.add(("super", "__class__", (ins.argval,)))
            bare["deref", "__class__"] -= 1
    if zero_arg_super:
        bare["deref", "__class__"] += 1
    close()
    return names, {load for load, n in bare.items() if n > 0}, paths


def _forget_code(key: int, ref: weakref.ref) -> None:
    entry = _codes.get(key)
    if entry is not None and entry[0] is ref:
        del _codes[key]


# Builtins and modules through which code reads what no name in it says: an attribute named
# by a string, a namespace as a dict, a module imported while it runs, a file.
_DYNAMIC_NAMES = frozenset(
    {
        "getattr",
        "hasattr",
        "setattr",
        "delattr",
        "globals",
        "locals",
        "vars",
        "eval",
        "exec",
        "compile",
        "open",
        "__import__",
        "importlib",
        "sys",
    }
)
_dynamic: dict[int, tuple[weakref.ref, str | None]] = {}


def dynamic_reads(code: types.CodeType) -> str | None:
    """What in `code` (or the code nested in it) reads values no fingerprint can follow:
    ``"getattr"``, ``"import"`` (a module imported inside a function), ...; None if nothing.

    A fingerprint proves "unchanged" only for code without such reads (computed once per
    code object).
    """
    entry = _dynamic.get(id(code))
    if entry is not None and entry[0]() is code:
        return entry[1]
    found = sorted(_DYNAMIC_NAMES.intersection(code.co_names))
    if not found and any(ins.opname == "IMPORT_NAME" for ins in dis.get_instructions(code)):
        found = ["import"]
    for const in code.co_consts:
        if not found and isinstance(const, types.CodeType):
            inner = dynamic_reads(const)
            found = [inner] if inner else []
    result = found[0] if found else None
    try:
        ref = weakref.ref(code, functools.partial(_forget_dynamic, id(code)))
    except TypeError:
        return result
    _dynamic[id(code)] = (ref, result)
    return result


def _forget_dynamic(key: int, ref: weakref.ref) -> None:
    entry = _dynamic.get(key)
    if entry is not None and entry[0] is ref:
        del _dynamic[key]
