"""Compile discipline III: the edits of issue 40, each once reaching a stale program.

Each test edits what a notebook user, a multi-file project or a library author edits
(partials as hooks, GraphConst callables and configs, functions a model holds, JAX's config,
the environment, a content-hashed GraphConst mutated in place, a Device field read by the
learning-rate hook, a docstring) and checks the compiled result against the current code run
eagerly, the number of programs compiled, and what the explanation says.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
import textwrap
import warnings
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, make_data
from flax import nnx

import jaxnitro as jn
from jaxnitro._src.optim import hyper


@pytest.fixture(autouse=True)
def fresh_cache():
    jn.cache_reset()
    yield


def misses() -> int:
    return jn.cache_stats()["misses"]


def reasons(n) -> str:
    return " | ".join(r for row in jn.explain(n) for r in row["reasons"])


X, _ = make_data(16)


def handle(exp, run_dir):
    return jn.Nitro(exp, run_dir=run_dir, progress="off")


def eager(n, fn=None) -> np.ndarray:
    out, _ = jn.apply(n.model, n.params, n.state, jnp.asarray(X))
    return np.asarray(out if fn is None else fn(out))


def predicted(n) -> np.ndarray:
    return np.asarray(jn.predict(n, {"x": X}))


def module(tmp_path, name: str, source: str):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    return importlib.import_module(name)


# -- 1. hooks written as functools.partial / partialmethod -----------------------------------


def scaled_forward(self, model, params, state, *, x, k):
    out, state = jn.apply(model, params, state, x)
    return out * k, state


@pytest.mark.slow
def test_1_partialmethod_hook_arguments_are_in_the_key(tmp_path):
    @jn.experiment
    class Partial(Tiny):
        forward = functools.partialmethod(scaled_forward, k=1.0)

    n = handle(Partial(n_val=0), tmp_path / "a")
    np.testing.assert_allclose(predicted(n), eager(n), rtol=1e-5, atol=1e-5)
    Partial.forward = functools.partialmethod(scaled_forward, k=0.3)
    with pytest.warns(UserWarning, match="changed since this Nitro compiled"):
        got = predicted(n)
    np.testing.assert_allclose(got, eager(n, lambda o: o * 0.3), rtol=1e-5, atol=1e-5)
    fresh = handle(Partial(n_val=0), tmp_path / "b")
    np.testing.assert_allclose(predicted(fresh), eager(fresh, lambda o: o * 0.3), rtol=1e-5)


# -- 2. GraphConst values by content: a callable's globals, a config's methods ---------------

ACT = """
    import jax.numpy as jnp

    GAIN = 1.0

    def act(x):
        return GAIN * jnp.tanh(x)
"""


def test_2_graphconst_callable_whose_module_global_changes(tmp_path):
    mod = module(tmp_path, "gc_act_mod", ACT)

    @jn.experiment
    class WithAct(Tiny):
        act: jn.GraphConst[Callable] = mod.act

        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            return self.act(out), state

    n = handle(WithAct(n_val=0), tmp_path / "a")
    np.testing.assert_allclose(predicted(n), eager(n, mod.act), rtol=1e-5, atol=1e-5)
    compiled = misses()
    mod.GAIN = 2.5
    got = predicted(n)  # the live handle
    np.testing.assert_allclose(got, eager(n, mod.act), rtol=1e-5, atol=1e-5)
    assert misses() == compiled + 1
    assert "GraphConst `act` changed" in reasons(n)
    fresh = handle(WithAct(n_val=0), tmp_path / "b")
    np.testing.assert_allclose(predicted(fresh), eager(fresh, mod.act), rtol=1e-5, atol=1e-5)


@dataclasses.dataclass(frozen=True)
class Cfg:
    gain: float = 1.0

    def scale(self, x):
        return self.gain * x


def test_2_frozen_config_whose_method_is_edited(tmp_path, monkeypatch):
    @jn.experiment
    class WithCfg(Tiny):
        cfg: jn.GraphConst[Cfg] = Cfg()

        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            return self.cfg.scale(out), state

    n = handle(WithCfg(n_val=0), tmp_path / "a")
    np.testing.assert_allclose(predicted(n), eager(n), rtol=1e-5, atol=1e-5)
    monkeypatch.setattr(Cfg, "scale", lambda self, x: self.gain * x - 1.0)  # %autoreload
    np.testing.assert_allclose(predicted(n), eager(n, lambda o: o - 1.0), rtol=1e-5, atol=1e-5)
    fresh = handle(WithCfg(n_val=0), tmp_path / "b")
    np.testing.assert_allclose(predicted(fresh), eager(fresh, lambda o: o - 1.0), rtol=1e-5)


# -- 3. a function stored on a model instance ---------------------------------------------

HELD = """
    import flax.linen as linen
    import jax.numpy as jnp
    from flax import nnx

    SHIFT = 0.0

    def act(x):
        return jnp.tanh(x) + SHIFT

    class NnxHeld(nnx.Module):
        def __init__(self, act, rngs):
            self.lin = nnx.Linear(8, 4, rngs=rngs)
            self.act = act

        def __call__(self, x):
            return self.act(self.lin(x))

    class LinenHeld(linen.Module):
        act: object

        @linen.compact
        def __call__(self, x):
            return self.act(linen.Dense(4)(x))
"""


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nnx", "linen"])
def test_3_function_held_by_the_model_is_fingerprinted(tmp_path, kind):
    mod = module(tmp_path, f"held_{kind}", HELD)

    @jn.experiment
    class Held(Tiny):
        def build_model(self, rng):
            if kind == "nnx":
                return jn.split_model(mod.NnxHeld(mod.act, nnx.Rngs(rng)))
            return jn.split_model(mod.LinenHeld(mod.act), rng, jnp.zeros((1, 8)))

    n = handle(Held(n_val=0), tmp_path / "a")
    before = predicted(n)
    np.testing.assert_allclose(before, eager(n), rtol=1e-5, atol=1e-5)
    mod.SHIFT = 3.0
    with pytest.warns(UserWarning, match="`SHIFT`"):
        got = predicted(n)
    np.testing.assert_allclose(got, before + 3.0, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, eager(n), rtol=1e-5, atol=1e-5)
    assert "module-level value `SHIFT`" in reasons(n)


# -- 4. jax.config ----------------------------------------------------------------------------


@pytest.fixture
def jax_config():
    """Set JAX flags in a test; every flag set is put back afterwards."""
    saved = {}

    def update(name, value):
        saved.setdefault(name, getattr(jax.config, name))
        jax.config.update(name, value)

    yield update
    for name, value in saved.items():
        jax.config.update(name, value)


@jn.experiment
class Promote(Tiny):
    def forward(self, model, params, state, *, x):
        out, state = jn.apply(model, params, state, x)
        return out + jnp.ones(4, dtype=float), state  # float64 under x64; rank-promoting add


@pytest.mark.slow
def test_4_jax_config_x64_and_rank_promotion(tmp_path, jax_config):
    n = handle(Promote(n_val=0), tmp_path / "a")
    assert predicted(n).dtype == np.float32
    jax_config("jax_numpy_rank_promotion", "raise")
    with pytest.raises(ValueError, match="jax_numpy_rank_promotion='raise'"):
        predicted(n)  # eager code raises; so must the live handle's program
    jax_config("jax_numpy_rank_promotion", "allow")
    jax_config("jax_enable_x64", True)
    got = predicted(n)
    want = eager(n, lambda o: o + jnp.ones(4, dtype=float))
    assert got.dtype == want.dtype == np.float64
    fresh = handle(Promote(n_val=0), tmp_path / "b")
    assert predicted(fresh).dtype == np.float64


@jn.experiment
class Wide(Tiny):
    def build_model(self, rng):  # parameters in the default float type: 64 bits under x64
        return jn.split_model(nnx.Linear(8, 4, param_dtype=float, rngs=nnx.Rngs(rng)))


@pytest.mark.slow
def test_9_x64_is_explained_as_the_flag_and_the_parameters_dtype(tmp_path, jax_config):
    jn.train(handle(Wide(max_epochs=1, n_val=0), tmp_path / "a"))
    jax_config("jax_enable_x64", True)
    fresh = handle(Wide(max_epochs=1, n_val=0), tmp_path / "b")
    assert fresh.params["kernel"].dtype == jnp.float64
    jn.train(fresh)
    why = reasons(fresh)
    assert "jax config `jax_enable_x64` False → True" in why, why
    assert "float32 → float64" in why, why  # the parameters, now built in 64 bits
    assert "an input sharding or the mesh changed" not in why, why


# -- 5. a value read from os.environ while tracing ------------------------------------------


@jn.experiment
class FromEnv(Tiny):
    def forward(self, model, params, state, *, x):
        out, state = jn.apply(model, params, state, x)
        return out * float(os.environ.get("JN_TEST_GAIN", "1")), state


def test_5_environment_read_at_trace_time(tmp_path, monkeypatch):
    monkeypatch.setenv("JN_TEST_GAIN", "1")
    n = handle(FromEnv(n_val=0), tmp_path / "a")
    np.testing.assert_allclose(predicted(n), eager(n), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("JN_TEST_GAIN", "4")
    np.testing.assert_allclose(predicted(n), eager(n, lambda o: o * 4), rtol=1e-5, atol=1e-5)
    assert "environment variable `JN_TEST_GAIN` '1' → '4'" in reasons(n)
    compiled = misses()
    monkeypatch.setenv("JN_TEST_UNRELATED", "x")  # not read while tracing: nothing compiles
    np.testing.assert_allclose(predicted(n), eager(n, lambda o: o * 4), rtol=1e-5, atol=1e-5)
    jn.validate(handle(FromEnv(), tmp_path / "b"))
    assert misses() == compiled + 1  # the new handle's eval program only


# -- 6. a content-hashed GraphConst mutated in place ----------------------------------------


@dataclasses.dataclass(unsafe_hash=True)
class Inner:
    gain: float = 1.0


@dataclasses.dataclass(unsafe_hash=True)
class Outer:
    inner: Inner = dataclasses.field(default_factory=Inner)


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_6_mutated_graphconst_never_poisons_the_cache(tmp_path):
    @jn.experiment
    class Mutable(Tiny):
        cfg: jn.GraphConst[Outer] = dataclasses.field(default_factory=Outer)

        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            return out * self.cfg.inner.gain, state

    exp = Mutable(n_val=0)
    n = handle(exp, tmp_path / "a")
    jn.train(n)
    np.testing.assert_allclose(predicted(n), eager(n), rtol=1e-5, atol=1e-5)
    exp.cfg.inner.gain = 2.0  # in place, after training
    n2 = handle(exp, tmp_path / "b")
    np.testing.assert_allclose(predicted(n2), eager(n2, lambda o: o * 2.0), rtol=1e-5)
    assert "GraphConst `cfg` changed" in reasons(n2)
    np.testing.assert_allclose(predicted(n), eager(n, lambda o: o * 2.0), rtol=1e-5, atol=1e-5)
    # and an unrelated experiment still compiles
    assert jn.train(handle(Tiny(max_epochs=1, n_val=0), tmp_path / "c")).programs_compiled >= 1


# -- 7. a Device field read only by the learning_rate hook ----------------------------------


@jn.experiment
class LiveRate(Tiny):
    lr: jn.Device[float] = 0.001
    max_epochs: int = 1

    def learning_rate(self, group):
        return self.lr


def _rate(n) -> float:
    return float(hyper.read(n.spec.optimizer, n.train_state.opt_state)["opt.default.learning_rate"])


@pytest.mark.slow
def test_7_set_device_reaches_the_learning_rate_without_a_recompile(tmp_path):
    n = handle(LiveRate(n_val=0), tmp_path / "a")
    jn.train(n)
    assert _rate(n) == pytest.approx(0.001)
    compiled = misses()
    jn.set_device(n, lr=0.05)
    n.max_epochs = 2
    jn.train(n)
    assert _rate(n) == pytest.approx(0.05)
    assert misses() == compiled


@jn.experiment
class FrozenGroup(Tiny):
    lr: jn.Device[float] = 0.0
    max_epochs: int = 1

    def param_group(self, path, leaf):
        return "head" if path.startswith("out") else "body"

    def learning_rate(self, group):
        return self.lr if group == "head" else 1e-3


def test_7_a_rate_that_needs_another_optimizer_is_refused_with_the_reason(tmp_path):
    n = handle(FrozenGroup(n_val=0), tmp_path / "a")
    with pytest.raises(jn.ConfigError, match=r"learning_rate\('head'\).*frozen"):
        jn.set_device(n, lr=0.1)


# -- 8. a docstring-only edit ---------------------------------------------------------------


def _swap_code(target, source) -> None:
    """What IPython's `%autoreload 2` does to an edited function: its code, swapped in place."""
    target.__code__ = source.__code__.replace(co_qualname=target.__code__.co_qualname)


def test_8_docstring_edit_compiles_nothing(tmp_path):
    @jn.experiment
    class Doc(Tiny):
        def forward(self, model, params, state, *, x):
            return jn.apply(model, params, state, x)

    n = handle(Doc(), tmp_path / "a")
    jn.validate(n)
    predicted(n)
    compiled = misses()

    def forward(self, model, params, state, *, x):
        """Now documented."""
        return jn.apply(model, params, state, x)

    _swap_code(Doc.forward, forward)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stale: no warning either
        jn.validate(n)
        predicted(n)
    assert misses() == compiled

    def forward2(self, model, params, state, *, x):
        renamed = jn.apply(model, params, state, x)  # another key, the same program
        return renamed

    _swap_code(Doc.forward, forward2)
    with pytest.warns(UserWarning, match="changed since this Nitro compiled"):
        jn.validate(n)
    predicted(n)
    assert misses() == compiled  # found by its program text: no compile


# -- 9. explanations name the real change ---------------------------------------------------

EQX = """
    import equinox as eqx
    import jax.numpy as jnp

    GAIN = 1.0

    def act(x):
        return GAIN * jnp.tanh(x)

    class EqxAct(eqx.Module):
        lin: eqx.nn.Linear
        act: object

        def __init__(self, key):
            self.lin = eqx.nn.Linear(8, 4, key=key)
            self.act = act

        def __call__(self, x):
            return self.act(self.lin(x))
"""


@pytest.mark.slow
def test_9_equinox_activation_global_is_named_not_called_a_structure_change(tmp_path):
    mod = module(tmp_path, "eqx_act_mod", EQX)

    @jn.experiment
    class EqxExp(Tiny):
        def build_model(self, rng):
            return jn.split_model(mod.EqxAct(rng))

    n = handle(EqxExp(n_val=0), tmp_path / "a")
    np.testing.assert_allclose(predicted(n), eager(n), rtol=1e-5, atol=1e-5)
    mod.GAIN = 2.0
    fresh = handle(EqxExp(n_val=0), tmp_path / "b")
    np.testing.assert_allclose(predicted(fresh), eager(fresh), rtol=1e-5, atol=1e-5)
    why = reasons(fresh)
    assert "module-level value `GAIN`" in why, why
    assert "model structure changed" not in why, why
    assert isinstance(mod.EqxAct, type) and issubclass(mod.EqxAct, eqx.Module)


PENALTY = """
    SCALE = 1.0

    def penalty(logits):
        return SCALE * (logits ** 2).mean()
"""


def test_9_live_warning_names_the_helper_not_the_hook(tmp_path):
    mod = module(tmp_path, "penalty_mod", PENALTY)

    @jn.experiment
    class Pen(Tiny):
        def loss(self, logits, *, y):
            return Tiny.loss(self, logits, y=y) + mod.penalty(logits)

    n = handle(Pen(max_epochs=1), tmp_path / "a")
    jn.validate(n)
    mod.SCALE = 2.0
    with pytest.warns(UserWarning) as seen:
        jn.validate(n)
    text = " ".join(str(w.message) for w in seen)
    assert "module-level value `penalty_mod.SCALE`" in text or "`SCALE`" in text, text
    assert "`loss` changed" not in text, text


# -- the check itself -----------------------------------------------------------------------


@pytest.mark.slow
def test_a_program_with_a_host_callback_is_not_recompiled_by_the_check(tmp_path):
    """Its text names the callback by position: the check compares the text (not the key
    that keeps such programs unshared), so calling an entry point again compiles nothing."""

    @jn.experiment
    class Prints(Tiny):
        def loss(self, logits, *, y):
            jax.debug.callback(lambda v: None, logits.sum())
            return Tiny.loss(self, logits, y=y)

    n = handle(Prints(max_epochs=1, n_val=0), tmp_path / "a")
    jn.train(n)
    compiled = misses()
    n.max_epochs = 2
    jn.train(n)
    assert misses() == compiled


HOLDER = {"w": np.ones(4, np.float32)}


@jn.experiment
class Hidden(Tiny):
    def forward(self, model, params, state, *, x):
        out, state = jn.apply(model, params, state, x)
        table = globals()["HOLDER"]  # reached around the names in the code: no fingerprint
        return out * jnp.asarray(table["w"]), state


@pytest.mark.slow
def test_predict_checks_a_key_with_gaps_against_the_trace_at_every_call(tmp_path):
    """`globals()[...]` is a read no fingerprint follows: the key has a gap, so no call runs
    on the key alone, however soon after the last (there is no time window)."""
    HOLDER["w"][:] = 1.0
    n = handle(Hidden(n_val=0), tmp_path / "a")
    np.testing.assert_allclose(predicted(n), eager(n), rtol=1e-5, atol=1e-5)
    HOLDER["w"][:] = 3.0  # in place, right after the last check: the program text sees it
    np.testing.assert_allclose(predicted(n), eager(n, lambda o: o * 3.0), rtol=1e-5, atol=1e-5)
    assert "traced program changed though nothing in its key did" in reasons(n)
    HOLDER["w"][:] = 2.0
    np.testing.assert_allclose(predicted(n), eager(n, lambda o: o * 2.0), rtol=1e-5, atol=1e-5)
    m = handle(Hidden(), tmp_path / "b")  # and any other entry point
    first = jn.validate(m)["val_loss"]
    HOLDER["w"][:] = 0.0  # every logit 0: the loss of a uniform guess
    assert jn.validate(m)["val_loss"] == pytest.approx(np.log(4), rel=1e-5) != first
