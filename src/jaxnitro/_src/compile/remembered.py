"""Remembered fingerprints: a fingerprint traversed once, then re-checked by what it read.

`remembered(obj)` is `fingerprint(obj)`; the traversal behind it logs every lookup it made
(each global, module attribute, class namespace entry, closure cell and function attribute,
with the object it found) and the values it hashed by content that can change in place. A
later call re-checks that log instead of traversing again: where every lookup finds the same
object and every such value hashes the same, a new traversal would give the same digest.

`jn.train_step` keys each call by the fingerprints of its loss function and the model's
code, so it checks them on every step: `check_of` turns the logs behind those digests into
one generated function of plain lookups (`mapping["name"] is found`, `fn.__code__ is
found`), a few times cheaper than walking the logs.
"""

from __future__ import annotations

import keyword
from typing import TYPE_CHECKING, Any

from jaxnitro._src.compile import dict_version
from jaxnitro._src.compile.fingerprint import _Hasher
from jaxnitro._src.compile.fingerprint_values import _MISSING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from jaxnitro._src.compile.fingerprint_values import _Values

__all__ = ["check_of", "forget", "remembered"]


def remembered(obj: Any, *, gaps: list[str] | None = None) -> str:
    """`fingerprint(obj)`, from the last traversal of `obj` when nothing it read changed.

    A traversal through anything it does not log (a partial, a bound method, a wrapper
    object) is not remembered: the next call traverses again.

    Example:
        >>> def loss(x):
        ...     return (x**2).sum()
        >>> from jaxnitro._src.compile.fingerprint import fingerprint
        >>> remembered(loss) == fingerprint(loss) == remembered(loss)
        True
    """
    hit = _remembered.get(id(obj))
    if hit is not None and hit.obj is obj and hit.holds():
        if gaps is not None:
            gaps.extend(hit.gaps)
        return hit.digest
    _remembered.pop(id(obj), None)  # (a log that no longer holds is never `check_of`'s)
    hasher = _Hasher()
    digest = hasher.callable_(obj, 2)
    if gaps is not None:
        gaps.extend(hasher.gaps)
    if not hasher.unsure:
        _remembered[id(obj)] = _Reads(obj, hasher, digest)  # holding obj keeps its id
        while len(_remembered) > _REMEMBERED:
            _remembered.pop(next(iter(_remembered)))
    return digest


def check_of(objs: Iterable[Any]) -> Callable[[], bool] | None:
    """A function telling whether the code `remembered` just read for `objs` (call it on
    each first) is unchanged: while it returns True, a trace of them runs what it ran then,
    and `remembered` gives the same digests unless a name alone changed (`_NAMES_ONLY`).
    None where one of them is not remembered (a traversal it could not log)."""
    reads = []
    for obj in objs:
        hit = _remembered.get(id(obj))
        if hit is None or hit.obj is not obj:
            return None
        reads.append(hit)
    return _generated(reads)


def forget() -> None:
    """Drop every remembered traversal (and the objects it holds), as `jn.cache_reset()` does."""
    _remembered.clear()


class _Reads:
    """What one traversal of `obj` read: its lookups, each once, as (where, key, the object
    found), the sizes of the class namespaces it read whole, and the values to re-hash."""

    __slots__ = ("attrs", "digest", "gaps", "items", "obj", "rehash", "sizes")

    def __init__(self, obj: Any, log: _Values, digest: str) -> None:
        self.obj, self.digest, self.gaps = obj, digest, tuple(log.gaps)
        # (keyed by the ids of where and what was looked up: the log holds both alive)
        self.items = list({(id(m), k): (m, k, v) for m, k, v in log.seen_items}.values())
        self.attrs = list({(id(o), n): (o, n, v) for o, n, v in log.seen_attrs}.values())
        self.sizes = list({id(m): (m, n) for m, n in log.seen_sizes}.values())
        self.rehash = list(log.rehash)

    def holds(self) -> bool:
        return _holds(self.items, self.attrs, self.sizes, self.rehash)


_remembered: dict[int, _Reads] = {}
_REMEMBERED = 64


def _holds(items: Sequence, attrs: Sequence, sizes: Sequence, rehash: Sequence) -> bool:
    """Whether every lookup finds the same object, and every value hashes the same."""
    missing = _MISSING
    for mapping, key, found in items:
        if mapping.get(key, missing) is not found:
            return False
    for obj, name, found in attrs:
        try:
            if getattr(obj, name, missing) is not found:
                return False
        except ValueError:  # an empty closure cell
            if found is not missing:
                return False
    for mapping, size in sizes:
        if len(mapping) != size:
            return False
    for value, depth, strict, digest in rehash:
        if _Hasher().value(value, depth, strict=strict) != digest:
            return False
    return True


# What a traversal reads that changes a digest but not what a trace of the code runs: the
# names a function or class goes by, and a function's `__wrapped__` (calling it runs its own
# code). The check a hot path runs leaves them out; the keyed path's `remembered` sees them.
_NAMES_ONLY = frozenset({"__module__", "__qualname__", "__wrapped__"})


def _generated(reads: Sequence[_Reads]) -> Callable[[], bool]:
    """The checks of `reads` as the source of one function, each lookup once.

    Lookups that found something become `if where["key"] is not found: return False`
    (an attribute: `where.name`); a name found missing, `if "key" in where`. A mapping
    looked up more than once (a module's globals, a class namespace) is looked up only when
    its version moved (`dict_version`): one read while nothing in it changed, its lookups and
    size checks after a change, whose version is then remembered where they hold. What raises
    (a key or attribute gone, a closure cell emptied) is decided by the plain checks
    (`_holds`), as are the attributes found missing and the values to re-hash.
    """
    names: dict[int, str] = {}
    space: dict[str, Any] = {}

    def name(value: Any) -> str:
        if id(value) not in names:
            names[id(value)] = f"v{len(names)}"
            space[names[id(value)]] = value
        return names[id(value)]

    items: dict = {}
    attrs: dict = {}
    sizes: dict = {}
    rest_attrs: list = []
    for r in reads:
        items.update({(id(m), k): (m, k, v) for m, k, v in r.items})
        attrs.update({(id(o), n): (o, n, v) for o, n, v in r.attrs})
        sizes.update({id(m): (m, n) for m, n in r.sizes})
    lines = _lookups(items.values(), sizes.values(), name, space)
    for obj, attr, found in attrs.values():
        if attr in _NAMES_ONLY:
            continue
        if found is _MISSING or not attr.isidentifier() or keyword.iskeyword(attr):
            rest_attrs.append((obj, attr, found))
        else:
            lines.append(f"if {name(obj)}.{attr} is not {name(found)}: return False")
    rehash = [v for r in reads for v in r.rehash]
    everything = [(r.items, r.attrs, r.sizes, r.rehash) for r in reads]
    space["slow"] = lambda: all(_holds(*parts) for parts in everything)
    space["rest"] = lambda: _holds((), rest_attrs, (), rehash)
    body = "\n".join(f"        {line}" for line in lines) or "        pass"
    # every object a local (a default): a check is read from the frame, not a dict
    params = ", ".join(f"{k}={k}" for k in space)
    source = (
        f"def check({params}):\n    try:\n{body}\n"
        "    except (KeyError, AttributeError, ValueError):\n        return slow()\n"
        f"    return {'rest()' if rest_attrs or rehash else 'True'}\n"
    )
    exec(compile(source, "<jaxnitro remembered check>", "exec"), space)  # noqa: S102
    return space["check"]


def _lookups(
    items: Iterable[tuple], sizes: Iterable[tuple], name: Callable[[Any], str], space: dict
) -> list[str]:
    """`_generated`'s lines for the lookups and size checks, per mapping: behind a check of
    its version where it has one and more than one line (`dict_version`)."""
    per_mapping: dict[int, tuple[Any, list[str]]] = {}
    for mapping, key, found in items:
        if key in _NAMES_ONLY:
            continue
        key_ = repr(key) if type(key) is str else name(key)
        if found is _MISSING:
            line = f"if {key_} in {name(mapping)}: return False"
        else:
            line = f"if {name(mapping)}[{key_}] is not {name(found)}: return False"
        per_mapping.setdefault(id(mapping), (mapping, []))[1].append(line)
    for mapping, n in sizes:
        line = f"if len({name(mapping)}) != {n}: return False"
        per_mapping.setdefault(id(mapping), (mapping, []))[1].append(line)
    lines = []
    for mapping, checks in per_mapping.values():
        version = dict_version.tag(mapping) if len(checks) > 1 else None
        if version is None:
            lines += checks
            continue
        # `tN`: the version's reader; `sN`: a version at which the checks held (read before
        # them: a change made while they run moves it again)
        t, seen = name(version), name([version.value])
        lines.append(f"now = {t}.value")
        lines.append(f"if now != {seen}[0]:")
        lines += [f"    {line}" for line in checks]
        lines.append(f"    {seen}[0] = now")
        space[f"_{t}_of"] = mapping  # (the reader's dict lives as long as the check)
    return lines
