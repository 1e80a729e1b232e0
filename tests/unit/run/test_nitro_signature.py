"""`jn.Nitro`'s typed signature (what checkers read) agrees with the options' declarations.

The options are declared once, in `jaxnitro._src.run.options`; `Nitro.__init__` restates them
under `TYPE_CHECKING` so that a misspelled option is a type error. These tests read that
signature from the source (it does not exist at run time) and hold it to the declarations.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

import jaxnitro as jn
from jaxnitro._src.run import nitro, options


def _typed_init() -> ast.FunctionDef:
    """`Nitro.__init__` as written in the `if TYPE_CHECKING:` block of the class."""
    tree = ast.parse(Path(nitro.__file__).read_text(encoding="utf-8"))
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Nitro")
    for node in cls.body:
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for fn in node.body:
                if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                    return fn
    raise AssertionError("class Nitro has no `if TYPE_CHECKING: def __init__`")


def test_the_typed_signature_names_every_option_in_order_keyword_only():
    fn = _typed_init()
    assert [a.arg for a in fn.args.posonlyargs + fn.args.args] == ["self", "exp"]
    assert fn.args.vararg is None and fn.args.kwarg is None  # no `**given`: typos are errors
    assert [a.arg for a in fn.args.kwonlyargs] == list(options.NAMES)


def test_the_typed_signature_has_the_declared_defaults():
    fn = _typed_init()
    pairs = zip(fn.args.kwonlyargs, fn.args.kw_defaults, strict=True)
    typed = {a.arg: "<required>" if d is None else ast.literal_eval(d) for a, d in pairs}
    declared = {o.name: o.default for o in options.OPTIONS}
    assert typed == declared
    assert {k: type(v) for k, v in typed.items()} == {k: type(v) for k, v in declared.items()}


def test_every_typed_option_takes_none_which_means_not_given():
    fn = _typed_init()
    lacking = [a.arg for a in fn.args.kwonlyargs if not ast.unparse(a.annotation).endswith("None")]
    assert lacking == []


def test_the_runtime_signature_is_the_declarations():
    params = list(inspect.signature(jn.Nitro).parameters.values())
    assert [p.name for p in params] == ["exp", *options.NAMES]
    assert {p.kind for p in params[1:]} == {inspect.Parameter.KEYWORD_ONLY}
    assert [p.default for p in params[1:]] == [o.default for o in options.OPTIONS]


def test_a_misspelled_option_still_fails_at_run_time_with_a_did_you_mean():
    @jn.experiment
    class Exp:
        width: int = 1

    with pytest.raises(jn.ConfigError, match="no option 'max_epoch'.*max_epochs"):
        jn.Nitro(Exp(), max_epoch=3)  # type: ignore[call-arg]
