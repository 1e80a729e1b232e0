"""What a hook reaches beyond its own globals: user modules' attributes, user classes.

Editing `losses.py` and reloading it, or re-running the cell that defines a class a hook
instantiates, must change the fingerprint; an unchanged reload or re-run must not.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import os
import sys
import textwrap
import uuid

import pytest

from jaxnitro._src.compile.explain import KeyParts, hook_parts, reasons
from jaxnitro._src.compile.fingerprint import describe_reach, fingerprint


def load(source: str, ns: dict | None = None, *, name: str = "user_ns") -> dict:
    """exec `source` the way a notebook cell runs: no file, module-level globals."""
    ns = {"__name__": name} if ns is None else ns
    exec(compile(textwrap.dedent(source), "<cell>", "exec", dont_inherit=True), ns)
    return ns


def changed(before: dict, after: dict) -> set[str]:
    return {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}


class Files:
    """Python files under tmp_path, importable, each write seen by the next reload."""

    def __init__(self, root, tag: str):
        self.root, self.tag, self.names = root, tag, set()
        self._mtime = itertools.count(1_000_000_000, 10)

    def write(self, relpath: str, source: str) -> None:
        path = self.root / relpath.format(tag=self.tag)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source.format(tag=self.tag)))
        t = next(self._mtime)  # a new mtime whatever the clock resolution
        os.utime(path, (t, t))
        importlib.invalidate_caches()

    def load(self, name: str):
        name = name.format(tag=self.tag)
        self.names.add(name.partition(".")[0])
        return importlib.import_module(name)


@pytest.fixture
def files(tmp_path, monkeypatch):
    # No .pyc: an edit of the same length in the same second would look unchanged to it.
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.syspath_prepend(str(tmp_path))
    f = Files(tmp_path, uuid.uuid4().hex[:10])  # unique module names per test
    yield f
    for name in list(sys.modules):
        if name.partition(".")[0] in f.names:
            del sys.modules[name]


LOSSES = """
SCALE = {scale}
WEIGHT = {weight}

def penalty(z):
    return {body}

def unused(z):
    return z
"""

HOOKS = """
import losses_{tag}

def hook(x):
    return losses_{tag}.penalty(x) * losses_{tag}.SCALE
"""


def write_losses(files, *, scale=1.0, weight=0.5, body="WEIGHT * (z ** 2).mean()", extra=""):
    files.write("losses_{tag}.py", LOSSES.format(scale=scale, weight=weight, body=body) + extra)


# -- module attributes -------------------------------------------------------------------


def test_module_function_edit_and_reload(files):
    write_losses(files)
    files.write("hooks_{tag}.py", HOOKS)
    losses, hooks = files.load("losses_{tag}"), files.load("hooks_{tag}")
    fp, reach = fingerprint(hooks.hook), describe_reach(hooks.hook)
    assert "penalty" in reach  # named, so an explanation can say which helper changed

    write_losses(files, extra="\n\n# a comment, and the same code\n")
    importlib.reload(losses)
    assert fingerprint(hooks.hook) == fp  # new function objects, same behaviour: a hit

    write_losses(files, body="WEIGHT * abs(z).mean()")
    importlib.reload(losses)
    assert fingerprint(hooks.hook) != fp
    assert changed(reach, describe_reach(hooks.hook)) == {"penalty"}

    write_losses(files, extra="\ndef unused(z):\n    return -z\n")  # not read by the hook
    importlib.reload(losses)
    assert fingerprint(hooks.hook) == fp


def test_module_constant_read_as_attribute(files):
    write_losses(files)
    files.write("hooks_{tag}.py", HOOKS)
    losses, hooks = files.load("losses_{tag}"), files.load("hooks_{tag}")
    fp, reach = fingerprint(hooks.hook), describe_reach(hooks.hook)
    write_losses(files, scale=2.0)
    importlib.reload(losses)
    assert fingerprint(hooks.hook) != fp
    assert changed(reach, describe_reach(hooks.hook)) == {f"global:{losses.__name__}.SCALE"}


def test_module_constant_read_inside_the_module_function(files):
    write_losses(files)
    files.write("hooks_{tag}.py", HOOKS)
    losses, hooks = files.load("losses_{tag}"), files.load("hooks_{tag}")
    fp, reach = fingerprint(hooks.hook), describe_reach(hooks.hook)
    write_losses(files, weight=0.25)
    importlib.reload(losses)
    assert fingerprint(hooks.hook) != fp
    assert [
        k.rpartition(".")[2].rpartition(":")[2] for k in changed(reach, describe_reach(hooks.hook))
    ] == ["WEIGHT"]
    losses.WEIGHT = 0.5  # set back (a notebook assigning it): the same program again
    assert fingerprint(hooks.hook) == fp


def test_module_bound_to_a_global_in_a_notebook_cell(files):
    write_losses(files)
    losses = files.load("losses_{tag}")
    ns = load("def hook(x):\n    return L.penalty(x)\n")
    ns["L"] = losses  # `import losses as L` in another cell
    fp = fingerprint(ns["hook"])
    write_losses(files, body="2 * WEIGHT * (z ** 2).mean()")
    importlib.reload(losses)
    assert fingerprint(ns["hook"]) != fp


def test_from_package_import_module(files):
    files.write("pkg_{tag}/__init__.py", "")
    files.write("pkg_{tag}/mod.py", "def fn(x):\n    return x + {k}\n".replace("{k}", "1"))
    files.write(
        "hooks_{tag}.py",
        """
    from pkg_{tag} import mod

    def hook(x):
        return mod.fn(x)
    """,
    )
    mod, hooks = files.load("pkg_{tag}.mod"), files.load("hooks_{tag}")
    fp = fingerprint(hooks.hook)
    importlib.reload(mod)
    assert fingerprint(hooks.hook) == fp
    files.write("pkg_{tag}/mod.py", "def fn(x):\n    return x + 2\n")
    importlib.reload(mod)
    assert fingerprint(hooks.hook) != fp
    assert "fn" in describe_reach(hooks.hook)


def test_dotted_chain_through_a_package(files):
    files.write("pkg_{tag}/__init__.py", "")
    files.write("pkg_{tag}/sub.py", "FACTOR = 2\n\ndef fn(x):\n    return x * FACTOR\n")
    files.write(
        "hooks_{tag}.py",
        """
    import pkg_{tag}.sub

    def hook(x):
        return pkg_{tag}.sub.fn(x) + pkg_{tag}.sub.FACTOR
    """,
    )
    sub, hooks = files.load("pkg_{tag}.sub"), files.load("hooks_{tag}")
    fp = fingerprint(hooks.hook)
    files.write("pkg_{tag}/sub.py", "FACTOR = 2\n\ndef fn(x):\n    return x * FACTOR - 1\n")
    importlib.reload(sub)
    fp_fn = fingerprint(hooks.hook)
    assert fp_fn != fp
    sub.FACTOR = 3
    assert fingerprint(hooks.hook) != fp_fn


def test_module_in_a_closure_cell(files):
    write_losses(files)
    losses = files.load("losses_{tag}")

    def make(m):
        def hook(x):
            return m.penalty(x) * m.SCALE

        return hook

    fp = fingerprint(make(losses))
    losses.SCALE = 3.0
    fp_scale = fingerprint(make(losses))
    assert fp_scale != fp
    write_losses(files, scale=3.0, body="(z ** 2).sum()")
    importlib.reload(losses)
    assert fingerprint(make(losses)) != fp_scale


def test_module_helpers_use_the_same_depth_budget(files):
    files.write(
        "helpers_{tag}.py",
        """
    def a(x):
        return b(x)

    def b(x):
        return c(x)

    def c(x):
        return x + {k}
    """.replace("{k}", "1"),
    )
    helpers = files.load("helpers_{tag}")
    ns = load("def hook(x):\n    return H.a(x)\n")
    ns["H"] = helpers
    direct = load("def hook(x):\n    return a(x)\n")
    direct["a"] = helpers.a
    fps = {
        d: (fingerprint(ns["hook"], depth=d), fingerprint(direct["hook"], depth=d)) for d in (2, 3)
    }
    helpers.b = lambda x: x - 1  # a level-2 helper (hook -> a -> b): inside depth 2
    assert fingerprint(ns["hook"]) != fps[2][0]
    assert fingerprint(direct["hook"]) != fps[2][1]
    importlib.reload(helpers)  # back to the file
    assert (fingerprint(ns["hook"]), fingerprint(direct["hook"])) == fps[2]
    load("def c(x):\n    return x + 2\n", vars(helpers))  # level 3: by name at depth 2
    assert (fingerprint(ns["hook"]), fingerprint(direct["hook"])) == fps[2]
    assert fingerprint(ns["hook"], depth=3) != fps[3][0]
    assert fingerprint(direct["hook"], depth=3) != fps[3][1]


def test_library_module_attributes_stay_by_name():
    ns = load("""
    import json
    import os.path
    import numpy as np
    import jax.numpy as jnp

    def hook(x):
        return jnp.mean(np.sum(x)) + len(json.dumps(os.path.join("a", "b")))
    """)
    reach = describe_reach(ns["hook"])
    assert set(reach) == {"hook", "global:json", "global:os", "global:np", "global:jnp"}
    assert fingerprint(ns["hook"]) == fingerprint(
        load(
            textwrap.dedent("""
    import json
    import os.path
    import numpy as np
    import jax.numpy as jnp

    def hook(x):
        return jnp.mean(np.sum(x)) + len(json.dumps(os.path.join("a", "b")))
    """)
        )["hook"]
    )


def test_explanation_names_the_module_helper(files):
    write_losses(files)
    files.write("hooks_{tag}.py", HOOKS)
    losses, hooks = files.load("losses_{tag}"), files.load("hooks_{tag}")
    parts = KeyParts(
        kind="train",
        experiment="E",
        graph_consts=(),
        model=(),
        optimizer=(),
        hooks=(),
        helpers=(),
        inputs=(),
        split=None,
        options=(),
    )

    def keyed():
        own, reached = hook_parts({"loss": hooks.hook})
        return dataclasses.replace(parts, hooks=own, helpers=reached)

    old = keyed()
    write_losses(files, body="WEIGHT * abs(z).sum()")
    importlib.reload(losses)
    assert reasons(old, keyed()) == ["helper `penalty` (reached from hook `loss`) was edited"]


# -- user classes ------------------------------------------------------------------------

SCALER = """
class Scaler:
    FACTOR = 2.0

    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return self.apply(x) * self.FACTOR

    def apply(self, x):
        return x * self.k

    @staticmethod
    def clip(x):
        return x

    @property
    def offset(self):
        return 0.0


def hook(x):
    return Scaler(2.0)(x)
"""


@pytest.mark.parametrize(
    "edit",
    [
        ("return x * self.k", "return x * self.k * self.k"),  # a method the hook never names
        ("FACTOR = 2.0", "FACTOR = 3.0"),  # a class-level value
        ("return x\n", "return -x\n"),  # a staticmethod
        ("return 0.0", "return 1.0"),  # a property
        ("self.k = k", "self.k = 2 * k"),  # __init__
    ],
)
def test_instantiated_user_class_is_hashed_by_content(edit):
    ns = load(SCALER)
    fp, reach = fingerprint(ns["hook"]), describe_reach(ns["hook"])
    assert {"Scaler", "Scaler.__init__", "Scaler.__call__", "Scaler.apply"} <= reach.keys()
    load(SCALER, ns)  # the same cell re-run: the class is a new object, the same code
    assert fingerprint(ns["hook"]) == fp
    load(SCALER.replace(*edit), ns)  # the cell re-run, edited
    assert fingerprint(ns["hook"]) != fp
    assert len(changed(reach, describe_reach(ns["hook"]))) == 1


def test_method_patched_on_the_class_is_seen():
    ns = load(SCALER)
    fp = fingerprint(ns["hook"])
    ns["Scaler"].apply = lambda self, x: x - self.k
    assert fingerprint(ns["hook"]) != fp


def test_user_base_class_by_content_and_cycles_terminate():
    src = """
    class Base:
        def apply(self, x):
            return x * {k}

        @classmethod
        def make(cls):
            return Base()  # names its own class

    class Child(Base):
        def __call__(self, x):
            return super().apply(x) + Child.make().apply(x)

    def hook(x):
        return Child()(x)
    """
    ns = load(src.format(k=2))
    assert fingerprint(ns["hook"], depth=50) == fingerprint(ns["hook"], depth=50)
    assert fingerprint(ns["hook"]) == fingerprint(load(src.format(k=2))["hook"])
    assert fingerprint(ns["hook"]) != fingerprint(load(src.format(k=3))["hook"])


def test_parent_hook_call_hashes_that_method_only():
    # `Base.loss(self, ...)` in a subclass hook: Base.loss counts, Base's other methods don't.
    src = """
    class Base:
        def loss(self, x):
            return x * {k}

        def build_data(self):
            return {n}

    class Child(Base):
        def loss(self, x):
            return 3.0 * Base.loss(self, x)
    """
    fp = fingerprint(load(src.format(k=2, n=1))["Child"].loss)
    assert "Base.loss" in describe_reach(load(src.format(k=2, n=1))["Child"].loss)
    assert fingerprint(load(src.format(k=3, n=1))["Child"].loss) != fp
    assert fingerprint(load(src.format(k=2, n=5))["Child"].loss) == fp


def test_class_attribute_read_through_the_class():
    src = "class Cfg:\n    SCALE = {s}\n\ndef hook(x):\n    return x * Cfg.SCALE\n"
    fp = fingerprint(load(src.format(s=1.0))["hook"])
    assert fingerprint(load(src.format(s=1.0))["hook"]) == fp
    assert fingerprint(load(src.format(s=2.0))["hook"]) != fp
    assert "global:Cfg.SCALE" in describe_reach(load(src.format(s=1.0))["hook"])


def test_object_of_a_user_class_in_a_global():
    ns = load(SCALER + "\nSCALE_BY = Scaler(3.0)\n\ndef uses_object(x):\n    return SCALE_BY(x)\n")
    fp = fingerprint(ns["uses_object"])
    assert fingerprint(ns["uses_object"]) == fp
    ns["Scaler"].apply = lambda self, x: x + self.k  # same object, patched class
    assert fingerprint(ns["uses_object"]) != fp


def test_user_dataclass_redefinition():
    src = """
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        width: int = {w}
        acts: tuple = ("relu",)

    def hook(x):
        return x * Cfg().width
    """
    fp = fingerprint(load(src.format(w=4))["hook"])
    assert fingerprint(load(src.format(w=4))["hook"]) == fp
    assert fingerprint(load(src.format(w=8))["hook"]) != fp  # the default, in __init__


def test_user_nnx_module_by_content_library_bases_by_name():
    src = """
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(2, 2, rngs=rngs)

        def __call__(self, x):
            return self.lin(x) * {k}

    def hook(x):
        return Net(nnx.Rngs(0))(x) + nnx.Linear(2, 2, rngs=nnx.Rngs(0))(x)
    """
    ns = load(src.format(k=1))
    reach = describe_reach(ns["hook"])
    assert {"Net", "Net.__init__", "Net.__call__"} <= reach.keys()
    # flax's own classes (nnx.Module, nnx.Linear) by name: not one of their methods
    assert not [k for k in reach if k.startswith(("Module.", "Linear.", "Object.", "Pytree."))]
    assert fingerprint(load(src.format(k=1))["hook"]) == fingerprint(ns["hook"])
    assert fingerprint(load(src.format(k=2))["hook"]) != fingerprint(ns["hook"])


def test_user_class_in_a_module_file_is_user_code(files):
    files.write(
        "layers_{tag}.py",
        """
    class Head:
        def __call__(self, x):
            return x * 2
    """,
    )
    files.write(
        "hooks_{tag}.py",
        """
    import layers_{tag}

    def hook(x):
        return layers_{tag}.Head()(x)
    """,
    )
    layers, hooks = files.load("layers_{tag}"), files.load("hooks_{tag}")
    fp = fingerprint(hooks.hook)
    assert "Head.__call__" in describe_reach(hooks.hook)
    files.write(
        "layers_{tag}.py",
        """
    class Head:
        def __call__(self, x):
            return x * 3
    """,
    )
    importlib.reload(layers)
    assert fingerprint(hooks.hook) != fp


def test_user_dataclass_instance_in_a_global_includes_its_methods():
    ns = load("""
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Cfg:
        k: float = 2.0

        def scale(self, x):
            return x * self.k

    CFG = Cfg()

    def hook(x):
        return CFG.scale(x)
    """)
    fp = fingerprint(ns["hook"])
    ns["CFG"] = ns["Cfg"](k=2.0)  # an equal object: the same key
    assert fingerprint(ns["hook"]) == fp
    ns["Cfg"].scale = lambda self, x: x + self.k
    assert fingerprint(ns["hook"]) != fp


def test_super_call_hashes_the_parent_method_only():
    src = """
    class Base:
        def loss(self, x):
            return x * {k}

        def build_data(self):
            return {n}

    class Child(Base):
        def loss(self, x):
            return 3.0 * super().loss(x)

        def stored(self, x):
            s = super()  # not followed by an attribute: the whole class counts
            return s.loss(x)
    """
    fp = fingerprint(load(src.format(k=2, n=1))["Child"].loss)
    assert "Base.loss" in describe_reach(load(src.format(k=2, n=1))["Child"].loss)
    assert fingerprint(load(src.format(k=2, n=1))["Child"].loss) == fp
    assert fingerprint(load(src.format(k=3, n=1))["Child"].loss) != fp
    assert fingerprint(load(src.format(k=2, n=5))["Child"].loss) == fp  # an unrelated edit
    stored = fingerprint(load(src.format(k=2, n=1))["Child"].stored)
    assert fingerprint(load(src.format(k=3, n=1))["Child"].stored) != stored
