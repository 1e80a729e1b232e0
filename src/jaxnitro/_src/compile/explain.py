"""Why did that recompile? Cache misses explained in the user's terms.

A program's cache key *is* its explanation: a frozen `ProgramKey` whose parts are named the way
the user wrote them (GraphConst fields, hooks, batch fields, options). The cache is keyed on it,
so a part added to the key is explained with it. On a miss, `closest` picks the cached program
the new one most resembles and `reasons` says what changed: "GraphConst `width` changed
128 → 256", "hook `loss` was edited", "batch shape (32, 784) → (17, 784) for `img` on split
'train': a partial batch? use drop_last=True".
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import re
import reprlib
import typing
from collections.abc import Hashable, Mapping
from typing import Any

from jaxnitro._src.compile.fingerprint import describe_reach, fingerprint, fingerprint_value

__all__ = ["KeyParts", "ProgramKey", "closest", "hook_parts", "reasons"]


@dataclasses.dataclass(frozen=True)
class ProgramKey:
    """A program's cache key: every part that changes the compiled graph, named for
    explaining a miss (hashable; the cache is keyed on it).

    Attributes:
      kind: ``"train"``, ``"eval"`` or ``"predict"``.
      experiment: the experiment class's qualname.
      graph_consts: ``(field, content digest)`` for every GraphConst (its methods and the
        code of the functions it holds included; a digest, so mutating the value in place
        after the key was made cannot change the key's hash).
      model: the model's structure key (Linen module, NNX graphdef, Equinox static part).
      optimizer: the optimizer's structure key, None for programs without one.
      hooks: ``(hook, digest of the hook's own code)``.
      helpers: ``("hook/name", digest)`` for everything else a hook reached: helper
        functions, ``global:NAME`` module-level values, ``closure:NAME`` cells (the names
        `fingerprint.describe_reach` gives). `hook_parts` builds both from the hooks.
      inputs: ``(path, shape, dtype, weak_type)`` per traced input leaf, with paths like
        ``"batch['img']"`` or ``"extras['device']['smoothing']"``.
      split: the data split the program was compiled for, if any.
      options: ``(name, value)`` for accum, steps_per_call, precision, compile options, mesh.
      graph_types: ``(field, type name)`` of every GraphConst (``1`` and ``1.0`` are equal
        values but bake in different constants).
      module: the experiment class's module (with `experiment`, which programs a stale
        check may drop).
      routes: ``(hook, required, optional, takes_all)``: the batch fields each hook takes.
      deps: ``(function, fingerprint)`` of every function the program traces (stale
        detection compares these by name).
      avals: the input tree structure with every leaf's shape, dtype, weak type and
        sharding (what `inputs` names, plus shardings).
      graph_shown: ``(field, short repr)`` of every GraphConst as it was when the key was
        made (for explanations only: not compared, not hashed).
      gaps: what the key's digests could not cover by content (`fingerprint`'s gaps): empty,
        an equal key proves the program a trace would give unchanged (not compared).
    """

    kind: str
    experiment: str
    graph_consts: tuple[tuple[str, Any], ...]
    model: Hashable
    optimizer: Hashable | None
    hooks: tuple[tuple[str, str], ...]
    helpers: tuple[tuple[str, str], ...]
    inputs: tuple[tuple[str, tuple, str, bool], ...]
    split: str | None
    options: tuple[tuple[str, Any], ...]
    module: str = ""
    graph_types: tuple[tuple[str, str], ...] = ()
    routes: tuple = ()
    deps: tuple[tuple[str, str], ...] = ()
    avals: Hashable = None
    graph_shown: tuple[tuple[str, str], ...] = dataclasses.field(default=(), compare=False)
    gaps: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __hash__(self) -> int:
        # Computed once: a model structure hashes slowly (an NNX graphdef's attributes), and a
        # key is hashed several times per program request (a predict loop's every call).
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash(tuple(getattr(self, f.name) for f in _HASHED))
            object.__setattr__(self, "_hash", cached)
        return cached

    def option(self, name: str, default: Any = None) -> Any:
        return dict(self.options).get(name, default)


_HASHED = tuple(f for f in dataclasses.fields(ProgramKey) if f.compare)

#: The name the explanations were first written against.
KeyParts = ProgramKey

#: Option names: a JAX flag (``"jax config jax_enable_x64"``) and the environment's digest.
JAX_FLAG = "jax config "
ENVIRONMENT = "environment"


def shown(value: Any) -> str:
    """A GraphConst value as an explanation shows it (short; taken when the key is made)."""
    try:
        return _repr.repr(value)
    except Exception:  # a repr that fails
        return f"<{type(value).__name__}>"


def hook_parts(
    hooks: Mapping[str, Any],
) -> tuple[tuple[tuple[str, str], ...], tuple[tuple[str, str], ...]]:
    """``(hooks, helpers)`` fields of a `KeyParts` for hook name -> function (or a model
    class, or a class value: see `programs.traced_code`).

    The hook's own entry in `describe_reach` goes to ``hooks``, everything it reached to
    ``helpers`` under ``"hook/name"``, so an edit to a helper is never blamed on the hook.
    """
    own, reached = [], []
    for name, fn in hooks.items():
        if not callable(fn) and not isinstance(fn, functools.partialmethod):
            # a class value read as `self.NAME`: one digest, nothing reached
            own.append((name, fingerprint_value(getattr(fn, "value", fn), strict=False)))
            continue
        mine, theirs = entry_parts(name, fn, describe_reach(fn), None)
        own.append(mine)
        reached += theirs
    return tuple(own), tuple(reached)


def entry_parts(
    name: str, fn: Any, reach: dict[str, str], whole: str | None
) -> tuple[tuple[str, str], list[tuple[str, str]]]:
    """One callable's ``(hook, own digest)`` and ``("hook/item", digest)`` entries of
    `hook_parts`, from its `describe_reach` (`whole`: its fingerprint, if known)."""
    reach = dict(reach)
    target = inspect.unwrap(getattr(fn, "__func__", fn))
    qualname = getattr(target, "__qualname__", "")
    # not found (a callable object, a partial): the whole fingerprint stands in for it
    mine = reach.pop(qualname, "") or whole or fingerprint(fn)
    return (name, mine), [(f"{name}/{item}", digest) for item, digest in reach.items()]


def reasons(old: KeyParts, new: KeyParts) -> list[str]:
    """Short sentences saying how `new` differs from `old`, most specific first.

    Example:
      >>> reasons(cached, missed)
      ['GraphConst `width` changed 128 → 256', 'the model structure changed (layers, ...)']
    """
    out, changed = _graph_reasons(old, new)
    out += [
        f"GraphConst `{name}` changed type {a} → {b}"
        for name, a, b in _changed(old.graph_types, new.graph_types)
        if name not in changed
    ]
    out += _code_reasons(old, new)
    out += _input_reasons(old, new, _leading(old), _leading(new))
    out += _state_reasons(old, new)
    if old.split != new.split:
        out.append(f"split {_show(old.split)} → {_show(new.split)}")
    for name, a, b in _changed(old.options, new.options):
        if name == ENVIRONMENT:
            out.append(_environment_reason(a, b))
        elif name.startswith(JAX_FLAG):
            flag = name.removeprefix(JAX_FLAG)
            out.append(f"jax config `{flag}` {_flag(a)} → {_flag(b)} (jax.config.update)")
        else:
            out.append(f"{name} {_show(a)} → {_show(b)}")
    out += _optimizer_reasons(old.optimizer, new.optimizer)
    if old.routes and new.routes and old.routes != new.routes:
        out.append("the batch fields a hook takes changed (its signature)")
    if old.model != new.model and not (_model_code_changed(old, new) and _same_shape(old, new)):
        # (a class re-defined with edited code is a new class object in the structure: the
        # code sentences above say what changed, the layers did not)
        out.append("the model structure changed (layers, widths or static fields)")
    if old.experiment != new.experiment:
        out.append(f"a different experiment: {old.experiment} → {new.experiment}")
    if old.kind != new.kind:
        out.append(f"a different program: {old.kind} → {new.kind}")
    if not out:  # the parts hold everything in the key but shardings and the device mesh
        out.append("an input sharding or the mesh changed")
    return out


def closest(new: KeyParts, candidates: list[KeyParts]) -> KeyParts | None:
    """The candidate `new` most likely replaced: same kind and experiment preferred, then
    the fewest differing parts; ties go to the later candidate (the newer program)."""
    if not candidates:
        return None
    ranked = [
        ((c.kind != new.kind, c.experiment != new.experiment, _distance(c, new), -i), c)
        for i, c in enumerate(candidates)
    ]
    return min(ranked, key=lambda pair: pair[0])[1]


# --- the parts of `reasons` ----------------------------------------------------------------


def _graph_reasons(old: KeyParts, new: KeyParts) -> tuple[list[str], set[str]]:
    """GraphConst sentences, and the fields whose value (not only type) they name."""
    shown_old, shown_new = dict(old.graph_shown), dict(new.graph_shown)
    types_old, types_new = dict(old.graph_types), dict(new.graph_types)
    out, changed = [], set()
    for name, a, b in _changed(old.graph_consts, new.graph_consts):
        sa = shown_old[name] if name in shown_old else _show(a)
        sb = shown_new[name] if name in shown_new else _show(b)
        if sa != sb:
            out.append(f"GraphConst `{name}` changed {sa} → {sb}")
            changed.add(name)
        elif types_old.get(name) == types_new.get(name):
            what = _DIGEST.sub("", sb)
            out.append(
                f"GraphConst `{name}` changed by content, not by its repr ({what}): the code "
                f"of a function it is or holds, what that code reads (a module-level value, a "
                f"helper), a method of its class, or a value inside it"
            )
            changed.add(name)
    return out, changed


def _flag(value: Any) -> str:
    return value if isinstance(value, str) else _show(value)


def _environment_reason(old: Any, new: Any) -> str:
    from jaxnitro._src.compile import context

    names = context.environment_changes(str(old), str(new)) if old is not _MISSING else []
    if not names:
        return "the environment (os.environ) changed"
    shown = ", ".join(
        f"`{k}` {_show(context.environment_value(str(old), k))} → "
        f"{_show(context.environment_value(str(new), k))}"
        for k in names[:4]
    )
    more = f" and {len(names) - 4} more" if len(names) > 4 else ""
    return f"environment variable {shown}{more} (os.environ, read while tracing)"


def _state_reasons(old: KeyParts, new: KeyParts) -> list[str]:
    """Dtype changes among the arrays that are not batch or Device inputs (parameters,
    optimizer state): what `jax_enable_x64` or a cast of the parameters does."""
    try:
        (tree0, leaves0), (tree1, leaves1) = typing.cast(Any, (old.avals, new.avals))
    except (TypeError, ValueError):
        return []
    if tree0 != tree1 or len(leaves0) != len(leaves1):
        return []
    pairs = collections.Counter(  # (shape, dtype, weak type, sharding) of arrays only
        (a[1], b[1])
        for a, b in zip(leaves0, leaves1, strict=True)
        if len(a) == len(b) == 4 and a[0] == b[0] and a[1] != b[1]
    )
    inputs = {(a[2], b[2]) for a, b in zip(old.inputs, new.inputs, strict=False) if a[2] != b[2]}
    return [
        f"dtype of {count} parameter or state array{'s' * (count > 1)} changed {a} → {b}"
        for (a, b), count in pairs.items()
        if (a, b) not in inputs or count > 1
    ]


def _optimizer_reasons(old: Any, new: Any) -> list[str]:
    """What changed in the optimizer, by name: ``gradient_clip_norm 1.0 → 2.0``."""
    if old == new:
        return []
    described = all(
        isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], tuple) for o in (old, new)
    )
    if described:
        out = []
        for name, a, b in _changed(old[0], new[0]):
            if name == "param groups":
                added = sorted(
                    set(b if b is not _MISSING else ()) - set(a if a is not _MISSING else ())
                )
                gone = sorted(
                    set(a if a is not _MISSING else ()) - set(b if b is not _MISSING else ())
                )
                out += [f"param group `{g}` added" for g in added]
                out += [f"param group `{g}` removed" for g in gone]
            elif a is not _MISSING and b is not _MISSING:
                if isinstance(a, bool) and isinstance(b, bool):
                    out.append(f"{name} {'turned on' if b else 'turned off'}")
                else:
                    out.append(f"{name} {_show(a)} → {_show(b)}")
        if out:
            return out
    return ["the optimizer changed (its type, param groups or static hyperparameters)"]


def _root_sentence(root: str, a: Any, b: Any) -> str:
    """What changed in one traced root: a hook, a class value read as `self.NAME`, or a
    model class (``model:Qualname``, whose own digest covers its name, bases and the names
    of its attributes)."""
    if root.startswith("model-fn:"):
        name = root.removeprefix("model-fn:")
        if a is _MISSING:
            return f"the model now holds function `{name}`"
        if b is _MISSING:
            return f"the model no longer holds function `{name}`"
        return f"the model's code changed: function `{name}` (held by the model) was edited"
    if root.startswith("model:"):
        cls = root.removeprefix("model:")
        if a is _MISSING:
            return f"the model now uses class `{cls}`"
        if b is _MISSING:
            return f"the model no longer uses class `{cls}`"
        return f"the model's code changed: class `{cls}` gained or lost a method or attribute"
    if root.startswith("self."):
        name = root.removeprefix("self.")
        if a is _MISSING:
            return f"class attribute `{name}` of the experiment (read as `{root}`) is now read"
        if b is _MISSING:
            return (
                f"class attribute `{name}` of the experiment (read as `{root}`) is no longer read"
            )
        return f"class attribute `{name}` of the experiment (read as `{root}`) changed"
    if a is _MISSING:
        return f"hook `{root}` is now defined"
    if b is _MISSING:
        return f"hook `{root}` is no longer defined"
    return f"hook `{root}` was edited"


def _helper_sentence(root: str, item: str, verb: str) -> str:
    """What changed among what a root reached: `item` as `describe_reach` names it."""
    kind, _, name = item.rpartition(":")
    if kind == "method":  # a function put on a class from elsewhere (`Net.__call__ = f`)
        how = {"is now used": "was replaced", "is no longer used": "was put back"}.get(
            verb, "was replaced again"
        )
        if root.startswith("model:"):
            return f"the model's code changed: `{name}` {how}"
        where = f" (reached from hook `{root}`)" if root else ""
        return f"method `{name}`{where} {how}"
    if root.startswith("model-fn:"):
        held = root.removeprefix("model-fn:")
        what = {"global": "module-level value", "closure": "closure variable"}.get(kind, "helper")
        return (
            f"the model's code changed: {what} `{name}` (reached from function `{held}` the "
            f"model holds) {verb}"
        )
    if root.startswith("model:"):
        cls = root.removeprefix("model:")
        if not kind and name.startswith(f"{cls}."):
            return f"the model's code changed: `{name}` {verb}"
        what = {
            "global": "class attribute" if name.startswith(f"{cls}.") else "module-level value",
            "closure": "closure variable",
            "wrapper": "wrapper",
        }.get(kind, "helper")
        return f"the model's code changed: {what} `{name}` (reached from class `{cls}`) {verb}"
    kinds = {"global": "module-level value", "closure": "closure variable", "wrapper": "wrapper"}
    where = f" (reached from hook `{root}`)" if root else ""
    return f"{kinds.get(kind, 'helper')} `{name}`{where} {verb}"


def _code_reasons(old: KeyParts, new: KeyParts) -> list[str]:
    out = [_root_sentence(hook, a, b) for hook, a, b in _changed(old.hooks, new.hooks)]
    helpers = _changed(old.helpers, new.helpers)
    # An edit to code changes what it reaches: the names it now uses or no longer uses are
    # consequences of that edit, not causes. Report the edited code (and changed values).
    code_edited = bool(out) or any(
        (a is not _MISSING and b is not _MISSING and ":" not in key.partition("/")[2])
        or key.partition("/")[2].startswith("method:")
        for key, a, b in helpers
    )
    for key, a, b in helpers:
        hook, _, item = key.partition("/")
        if code_edited and (a is _MISSING or b is _MISSING) and not item.startswith("method:"):
            continue
        kind = item.rpartition(":")[0]
        verb = (
            "is now used"
            if a is _MISSING
            else "is no longer used"
            if b is _MISSING
            else "changed"
            if kind
            else "was edited"
        )
        out.append(_helper_sentence(hook, item, verb))
    return out


def _model_code_changed(old: KeyParts, new: KeyParts) -> bool:
    return any(
        key.startswith(("model:", "model-fn:"))
        for key, *_ in (*_changed(old.hooks, new.hooks), *_changed(old.helpers, new.helpers))
    )


def _same_shape(old: KeyParts, new: KeyParts) -> bool:
    """Whether two model structures print alike: the same layers and widths, only other
    class objects of the same names."""
    try:  # (a function in the structure is keyed by its fingerprint: the code part names it)
        return _DIGEST.sub("#", repr(old.model)) == _DIGEST.sub("#", repr(new.model))
    except Exception:  # a structure without a usable repr
        return False


_DIGEST = re.compile(r"\b[0-9a-f]{64}\b| at 0x[0-9a-f]+")


def _leading(parts: KeyParts) -> int:
    """Stacking axes in front of each batch input: one for steps_per_call > 1, one for
    accum > 1 (a change of either reshapes the batch; it is the cause, not the shapes)."""
    opts = dict(parts.options)
    return int((opts.get("steps_per_call") or 1) > 1) + int((opts.get("accum") or 1) > 1)


def _input_reasons(old: KeyParts, new: KeyParts, lead0: int = 0, lead1: int = 0) -> list[str]:
    before = {path: _strip(path, rest, lead0) for path, *rest in old.inputs}
    after = {path: _strip(path, rest, lead1) for path, *rest in new.inputs}
    split = f" on split {new.split!r}" if new.split is not None else ""
    out, partial = [], []
    out += [f"input `{_field(p)}` is no longer passed" for p in before if p not in after]
    out += [f"input `{_field(p)}` is new" for p in after if p not in before]
    for path in sorted(before.keys() & after.keys()):
        (shape0, dtype0, weak0), (shape1, dtype1, weak1) = before[path], after[path]
        field = _field(path)
        if tuple(shape0) != tuple(shape1):
            shrank = (
                len(shape0) == len(shape1) > 0
                and tuple(shape0[1:]) == tuple(shape1[1:])
                and shape1[0] < shape0[0]
            )
            if shrank and _is_batch(path):
                partial.append((path, shape0, shape1))
            else:
                out.append(
                    f"the train arrays on the device changed: `{field}` {tuple(shape0)} → "
                    f"{tuple(shape1)} (another dataset size; data_on_device=False keeps one "
                    f"program across sizes)"
                    if "train arrays on the device" in path
                    else f"shape of `{field}` changed {tuple(shape0)} → {tuple(shape1)}"
                )
        if dtype0 != dtype1:
            out.append(f"dtype of `{field}` changed {dtype0} → {dtype1}")
        elif weak0 != weak1 and tuple(shape0) == tuple(shape1):
            out.append(_weak_type_reason(field, str(dtype1), weak1))
    if partial:  # one sentence for all fields of the short batch
        path, shape0, shape1 = partial[0]
        others = ", ".join(f"`{_field(p)}`" for p, *_ in partial[1:])
        # predict pads any batch to a power-of-two bucket: a new bucket, not a partial batch
        hint = (
            ": another predict bucket (batches pad to powers of two)"
            if new.kind == "predict"
            else ": a partial batch? use drop_last=True"
        )
        out.insert(
            0,
            (
                f"batch shape {tuple(shape0)} → {tuple(shape1)} for `{_field(path)}`"
                f"{f' (and {others})' if others else ''}{split}{hint}"
            ),
        )
    return out


def _is_batch(path: str) -> bool:
    """ "batch['img']" or "['batch']['img']" (a keystr of {"batch": ...})."""
    return path.lstrip("[\"'").startswith("batch")


def _strip(path: str, rest: Any, lead: int) -> tuple[Any, ...]:
    shape, *others = rest
    if lead and _is_batch(path) and len(shape) > lead:
        shape = tuple(shape)[lead:]
    return (tuple(shape), *others)


def _weak_type_reason(field: str, dtype: str, weak: bool) -> str:
    py = (
        "float"
        if "float" in dtype
        else "int"
        if "int" in dtype
        else "complex"
        if "complex" in dtype
        else "bool"
    )
    if weak:
        return (
            f"`{field}` arrived as a weakly typed value (a Python {py}?): pass "
            f"jnp.{dtype}(...) or declare it jn.Device[{py}]"
        )
    return (
        f"`{field}` was weakly typed (a Python {py}) and is now a {dtype} array: pass it "
        f"the same way every time, e.g. jnp.{dtype}(...)"
    )


# --- helpers -----------------------------------------------------------------------------

_MISSING = object()
_repr = reprlib.Repr()  # keyword arguments need Python 3.12
_repr.maxstring = _repr.maxother = 40


def _changed(old: Any, new: Any) -> list[tuple[str, Any, Any]]:
    """(name, old value, new value) for the names whose value differs; _MISSING if absent."""
    a, b = dict(old), dict(new)
    names = list(a) + [n for n in b if n not in a]
    return [
        (n, a.get(n, _MISSING), b.get(n, _MISSING))
        for n in names
        if n not in a or n not in b or not _equal(a[n], b[n])
    ]


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays and other values without a plain truth value
        return a is b


def _distance(a: KeyParts, b: KeyParts) -> int:
    """How many parts differ: one per changed name in the named fields, one per other."""
    count = 0
    for field in dataclasses.fields(ProgramKey):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if field.name in ("graph_consts", "graph_types", "hooks", "helpers", "options"):
            count += len(_changed(x, y))
        elif field.name == "inputs":
            count += len(_changed([(p, rest) for p, *rest in x], [(p, rest) for p, *rest in y]))
        elif not _equal(x, y):
            count += 1
    return count


def _field(path: str) -> str:
    """`img` for "batch['img']", `smoothing` for "extras['device']['smoothing']"."""
    tail = path.rsplit("[", 1)[-1].rstrip("]").strip("'\"")
    return tail or path


def _show(value: Any) -> str:
    return "(absent)" if value is _MISSING else _repr.repr(value)
