"""Compile discipline II: edits that must never reach a stale program.

Each scenario edits code the way a notebook user or a library author does (a helper module
reloaded, a constant reassigned, a method replaced on the class, IPython's `__code__` swap, a
class cell re-run, a decorator re-bound, a custom gradient rule edited) and checks both that
the compiled program now runs the new code (its output against the current code run
eagerly on the same parameters) and how many programs compiled, and what the explanation says.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
import types
import warnings

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, make_data, nitro
from flax import nnx

import jaxnitro as jn


@pytest.fixture(autouse=True)
def fresh_cache():
    jn.cache_reset()
    yield


def misses() -> int:
    return jn.cache_stats()["misses"]


def reasons(n) -> str:
    return " | ".join(r for row in jn.explain(n) for r in row["reasons"])


X, _ = make_data(16)


def handle(cls, run_dir, **fields):
    return jn.Nitro(cls(n_val=0, max_epochs=1, **fields), run_dir=run_dir, progress="off")


def predict_matches_eager(n) -> np.ndarray:
    """jn.predict's output, checked against the current code run eagerly."""
    got = np.asarray(jn.predict(n, {"x": X}))
    ref, _ = jn.apply(n.model, n.params, n.state, jnp.asarray(X))
    np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-5, atol=1e-5)
    return got


def _module(tmp_path, name: str, source: str) -> types.ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    return importlib.import_module(name)


def _reload(module: types.ModuleType, source: str) -> None:
    path = module.__file__
    with open(path, "w") as f:
        f.write(textwrap.dedent(source))
    importlib.invalidate_caches()
    sys.dont_write_bytecode = True
    try:
        importlib.reload(module)
    finally:
        sys.dont_write_bytecode = False


# -- 1. code the model reaches, for NNX, Linen and Equinox --------------------------------

HELPER = """
    import jax

    def act(x):
        return jax.nn.relu(x){extra}
"""

MODELS = """
    import equinox as eqx
    import flax.linen as linen
    import jax
    from flax import nnx

    import {helper} as helper

    SHIFT = 0.0


    class NnxNet(nnx.Module):
        def __init__(self, rngs):
            self.lin = nnx.Linear(8, 4, rngs=rngs)

        def __call__(self, x):
            return helper.act(self.lin(x)) + SHIFT


    class LinenNet(linen.Module):
        @linen.compact
        def __call__(self, x):
            return helper.act(linen.Dense(4)(x)) + SHIFT


    class EqxNet(eqx.Module):
        lin: eqx.nn.Linear

        def __init__(self, key):
            self.lin = eqx.nn.Linear(8, 4, key=key)

        def __call__(self, x):
            return helper.act(self.lin(x)) + SHIFT
"""


def _models(tmp_path, tag: str):
    helper = _module(tmp_path, f"cd_helper_{tag}", HELPER.format(extra=""))
    mods = _module(tmp_path, f"cd_models_{tag}", MODELS.format(helper=helper.__name__))
    return helper, mods


def _experiment(mods, kind: str):
    @jn.experiment
    class Uses(Tiny):
        def build_model(self, rng):
            if kind == "nnx":
                return jn.split_model(mods.NnxNet(nnx.Rngs(rng)))
            if kind == "linen":
                return jn.split_model(mods.LinenNet(), rng, jnp.zeros((1, 8)))
            return jn.split_model(mods.EqxNet(rng))

    return Uses


def _net(mods, kind: str):
    return {"nnx": mods.NnxNet, "linen": mods.LinenNet, "eqx": mods.EqxNet}[kind]


KINDS = ["nnx", "linen", "eqx"]


@pytest.mark.slow
@pytest.mark.no_suite_cache
@pytest.mark.parametrize("kind", KINDS)
def test_a_helper_module_the_model_calls_edited_and_reloaded(tmp_path, kind):
    helper, mods = _models(tmp_path, f"h{kind}")
    n = handle(_experiment(mods, kind), tmp_path / "a")
    before = predict_matches_eager(n)
    compiled = misses()
    _reload(helper, HELPER.format(extra=" + 5.0"))
    with pytest.warns(UserWarning, match=f"the model class `{_net(mods, kind).__name__}`"):
        after = predict_matches_eager(n)  # the live handle: new code, one new program
    np.testing.assert_allclose(after, before + 5.0, rtol=1e-5, atol=1e-5)
    assert misses() == compiled + 1
    why = reasons(n)
    assert "the model's code changed: helper `act`" in why, why
    assert f"class `{_net(mods, kind).__name__}`" in why, why
    assert "model structure changed" not in why, why
    # a new handle trains with the new helper too (a loss that sees the shift)
    n2 = handle(_experiment(mods, kind), tmp_path / "b")
    assert jn.train(n2).programs_compiled == 1


@pytest.mark.parametrize("kind", KINDS)
def test_a_module_constant_the_model_reads_reassigned(tmp_path, kind):
    _, mods = _models(tmp_path, f"c{kind}")
    n = handle(_experiment(mods, kind), tmp_path / "a")
    before = predict_matches_eager(n)
    mods.SHIFT = 2.5
    with pytest.warns(UserWarning, match="changed since this Nitro compiled"):
        after = predict_matches_eager(n)
    np.testing.assert_allclose(after, before + 2.5, rtol=1e-5, atol=1e-5)
    assert "module-level value `SHIFT`" in reasons(n)


@pytest.mark.parametrize("kind", KINDS)
def test_a_method_replaced_on_the_model_class(tmp_path, kind):
    _, mods = _models(tmp_path, f"m{kind}")
    net = _net(mods, kind)
    n = handle(_experiment(mods, kind), tmp_path / "a")
    before = predict_matches_eager(n)
    original = net.__call__
    if kind == "linen":

        @linen.compact
        def call(self, x):
            return original(self, x) * 3.0

    else:

        def call(self, x):
            return original(self, x) * 3.0

    net.__call__ = call
    try:
        with pytest.warns(UserWarning, match=f"the model class `{net.__name__}`"):
            after = predict_matches_eager(n)
    finally:
        net.__call__ = original
    np.testing.assert_allclose(after, before * 3.0, rtol=1e-5, atol=1e-5)
    assert f"`{net.__name__}.__call__` was replaced" in reasons(n), reasons(n)


def test_an_autoreload_code_swap_of_the_model_method(tmp_path):
    """IPython's `%autoreload 2` swaps `__code__` on the function object in place."""
    _, mods = _models(tmp_path, "swap")
    n = handle(_experiment(mods, "nnx"), tmp_path / "a")
    before = predict_matches_eager(n)
    ns: dict = {}
    exec(
        "def __call__(self, x):\n    return helper.act(self.lin(x)) + SHIFT - 1.0\n",
        vars(mods),
        ns,
    )
    fn = mods.NnxNet.__dict__["__call__"]
    old_code = fn.__code__
    fn.__code__ = ns["__call__"].__code__
    try:
        with pytest.warns(UserWarning, match="the model class `NnxNet`"):
            after = predict_matches_eager(n)
    finally:
        fn.__code__ = old_code
    np.testing.assert_allclose(after, before - 1.0, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_an_unchanged_model_compiles_nothing_again(tmp_path):
    """The model's code in the key costs no recompile when nothing changed: a second handle,
    and a model module reloaded as it was."""
    helper, mods = _models(tmp_path, "same")
    assert jn.train(handle(_experiment(mods, "nnx"), tmp_path / "a")).programs_compiled == 1
    assert jn.train(handle(_experiment(mods, "nnx"), tmp_path / "b")).programs_compiled == 0
    _reload(helper, HELPER.format(extra=""))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jn.train(handle(_experiment(mods, "nnx"), tmp_path / "c")).programs_compiled == 0


# -- 2. class-level values of the experiment read as self.X -------------------------------

CELL = """
import jax.numpy as jnp
import optax
import jaxnitro as jn
from conftest import Tiny

@jn.experiment
class Scaled(Tiny):
    SCALE = {scale}
    act = staticmethod({act})

    def loss(self, logits, *, y):
        ce = optax.softmax_cross_entropy_with_integer_labels(self.act(logits), y).mean()
        return ce * 0.0 + self.SCALE * jnp.mean(self.act(logits * 0.0 + 1.0))
"""


def _cell(module: types.ModuleType, **values) -> type:
    exec(compile(CELL.format(**values), "<cell>", "exec"), vars(module))
    return module.Scaled


@pytest.fixture
def notebook():
    """A stand-in for a notebook's `__main__`: a module whose cells are exec'd into it."""
    module = types.ModuleType("cd_notebook")
    sys.modules[module.__name__] = module
    yield module
    sys.modules.pop(module.__name__, None)


@pytest.mark.parametrize(
    "first, second, expected",
    [
        ({"scale": 1.3, "act": "jnp.tanh"}, {"scale": 0.47, "act": "jnp.tanh"}, 0.47 * np.tanh(1)),
        ({"scale": 1.0, "act": "jnp.tanh"}, {"scale": 1.0, "act": "jnp.sin"}, np.sin(1.0)),
    ],
)
@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_a_class_value_read_through_self_changed_by_a_cell_re_run(
    tmp_path, notebook, first, second, expected
):
    jn.train(handle(_cell(notebook, **first), tmp_path / "a"))
    n = handle(_cell(notebook, **second), tmp_path / "b")
    result = jn.train(n)
    assert result.programs_compiled == 1
    assert result.history[-1]["train_loss"] == pytest.approx(expected, rel=1e-5)
    name = "SCALE" if first["scale"] != second["scale"] else "act"
    assert f"class attribute `{name}` of the experiment (read as `self.{name}`) changed" in (
        reasons(n)
    )


@pytest.mark.slow
def test_a_class_cell_re_run_unchanged_compiles_nothing(tmp_path, notebook):
    jn.train(handle(_cell(notebook, scale=1.3, act="jnp.tanh"), tmp_path / "a"))
    n = handle(_cell(notebook, scale=1.3, act="jnp.tanh"), tmp_path / "b")
    assert jn.train(n).programs_compiled == 0


# -- 3. wrappers and custom rules ----------------------------------------------------------


class Scale:
    """A decorator written as a class: its parameter lives on the instance."""

    def __init__(self, factor):
        self.factor = factor

    def __call__(self, fn):
        outer = self

        class Wrapped:
            def __init__(self):
                __import__("functools").update_wrapper(self, fn)
                self.factor = outer.factor

            def __call__(self, *args, **kwargs):
                return fn(*args, **kwargs) * self.factor

        return Wrapped()


def _plain_ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_a_class_decorator_re_bound_with_a_new_parameter(tmp_path):
    g = globals()
    g["scaled_ce"] = Scale(2.0)(_plain_ce)

    @jn.experiment
    class Wrapped(Tiny):
        def loss(self, logits, *, y):
            return scaled_ce(logits, y) * 0.0 + scaled_ce(logits * 0.0, y)  # noqa: F821

    try:
        first = jn.train(handle(Wrapped, tmp_path / "a")).history[-1]["train_loss"]
        g["scaled_ce"] = Scale(5.0)(_plain_ce)
        n = handle(Wrapped, tmp_path / "b")
        result = jn.train(n)
    finally:
        g.pop("scaled_ce", None)
    assert result.programs_compiled == 1
    assert result.history[-1]["train_loss"] == pytest.approx(first * 2.5, rel=1e-5)
    assert "wrapper `_plain_ce` (reached from hook `loss`) changed" in reasons(n), reasons(n)


def _grad_of_loss(n) -> np.ndarray:
    """The parameter change of one training step, which follows the gradient rule."""
    before = jax.tree.map(np.asarray, n.params)
    jn.train(n)
    after = jax.tree.map(np.asarray, n.params)
    return np.concatenate(
        [
            np.ravel(a - b)
            for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before), strict=True)
        ]
    )


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["custom_jvp", "custom_vjp"])
def test_an_edited_custom_gradient_rule(tmp_path, rule):
    g = globals()

    def build(factor: float):
        if rule == "custom_jvp":

            @jax.custom_jvp
            def through(x):
                return x

            @through.defjvp
            def through_jvp(primals, tangents):
                return primals[0], tangents[0] * factor

        else:

            @jax.custom_vjp
            def through(x):
                return x

            def fwd(x):
                return x, None

            def bwd(_, ct):
                return (ct * factor,)

            through.defvjp(fwd, bwd)
        return through

    @jn.experiment
    class Ruled(Tiny):
        n_train: int = 32

        def learning_rate(self, group):
            return 0.0 if group == "none" else 1e-2

        def optimizer(self, group):
            return optax.sgd

        def loss(self, logits, *, y):
            return _plain_ce(through(logits), y)  # noqa: F821

    try:
        g["through"] = build(1.0)
        step1 = _grad_of_loss(handle(Ruled, tmp_path / "a"))
        g["through"] = build(0.0)  # the rule edited: no gradient flows through it
        n = handle(Ruled, tmp_path / "b")
        step2 = _grad_of_loss(n)
    finally:
        g.pop("through", None)
    assert np.abs(step1).max() > 0
    np.testing.assert_array_equal(step2, 0.0)
    assert "through" in reasons(n) or "closure variable `factor`" in reasons(n), reasons(n)


# -- 4. a class re-defined in a notebook, and the old handle -----------------------------


@pytest.mark.slow
def test_an_old_handle_of_a_re_defined_class_says_so_once(tmp_path, notebook):
    old_cls = _cell(notebook, scale=1.0, act="jnp.tanh")
    n = handle(old_cls, tmp_path / "a")
    jn.train(n)
    _cell(notebook, scale=2.0, act="jnp.tanh")  # the edited cell re-run
    with pytest.warns(UserWarning, match=r"`Scaled` was re-defined in `cd_notebook`.*resume"):
        jn.predict(n, {"x": X})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        jn.predict(n, {"x": X})


@pytest.mark.slow
def test_a_class_bound_as_before_says_nothing(tmp_path, notebook):
    n = handle(_cell(notebook, scale=1.0, act="jnp.tanh"), tmp_path / "a")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jn.train(n)
        jn.predict(n, {"x": X})


# -- 6, 7. explanations kept after a drop, and for a copy --------------------------------


@pytest.mark.slow
def test_a_recompile_after_a_drop_is_explained_for_the_handle_and_a_new_one(tmp_path):
    @jn.experiment
    class Live(Tiny):
        def loss(self, logits, *, y):
            return _plain_ce(logits, y)

    n = jn.Nitro(Live(max_epochs=1), run_dir=tmp_path / "a", progress="off")
    jn.train(n)

    def loss(self, logits, *, y):
        return _plain_ce(logits, y) * 2.0

    Live.loss = loss
    with pytest.warns(UserWarning, match="`loss` changed"):
        jn.validate(n)  # the eval program was dropped as stale: what replaced it is explained
    assert "hook `loss` was edited" in reasons(n)

    def loss3(self, logits, *, y):
        return _plain_ce(logits, y) * 3.0

    Live.loss = loss3
    n2 = handle(Live, tmp_path / "b")
    jn.train(n2)
    assert "hook `loss` was edited" in reasons(n2)


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_a_copied_experiment_edited_later_is_explained(tmp_path):
    @jn.experiment
    class Original(Tiny):
        def loss(self, logits, *, y):
            return _plain_ce(logits, y)

    @jn.experiment
    class Copy(Tiny):
        def loss(self, logits, *, y):
            return _plain_ce(logits, y)

    jn.train(handle(Original, tmp_path / "a"))
    assert jn.train(handle(Copy, tmp_path / "b")).programs_compiled == 0  # shared by text

    def loss(self, logits, *, y):
        return _plain_ce(logits, y) + 1.0

    Copy.loss = loss
    n = handle(Copy, tmp_path / "c")
    assert jn.train(n).programs_compiled == 1
    assert "hook `loss` was edited" in reasons(n)


@pytest.mark.slow
def test_live_nitro_warns_once_when_a_hook_is_edited(run_dir):
    @jn.experiment
    class Live(Tiny):
        pass

    n = nitro(Live(max_epochs=1, n_val=0), run_dir=run_dir)
    jn.train(n)
    misses = jn.cache_stats()["misses"]

    def loss(self, logits, *, y):
        return 3.0 * Tiny.loss(self, logits, y=y)

    Live.loss = loss
    n.max_epochs = 2
    with pytest.warns(UserWarning, match=r"`loss` changed since this Nitro compiled"):
        jn.train(n)
    assert jn.cache_stats()["misses"] == misses + 1


@pytest.mark.slow
def test_helper_method_edit_is_seen(run_dir):
    @jn.experiment
    class WithHelper(Tiny):
        def scale(self):
            return 1.0

        def loss(self, logits, *, y):
            return self.scale() * Tiny.loss(self, logits, y=y)

    jn.train(nitro(WithHelper(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    misses = jn.cache_stats()["misses"]
    WithHelper.scale = lambda self: 2.0
    n = nitro(WithHelper(max_epochs=1, n_val=0), run_dir=run_dir / "b")
    jn.train(n)
    assert jn.cache_stats()["misses"] == misses + 1


MODULE = """
import jax, optax
import jaxnitro as jn
from conftest import Tiny

SCALE = {scale}

def penalty(logits):
    return {penalty} * (logits ** 2).mean()

@jn.experiment
class Reloadable(Tiny):
    def loss(self, logits, *, y):
        return SCALE * Tiny.loss(self, logits, y=y) + penalty(logits)
"""


@pytest.mark.slow
@pytest.mark.parametrize("edit", ["helper", "constant", "unchanged"])
def test_reload_of_an_edited_module(tmp_path, run_dir, monkeypatch, edit):
    name = f"reloadable_{edit}"
    path = tmp_path / f"{name}.py"
    path.write_text(MODULE.format(scale=1.0, penalty=0.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module(name)
    jn.train(nitro(mod.Reloadable(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    misses = jn.cache_stats()["misses"]
    if edit == "helper":
        path.write_text(MODULE.format(scale=1.0, penalty=0.5))
    elif edit == "constant":
        path.write_text(MODULE.format(scale=2.0, penalty=0.0))
    else:
        path.write_text(MODULE.format(scale=1.0, penalty=0.0) + "\n\n# a comment\n")
    os.utime(path, (0, 1e9 + 10))  # a new mtime, whatever the clock resolution
    mod = importlib.reload(mod)
    n = nitro(mod.Reloadable(max_epochs=1, n_val=0), run_dir=run_dir / "b")
    jn.train(n)
    assert jn.cache_stats()["misses"] == misses + (0 if edit == "unchanged" else 1)
    if edit == "helper":
        assert any("penalty" in r for w in jn.explain(n) for r in w["reasons"])


@pytest.mark.slow
def test_mutated_global_array_is_seen_by_the_trace(run_dir):
    """Once a documented hole: an array mutated in place inside a module imported in the
    hook's body is invisible to the key, but the trace of the current code differs from the
    cached program's, so the new code compiles (and the reason says the key could not see it)."""
    import conftest

    conftest.TABLE = {"w": np.ones(4, np.float32)}

    @jn.experiment
    class Hole(Tiny):
        def loss(self, logits, *, y):
            import conftest as c

            return (jnp.asarray(c.TABLE["w"]) * logits).mean() + Tiny.loss(self, logits, y=y)

    jn.train(nitro(Hole(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    misses = jn.cache_stats()["misses"]
    conftest.TABLE["w"][:] = 5.0  # in place, inside a module attribute: invisible to the key
    n = nitro(Hole(max_epochs=1, n_val=0), run_dir=run_dir / "b")
    jn.train(n)
    assert jn.cache_stats()["misses"] == misses + 1
    assert "traced program changed though nothing in its key did" in reasons(n)
    jn.train(nitro(Hole(max_epochs=1, n_val=0), run_dir=run_dir / "c"))
    assert jn.cache_stats()["misses"] == misses + 1  # the same again: the new program is kept
