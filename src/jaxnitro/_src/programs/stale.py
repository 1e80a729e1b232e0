"""Edited code at an entry point: `check_stale` drops the programs traced from code that
changed since the run compiled and names the edit; `check_rebound` names a re-defined class.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from jaxnitro._src.compile import cache, explain
from jaxnitro._src.core.errors import warn_user
from jaxnitro._src.programs.traced import _shown, hook_prints, model_classes, traced_code

if TYPE_CHECKING:
    from jaxnitro._src.programs.keys import ProgramSet
    from jaxnitro._src.programs.spec import ProgramSpec


def _bound_now(cls: type) -> object | None:
    """What the class's module binds under its qualified name now (None: not found, or a
    class made inside a function, which no module binds)."""
    if "<locals>" in cls.__qualname__:
        return None
    obj: object = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        try:
            obj = vars(obj)[part]
        except (TypeError, KeyError):
            return None
    return obj


def check_rebound(spec: ProgramSpec, ps: ProgramSet) -> None:
    """Say once per class when the experiment's class (or a model class) is no longer the
    one its module binds under its name: a notebook cell re-run made a new class, and this
    handle still runs the old one's code (Python's semantics, but silent)."""
    classes = [spec.cls, *model_classes(spec).values()]
    for cls in classes:
        if cls in ps.rebound:
            continue
        now = _bound_now(cls)
        if not isinstance(now, type) or now is cls:
            continue
        ps.rebound.add(cls)
        exp = spec.cls.__name__
        what = "experiment" if cls is spec.cls else "model"
        warn_user(
            f"The {what} class `{cls.__qualname__}` was re-defined in `{cls.__module__}` after "
            f"this handle was made: this handle still runs the old class's code. To use the "
            f"new code, make a new handle: jn.Nitro({exp}(...), ...), or "
            f'jn.Nitro({exp}(...), run_dir=<this run\'s dir>, resume="auto") to continue '
            f"this run with it.",
        )


def check_stale(spec: ProgramSpec, ps: ProgramSet, *, begin: bool = True) -> None:
    """At an entry point: if a traced hook or helper was edited since this run compiled,
    drop the keys of the programs built from the old code and say so once, naming what
    changed (the hook, or the helper, module value or closure variable under it). Also names
    a class re-defined since the handle was made (`check_rebound`).

    `begin`: a new entry-point call, whose programs are each checked once against a trace of
    the current code before they run (`ProgramSet.verified`), unless a closed key proves
    them (`_acquire`); False: a step inside a call that already began (a validation).
    """
    if begin:
        ps.verified = set()
    check_rebound(spec, ps)
    old = ps.prints
    if old is None:
        return
    new = hook_prints(spec)
    if new == old:
        return
    was, now = dict(old), dict(new)
    edited = sorted(k for k in set(was) | set(now) if was.get(k) != now.get(k))
    parts = explain.hook_parts(traced_code(spec))
    named = _edits(ps.parts, parts) or [_shown(name) for name in edited]

    def stale(p: Any) -> bool:  # only programs that trace the edited code; the others stay valid
        return any(now.get(name) != digest for name, digest in p.deps)

    kinds = sorted({p.kind for p in ps.used.values() if stale(p)})
    # Their keys go; the executables stay findable by program text, so an edit that traces to
    # the same program (a docstring, a renamed local) compiles nothing.
    dropped = cache.drop(
        lambda p: (
            isinstance(p.key, explain.ProgramKey)
            and (p.key.module, p.key.experiment) == (spec.cls.__module__, spec.cls.__qualname__)
            and stale(p)
        ),
        by_text=False,
    )
    ps.reset_train()
    ps.prints, ps.parts = new, parts
    ps.slots = set()  # the recompiles that follow are explained here, not again
    ps.verified = set()
    which = f" (the {' and '.join(kinds)} program{'s' * (len(kinds) > 1)})" if kinds else ""
    warn_user(
        f"{spec.cls.__name__}: {', '.join(named)} changed since this Nitro compiled its "
        f"programs; {dropped} stale program(s) dropped{which}, they will be traced again from "
        f"the current code and recompiled where the program changed; programs that do not "
        f"call it are kept.",
    )


_REACHED = {
    "global": "module-level value",
    "closure": "closure variable",
    "wrapper": "wrapper",
    "method": "method",
    "partial": "the arguments of partial",
}


def _edits(old: tuple | None, new: tuple) -> list[str]:
    """What changed between two `explain.hook_parts`, as the user wrote it: a hook, class
    value or model class by its name; a helper (module value, closure variable) under a hook
    whose own code is unchanged by its name and where it was reached from."""
    if old is None:
        return []
    (old_own, old_reach), (new_own, new_reach) = (map(dict, old), map(dict, new))
    roots = sorted(k for k in old_own.keys() | new_own.keys() if old_own.get(k) != new_own.get(k))
    out = [_shown(k) for k in roots]
    for key in sorted(old_reach.keys() | new_reach.keys()):
        if old_reach.get(key) == new_reach.get(key):
            continue
        root, _, item = key.partition("/")
        if root in roots or key not in old_reach or key not in new_reach:
            continue  # (what an edited function now uses or no longer uses: its consequence)
        kind, _, name = item.rpartition(":")
        line = f"{_REACHED.get(kind, 'helper')} `{name}` (reached from {_shown(root)})"
        if line not in out:
            out.append(line)
    return out
