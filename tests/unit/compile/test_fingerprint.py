"""Hook fingerprints: an edit anywhere a hook depends on must change the key; nothing else may."""

from __future__ import annotations

import dataclasses
import enum
import functools
import gc
import importlib
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxnitro._src.compile import fingerprint as fp
from jaxnitro._src.compile.fingerprint import describe_reach, fingerprint, fingerprint_value
from jaxnitro._src.compile.remembered import _remembered, check_of, remembered

HOOK = """
SCALE = 2.0
UNRELATED = 1

def helper(x):
    return x * SCALE

def other(x):
    return x + 1

def hook(x, y=3):
    return helper(x) + other(y)
"""


def load(source: str, ns: dict | None = None, *, name: str = "user_ns") -> dict:
    """exec `source` the way a notebook cell runs: no file, module-level globals."""
    ns = {"__name__": name} if ns is None else ns
    exec(compile(textwrap.dedent(source), "<cell>", "exec"), ns)
    return ns


# -- identity of behaviour ---------------------------------------------------------------


def test_same_function_is_stable():
    ns = load(HOOK)
    assert fingerprint(ns["hook"]) == fingerprint(ns["hook"])
    assert len(fingerprint(ns["hook"])) == 64


@pytest.mark.parametrize("name", ["user_ns", None])
def test_identical_redefinition_matches(name):
    # None: exec without __name__ gives functions __module__ None; still user code.
    fresh = (lambda: {"__name__": name}) if name else dict
    assert fingerprint(load(HOOK, fresh())["hook"]) == fingerprint(load(HOOK, fresh())["hook"])


@pytest.mark.parametrize(
    "edit",
    [
        ("x * SCALE", "x * SCALE * 1.5"),  # another constant path
        ("y=3", "y=4"),  # a default
        ("helper(x) + other(y)", "helper(x) - other(y)"),  # an op
        ("return x + 1", "return x + 2"),
    ],
)  # a constant in a helper
def test_edited_body_changes(edit):
    before = fingerprint(load(HOOK)["hook"])
    assert fingerprint(load(HOOK.replace(*edit))["hook"]) != before


def test_moving_code_keeps_digest():
    moved = "\n\n\n# a comment\n\n" + HOOK.replace("def other", "\n\n\ndef other")
    assert fingerprint(load(moved)["hook"]) == fingerprint(load(HOOK)["hook"])


def test_lambda_inside_is_hashed():
    src = "def f(xs):\n    return list(map(lambda x: x * {k}, xs))\n"
    a, b, c = (load(src.format(k=k))["f"] for k in (2, 2, 3))
    assert fingerprint(a) == fingerprint(b) != fingerprint(c)


# -- helpers, globals, closures, defaults ------------------------------------------------


def test_edited_helper_changes_caller_and_reach_names_it():
    ns = load(HOOK)
    fp, reach = fingerprint(ns["hook"]), describe_reach(ns["hook"])
    load("def helper(x):\n    return x * SCALE * SCALE\n", ns)  # re-run one cell
    reach2 = describe_reach(ns["hook"])
    assert fingerprint(ns["hook"]) != fp
    assert reach.keys() == reach2.keys() >= {"hook", "helper", "other", "global:SCALE"}
    assert [k for k in reach if reach[k] != reach2[k]] == ["helper"]


def test_helper_of_helper_within_depth():
    ns = load(HOOK + "\ndef top(x):\n    return hook(x)\n")
    fp = fingerprint(ns["top"])  # top -> hook -> helper: helper's code is at depth 0
    load("def helper(x):\n    return x - SCALE\n", ns)
    assert fingerprint(ns["top"]) != fp
    # depth=0 hashes top's own code and only the names of what it calls
    assert fingerprint(ns["top"], depth=0) == fingerprint(
        load(HOOK + "\ndef top(x):\n    return hook(x)\n")["top"], depth=0
    )


def test_module_constant_read_changes_digest_unrelated_does_not():
    ns = load(HOOK)
    fp = fingerprint(ns["hook"])
    ns["UNRELATED"] = 99
    assert fingerprint(ns["hook"]) == fp
    ns["SCALE"] = 3.0
    assert fingerprint(ns["hook"]) != fp
    assert describe_reach(ns["hook"])["global:SCALE"] == fingerprint_value(3.0)


def test_attribute_reads_are_not_global_dependencies():
    # A hook reading `self.tol` must not depend on a module-level `tol` (a notebook loop
    # `for tol in (0.5, 1.0): ...` would make every call recompile); one reading `tol` must.
    ns = load("""
    tol = 0.5

    def reads_attribute(self_like, x):
        return x * self_like.tol + self_like.update(x) + (lambda o: o.tol)(self_like)

    def reads_global(x):
        return x * tol
    """)
    ns["update"] = len  # a global named like a method the code calls on an argument
    fp_attr, fp_global = fingerprint(ns["reads_attribute"]), fingerprint(ns["reads_global"])
    for tol in (1.0, 2.0):
        ns["tol"] = tol
        ns["update"] = abs
        assert fingerprint(ns["reads_attribute"]) == fp_attr
        assert fingerprint(ns["reads_global"]) != fp_global
    assert not {"global:tol", "global:update"} & describe_reach(ns["reads_attribute"]).keys()
    assert "global:tol" in describe_reach(ns["reads_global"])


def test_renamed_attribute_still_changes_the_code_digest():
    src = "def f(obj):\n    return obj.{name} * 2\n"
    assert fingerprint(load(src.format(name="tol"))["f"]) != fingerprint(
        load(src.format(name="eps"))["f"]
    )


def test_stored_global_is_not_a_dependency():
    ns = load("LAST = None\n\ndef f(x):\n    global LAST\n    LAST = x\n    return x * 2\n")
    fp = fingerprint(ns["f"])
    ns["LAST"] = 3.0  # what the function stores there never changes what it computes
    assert fingerprint(ns["f"]) == fp


def test_enum_member_value_counts():
    src = (
        "import enum\nclass Mode(enum.Enum):\n    A = {v}\ndef f(x):\n    return x * Mode.A.value\n"
    )
    assert fingerprint(load(src.format(v=1))["f"]) == fingerprint(load(src.format(v=1))["f"])
    assert fingerprint(load(src.format(v=1))["f"]) != fingerprint(load(src.format(v=2))["f"])


def test_global_array_constant():
    ns = load("import numpy as np\nW = np.arange(4.0)\ndef f(x):\n    return x @ W\n")
    fp = fingerprint(ns["f"])
    ns["W"] = np.arange(4.0)  # new object, same content
    assert fingerprint(ns["f"]) == fp
    ns["W"][1] = 7.0
    assert fingerprint(ns["f"]) != fp


def make_scaled(k, *, act=None):
    def scaled(x):
        return act(x * k) if act else x * k

    return scaled


def test_closure_value_changes_digest():
    assert fingerprint(make_scaled(2.0)) == fingerprint(make_scaled(2.0))
    assert fingerprint(make_scaled(2.0)) != fingerprint(make_scaled(3.0))
    assert fingerprint(make_scaled(2.0)) != fingerprint(
        make_scaled(2)
    )  # int vs float traces differently
    assert fingerprint(make_scaled(1.0, act=jnp.tanh)) != fingerprint(make_scaled(1.0, act=jnp.sin))
    assert "closure:k" in describe_reach(make_scaled(2.0))


def test_unhashable_closure_is_hashed_by_identity():
    class Opaque:
        pass

    a, b = Opaque(), Opaque()
    assert fingerprint(make_scaled(a)) == fingerprint(make_scaled(a))
    assert fingerprint(make_scaled(a)) != fingerprint(make_scaled(b))


def test_identity_is_not_fooled_by_id_reuse(monkeypatch):
    class Opaque:
        pass

    # CPython reuses a freed object's address for the next object of its size, but not
    # reliably (it depends on what ran before): every Opaque here reports one id, as if the
    # allocator had handed the dead object's block to the next one.
    monkeypatch.setattr(fp, "id", lambda o: 1 if isinstance(o, Opaque) else id(o), raising=False)
    first = Opaque()
    digest = fingerprint(make_scaled(first))
    assert fingerprint(make_scaled(first)) == digest  # the same live object: the same token
    del first
    gc.collect()
    assert fingerprint(make_scaled(Opaque())) != digest


def test_identity_tokens_are_forgotten_with_their_objects():
    class Opaque:
        pass

    obj = Opaque()
    fingerprint(make_scaled(obj))
    key = id(obj)
    assert fp._identities[key][0]() is obj
    del obj
    gc.collect()
    assert key not in fp._identities


def test_objects_without_weak_references_are_hashed_by_id():
    a, b = object(), object()  # object() cannot be weakly referenced
    assert fingerprint(make_scaled(a)) == fingerprint(make_scaled(a))
    assert fingerprint(make_scaled(a)) != fingerprint(make_scaled(b))


def test_defaults_change_digest():
    src = "def f(x, *, eps={eps}, axes={axes}):\n    return x + eps\n"
    base = fingerprint(load(src.format(eps=1e-6, axes=(0,)))["f"])
    assert fingerprint(load(src.format(eps=1e-6, axes=(0,)))["f"]) == base
    assert fingerprint(load(src.format(eps=1e-5, axes=(0,)))["f"]) != base
    assert fingerprint(load(src.format(eps=1e-6, axes=(0, 1)))["f"]) != base


# -- unwrapping --------------------------------------------------------------------------


def add(x, y):
    return x + y


def test_partial_arguments_count():
    assert fingerprint(functools.partial(add, 2)) == fingerprint(functools.partial(add, 2))
    assert fingerprint(functools.partial(add, 2)) != fingerprint(functools.partial(add, 3))
    assert fingerprint(functools.partial(add, y=2)) != fingerprint(functools.partial(add, 2))
    assert fingerprint(functools.partial(add, 2)) != fingerprint(add)


class Model:
    def __init__(self, scale):
        self.scale = scale

    def loss(self, x):
        return x * self.scale

    def __call__(self, x):
        return self.loss(x)

    @classmethod
    def build(cls):
        return cls(1)


class OtherModel(Model):
    def __call__(self, x):
        return -self.loss(x)


def test_bound_method_digests_the_function_not_the_instance():
    assert fingerprint(Model(1).loss) == fingerprint(Model(2).loss) == fingerprint(Model.loss)
    assert fingerprint(Model.build) == fingerprint(Model.__dict__["build"])
    assert "Model.loss" in describe_reach(Model(1).loss)


def test_callable_object_digests_its_call():
    assert fingerprint(Model(1)) == fingerprint(Model(2))
    assert fingerprint(Model(1)) != fingerprint(OtherModel(1))
    assert "Model.__call__" in describe_reach(Model(1))


def test_wrapped_follows_to_the_user_function_and_keeps_the_wrapper():
    def deco(k):
        def outer(fn):
            @functools.wraps(fn)
            def wrapper(*args):
                return fn(*args) * k

            return wrapper

        return outer

    src = "def f(x):\n    return x + {c}\n"
    f1, f2 = (load(src.format(c=c))["f"] for c in (1, 2))
    assert fingerprint(deco(2)(f1)) == fingerprint(deco(2)(f1))
    assert fingerprint(deco(2)(f1)) != fingerprint(deco(2)(f2))  # the body under the decorator
    assert fingerprint(deco(2)(f1)) != fingerprint(deco(3)(f1))  # the decorator's own state


# -- cycles, libraries, modules ----------------------------------------------------------


def test_recursion_terminates():
    ns = load("""
    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    def even(n):
        return n == 0 or odd(n - 1)

    def odd(n):
        return n != 0 and even(n - 1)
    """)
    deep = sys.getrecursionlimit()  # without a cycle guard only the depth limit would stop it
    for name in ("fact", "even", "odd"):
        assert fingerprint(ns[name], depth=deep) == fingerprint(ns[name], depth=deep)
    fp = fingerprint(ns["even"])
    load("def odd(n):\n    return n == 1 or even(n - 1)\n", ns)
    assert fingerprint(ns["even"]) != fp


def test_library_functions_are_hashed_by_name():
    ns = load(
        "import jax.numpy as jnp\nfrom jax.numpy import sum as jsum\n"
        "def f(x):\n    return jnp.sum(x) + jsum(x)\n"
    )
    assert fingerprint(jnp.sum) == fingerprint(jnp.sum)
    assert fingerprint(jnp.sum) != fingerprint(jnp.mean)
    reach = describe_reach(ns["f"])
    assert set(reach) == {"f", "global:jnp", "sum"}  # not one line of jax's own code


def test_library_closures_are_hashed_by_content():
    lr3 = optax.adam(1e-3).update
    assert fingerprint(lr3, depth=3) == fingerprint(optax.adam(1e-3).update, depth=3)
    assert fingerprint(lr3, depth=3) != fingerprint(optax.adam(1e-2).update, depth=3)


def test_typical_hook_is_fast():
    ns = load(HOOK)
    fingerprint(ns["hook"])
    # CPU time of this process: what fingerprinting costs, not how other jobs share the cores
    t0 = time.process_time()
    for _ in range(100):
        fingerprint(ns["hook"])
    assert (time.process_time() - t0) / 100 < 2e-3  # budget is 1 ms; slack for slow CPUs


def test_reloaded_module(tmp_path, monkeypatch):
    # No .pyc: an edit of the same length within the same second would look unchanged to it.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "fp_user_mod.py"
    source = "def helper(x):\n    return x * {k}\n\ndef hook(x):\n    return helper(x)\n"
    path.write_text(source.format(k=2))
    mod = importlib.import_module("fp_user_mod")
    try:
        fp = fingerprint(mod.hook)
        importlib.reload(mod)
        assert fingerprint(mod.hook) == fp  # unchanged source, new function objects
        path.write_text(source.format(k=3))
        importlib.reload(mod)
        assert fingerprint(mod.hook) != fp
    finally:
        sys.modules.pop("fp_user_mod", None)


# -- values ------------------------------------------------------------------------------


def test_fingerprint_value_numpy_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert fingerprint_value(a) == fingerprint_value(a.copy())
    assert fingerprint_value(a) == fingerprint_value(np.asfortranarray(a))  # layout is not content
    b = a.copy()
    b[1, 2] += 1
    assert fingerprint_value(a) != fingerprint_value(b)
    assert fingerprint_value(a) != fingerprint_value(a.reshape(4, 3))
    assert fingerprint_value(a) != fingerprint_value(a.astype(np.int32).view(np.float32))
    assert fingerprint_value(jnp.asarray(a)) == fingerprint_value(jnp.asarray(a)) is not None
    assert fingerprint_value(jnp.asarray(a)) != fingerprint_value(jnp.asarray(b))


def test_a_jax_arrays_digest_is_kept_while_it_lives():
    x = jnp.arange(4.0)
    digest = fingerprint_value(x)
    token = fp._identities[id(x)][1]
    assert fp._array_digests[token] == digest  # read back from the device once
    assert fingerprint_value(x) == digest
    del x
    gc.collect()
    assert token not in fp._array_digests


def test_arrays_past_the_size_limit_are_hashed_by_identity():
    n = fp.MAX_ARRAY_BYTES // 8  # float64: at the limit, by content; one element more, not
    small, small_copy = np.zeros(n), np.zeros(n)
    assert fingerprint_value(small) == fingerprint_value(small_copy)
    big, big_copy = np.zeros(n + 1), np.zeros(n + 1)
    assert fingerprint_value(big) == fingerprint_value(big) != fingerprint_value(big_copy)


def test_arrays_without_readable_bytes_have_no_content_digest():
    gone = jnp.ones(3)
    gone.delete()
    assert fingerprint_value(gone) is None
    assert fingerprint_value(jax.random.key(0)) is None  # an extended dtype


def test_fingerprint_value_kinds():
    class Color(enum.Enum):
        RED = 1
        BLUE = 2

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        width: int
        acts: tuple

    assert fingerprint_value(1) != fingerprint_value(1.0) != fingerprint_value(True)
    assert fingerprint_value(("a", 1)) != fingerprint_value(["a", 1])
    assert fingerprint_value({"a": 1, "b": [2, 3]}) == fingerprint_value({"a": 1, "b": [2, 3]})
    assert fingerprint_value(frozenset({1, 2})) == fingerprint_value(frozenset({2, 1}))
    assert fingerprint_value(Color.RED) != fingerprint_value(Color.BLUE)
    assert fingerprint_value(Cfg(2, (add,))) == fingerprint_value(Cfg(2, (add,)))
    assert fingerprint_value(Cfg(2, (add,))) != fingerprint_value(Cfg(3, (add,)))
    assert fingerprint_value(add) == fingerprint(add)


def test_fingerprint_value_refuses_arbitrary_objects():
    class Opaque:
        pass

    assert fingerprint_value(Opaque()) is None
    assert fingerprint_value((1, Opaque())) is None
    cyclic = []
    cyclic.append(cyclic)
    assert fingerprint_value(cyclic) is None
    with pytest.raises(TypeError):
        fingerprint(3)


def test_class_bookkeeping_entries_are_skipped():
    # the instance-namespace descriptor of every plain class is machinery, not behaviour
    assert {"__dict__", "__weakref__", "__module__", "__doc__"} <= fp._CLASS_SKIP

    class A:
        x = 1

    class B:
        x = 1

    B.__qualname__ = A.__qualname__
    assert fp.fingerprint_value(A) == fp.fingerprint_value(B)


def test_a_remembered_fingerprint_follows_every_edit_of_what_it_read():
    table = {"k": [1.0]}

    class Net:
        SCALE = 2.0

        def __call__(self, x):
            return x * self.SCALE

    def make(scale):
        def inner(x, pad=[0.0]):  # noqa: B006 (a mutable default, edited below)
            return x * scale + pad[0] + table["k"][0]

        return inner

    fn = make(2.0)

    def same():
        for obj in (fn, Net):
            assert remembered(obj) == fingerprint(obj)

    same()
    same()  # the remembered digests
    edits = [
        lambda: table["k"].__setitem__(0, 3.0),  # a closure's dict, changed deep inside
        lambda: fn.__defaults__[0].__setitem__(0, 1.0),  # a default list, in place
        lambda: setattr(fn, "__defaults__", ([5.0],)),
        lambda: fn.__closure__[0].__setattr__("cell_contents", 4.0),
        lambda: setattr(Net, "SCALE", 3.0),
        lambda: setattr(Net, "extra", 1),
        lambda: setattr(Net, "__call__", lambda self, x: x),
    ]
    for edit in edits:
        before = {id(o): remembered(o) for o in (fn, Net)}
        check = check_of((fn, Net))  # what `jn.train_step` runs at each step instead
        assert check is not None and check()
        edit()
        assert not check()
        same()
        assert before != {id(o): remembered(o) for o in (fn, Net)}


def test_a_remembered_check_sees_a_closure_cell_filled_after_it_was_read():
    def make():
        def inner(x):
            return x * later

        assert remembered(inner) == fingerprint(inner)  # `later` is an empty cell here
        check = check_of([inner])
        assert check is not None and check()
        later = 2.0
        assert not check()
        return inner, later

    inner, _ = make()
    assert remembered(inner) == fingerprint(inner)


def test_an_nnx_class_is_rechecked_by_identity_with_nothing_to_rehash():
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.l = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return self.l(x)

    # flax's machinery on the class (a HashableMapping): hashed by its type alone, so
    # nothing of it is re-hashed at each check; replacing it is still seen (by identity).
    machinery = [k for k, v in vars(Net).items() if type(v).__module__.startswith("flax")]
    assert machinery
    digest = remembered(Net)
    assert digest == fingerprint(Net)
    assert _remembered[id(Net)].rehash == []
    check = check_of([Net])
    assert check is not None and check()
    setattr(Net, machinery[0], type(vars(Net)[machinery[0]])(dict(vars(Net)[machinery[0]])))
    assert not check()
    assert remembered(Net) == fingerprint(Net) == digest  # (same type: the same digest)
