"""The low-level layer: compile a model, check it against eager, train with a TrainState."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxnitro as jn


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(2, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.l3 = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.gelu(self.l2(jax.nn.gelu(self.l1(x)))))


def mse(model, params, state, batch):
    pred, state = jn.apply(model, params, state, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2), state


@pytest.mark.slow
def test_compiled_forward_matches_eager():
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    eager, _ = jn.apply(model, params, state, x)
    compiled, _ = jax.jit(lambda p, s, x: jn.apply(model, p, s, x))(params, state, x)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(compiled), atol=1e-6)
    g_eager = jax.grad(lambda p: mse(model, p, state, {"x": x, "y": x**2})[0])(params)
    g_jit = jax.jit(jax.grad(lambda p: mse(model, p, state, {"x": x, "y": x**2})[0]))(params)
    for a, b in zip(jax.tree.leaves(g_eager), jax.tree.leaves(g_jit), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


@pytest.mark.slow
def test_train_step_trains_and_compiles_once():
    rng = np.random.default_rng(0)
    data = [{"x": (x := rng.normal(size=(32, 2)).astype(np.float32)), "y": x**2} for _ in range(8)]
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.adam(1e-2))
    misses = jn.cache_stats()["misses"]
    first = None
    for _ in range(40):
        for batch in data:
            ts, loss, aux = jn.train_step(mse, ts, batch)
            first = float(loss) if first is None else first
    assert int(ts.step) == 320
    assert float(loss) < 0.3 * first
    assert aux == {}
    assert jn.cache_stats()["misses"] == misses + 1  # one program for the whole loop


@pytest.mark.slow
def test_train_step_matches_a_hand_written_optax_step():
    model, params, state = jn.split_model(MLP(nnx.Rngs(1)))
    batch = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 2), np.float32)}
    tx = optax.sgd(0.1)
    expected = jax.tree.map(
        lambda p, g: p - 0.1 * g, params, jax.grad(lambda p: mse(model, p, state, batch)[0])(params)
    )
    ts = jn.TrainState.create(model, jax.tree.map(jnp.copy, params), state, tx)
    ts, _, _ = jn.train_step(mse, ts, batch)
    for a, b in zip(jax.tree.leaves(ts.params), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_train_step_default_optimizer_is_radam_and_bad_tx_errors():
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state)
    assert float(ts.opt_state.hyperparams["learning_rate"]) == pytest.approx(1e-3)
    with pytest.raises(TypeError, match="optax.GradientTransformation"):
        jn.TrainState.create(model, params, state, tx="adam")


def test_train_step_rejects_a_non_scalar_loss():
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state)

    def per_sample(model, params, state, batch):
        pred, state = jn.apply(model, params, state, batch["x"])
        return ((pred - batch["y"]) ** 2).sum(-1), state

    with pytest.raises(jn.HookError, match=r"shape \(4,\); it must return a scalar"):
        jn.train_step(
            per_sample, ts, {"x": np.ones((4, 2), np.float32), "y": np.ones((4, 2), np.float32)}
        )


def test_optimizer_key_is_kept_per_transformation_and_tells_rates_apart():
    from jaxnitro._src.compile import cache

    a, b = optax.adam(1e-3), optax.adam(1e-2)
    assert cache.optimizer_key(a) is cache.optimizer_key(a)  # computed once per object
    assert cache.optimizer_key(a) == cache.optimizer_key(optax.adam(1e-3))
    assert cache.optimizer_key(a) != cache.optimizer_key(b)


def test_the_fast_path_recompiles_a_redefined_loss_and_cache_reset_clears_it():
    from jaxnitro._src.steps import state as state_mod

    model, params, state = jn.split_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.sgd(0.1))
    batch = {"x": np.ones((4, 3), np.float32)}

    def make(scale):
        def loss_fn(model, params, state, batch):
            out, state = jn.apply(model, params, state, batch["x"])
            return scale * (out**2).mean(), state

        return loss_fn

    first, again = make(1.0), make(3.0)  # the same code, another closure value
    ts1, l1, _ = jn.train_step(first, ts, batch)
    ts2, l2, _ = jn.train_step(again, ts1, batch)
    ts3, l3, _ = jn.train_step(first, ts2, batch)
    assert len(state_mod._fast) >= 2  # one entry per function object
    assert float(l2) > 2.0 * float(l3)  # `again` really ran with scale 3, not first's program
    jn.cache_reset()
    assert not state_mod._fast


# ------------------------------------------------------- the per-call path (issue 26, part 3)


def _dict_params(seed: int = 0) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "l1": {"w": jax.random.normal(k1, (2, 8)), "b": jnp.zeros((8,))},
        "l2": {"w": jax.random.normal(k2, (8, 2)), "b": jnp.zeros((2,))},
    }


def mlp_apply(params, state, x):
    h = jax.nn.relu(x @ params["l1"]["w"] + params["l1"]["b"])
    return h @ params["l2"]["w"] + params["l2"]["b"], state


def _numpy_batches(n: int = 4) -> list[dict]:
    rng = np.random.default_rng(0)
    return [
        {"x": (x := rng.normal(size=(16, 2)).astype(np.float32)), "y": np.tanh(x)} for _ in range(n)
    ]


@pytest.mark.slow
def test_numpy_and_device_batches_train_alike():
    batches = _numpy_batches()
    runs = []
    for to_device in (False, True):
        ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.adam(1e-2))
        losses = []
        for b in batches * 3:
            b = {k: jnp.asarray(v) for k, v in b.items()} if to_device else b
            ts, loss, _ = jn.train_step(mse, ts, b)
            losses.append(float(loss))
        runs.append((losses, jax.tree.map(np.asarray, ts.params)))
    (l_np, p_np), (l_dev, p_dev) = runs
    np.testing.assert_allclose(l_np, l_dev, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(p_np), jax.tree.leaves(p_dev), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)


@pytest.mark.slow
def test_numpy_batches_are_not_converted_in_python(monkeypatch):
    # The compiled call moves numpy arrays to the device itself; a `jnp.asarray` per field
    # in Python cost more than a small step (it was 2 calls per step here).
    batches = _numpy_batches()
    ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.adam(1e-2))
    for b in batches:  # compile outside the count (tracing may call jnp.asarray)
        ts, loss, _ = jn.train_step(mse, ts, b)
    calls = []
    real = jnp.asarray
    monkeypatch.setattr(jnp, "asarray", lambda *a, **k: calls.append(1) or real(*a, **k))
    for b in batches * 2:
        ts, loss, _ = jn.train_step(mse, ts, b)
    assert calls == []
    assert np.isfinite(float(loss))


@jax.tree_util.register_pytree_node_class
class _Counted:
    """A parameter container that counts how often JAX flattens it."""

    flattens = 0

    def __init__(self, inner):
        self.inner = inner

    def tree_flatten(self):
        type(self).flattens += 1
        return (self.inner,), None

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0])


def test_a_returned_state_goes_back_without_being_flattened_again():
    def counted_apply(params, state, x):
        return mlp_apply(params.inner, state, x)

    batches = _numpy_batches()
    ts = jn.TrainState.create(counted_apply, _Counted(_dict_params()), {}, optax.sgd(0.1))
    for b in batches:
        ts, _, _ = jn.train_step(mse, ts, b)
    before = _Counted.flattens
    for b in batches * 3:  # the loop never reads the state: it is passed back as its leaves
        ts, loss, _ = jn.train_step(mse, ts, b)
    assert _Counted.flattens == before
    assert isinstance(ts.params, _Counted)  # reading a field builds the pytree once
    assert int(ts.step) == 16
    ts, _, _ = jn.train_step(mse, ts, batches[0])  # a read state is flattened like any other
    assert _Counted.flattens > before


def test_a_returned_state_reads_like_any_train_state():
    batch = _numpy_batches(1)[0]
    plain = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.sgd(0.1))
    structure = jax.tree.structure(plain)
    ts, _, _ = jn.train_step(mse, plain, batch)
    assert jax.tree.structure(ts) == structure  # flattening reads the fields
    ts, _, _ = jn.train_step(mse, ts, batch)
    assert int(ts.replace(step=jnp.int32(7)).step) == 7
    assert "TrainState(params=" in repr(ts)
    assert ts.model is mlp_apply
    twin = copy.deepcopy(ts)
    np.testing.assert_array_equal(twin.params["l1"]["w"], ts.params["l1"]["w"])
    with pytest.raises(AttributeError, match="parms"):
        ts.parms  # noqa: B018


def test_a_state_edited_in_place_after_a_read_trains_from_the_edit():
    batch = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 2), np.float32)}
    ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.sgd(0.1))
    ts, _, _ = jn.train_step(mse, ts, batch)
    zeros = jax.tree.map(jnp.zeros_like, ts.params)
    ts.params["l2"]["w"] = zeros["l2"]["w"]  # a dict edited in place, not a new state
    ts.params["l2"]["b"] = zeros["l2"]["b"]
    _, loss, _ = jn.train_step(mse, ts, batch)
    assert float(loss) == 0.0  # the edited (zero) output layer ran, not the stale one


def test_a_loss_function_edited_in_place_recompiles():
    # IPython's autoreload swaps `__code__` of the existing function object: the fast path
    # must not take the same object for the same code.
    model, params, state = jn.split_model(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.sgd(0.0))
    batch = {"x": np.ones((4, 3), np.float32)}

    def loss_fn(model, params, state, batch):
        out, state = jn.apply(model, params, state, batch["x"])
        return (out**2).mean(), state

    def edited(model, params, state, batch):
        out, state = jn.apply(model, params, state, batch["x"])
        return 3.0 * (out**2).mean(), state

    ts, before, _ = jn.train_step(loss_fn, ts, batch)
    misses = jn.cache_stats()["misses"]
    loss_fn.__code__ = edited.__code__
    ts, after, _ = jn.train_step(loss_fn, ts, batch)
    assert float(after) == pytest.approx(3.0 * float(before), rel=1e-5)
    assert jn.cache_stats()["misses"] == misses + 1


def test_a_model_function_edited_in_place_recompiles():
    def apply_fn(params, state, x):
        return x @ params["w"], state

    def doubled(params, state, x):
        return 2.0 * (x @ params["w"]), state

    ts = jn.TrainState.create(apply_fn, {"w": jnp.ones((2, 2))}, {}, optax.sgd(0.0))
    batch = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 2), np.float32)}
    ts, before, _ = jn.train_step(mse, ts, batch)
    apply_fn.__code__ = doubled.__code__
    ts, after, _ = jn.train_step(mse, ts, batch)
    assert float(after) == pytest.approx(4.0 * float(before), rel=1e-5)


def test_a_python_int_and_a_python_float_in_the_batch_are_different_programs():
    def scaled(model, params, state, batch):
        pred, state = jn.apply(model, params, state, batch["x"])
        return batch["scale"] * jnp.mean(pred**2), state

    ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.sgd(0.0))
    x = np.ones((4, 2), np.float32)
    ts, as_int, _ = jn.train_step(scaled, ts, {"x": x, "scale": 2})
    ts, as_float, _ = jn.train_step(scaled, ts, {"x": x, "scale": 2.5})
    assert float(as_float) == pytest.approx(1.25 * float(as_int), rel=1e-5)


def test_a_returned_state_with_another_batch_shape_or_structure_gets_its_program():
    # A returned state goes straight back into the program that made it; the compiled call
    # refuses another batch before running (nothing donated) and the keyed path takes over.
    ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.sgd(0.1))
    big, small = _numpy_batches(1)[0], {k: v[:5] for k, v in _numpy_batches(1)[0].items()}
    ts, _, _ = jn.train_step(mse, ts, big)
    misses = jn.cache_stats()["misses"]
    ts, loss_small, _ = jn.train_step(mse, ts, small)
    assert jn.cache_stats()["misses"] == misses + 1
    ts, _, _ = jn.train_step(mse, ts, {**big, "unused": np.zeros(3, np.float32)})
    assert jn.cache_stats()["misses"] == misses + 2
    ts, loss_big, _ = jn.train_step(mse, ts, big)  # back to the first program
    assert jn.cache_stats()["misses"] == misses + 2
    assert np.isfinite(float(loss_small)) and np.isfinite(float(loss_big))
    assert int(ts.step) == 4


def test_cache_reset_reaches_a_returned_state():
    ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.sgd(0.1))
    batch = _numpy_batches(1)[0]
    ts, _, _ = jn.train_step(mse, ts, batch)
    ts, _, _ = jn.train_step(mse, ts, batch)
    jn.cache_reset()
    ts, _, _ = jn.train_step(mse, ts, batch)  # compiles again, as after any reset
    assert jn.cache_stats()["misses"] == 1
    assert int(ts.step) == 3


class Doubling(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l = nnx.Linear(2, 2, rngs=rngs)

    def __call__(self, x):
        return self.l(x)


DOUBLING_BATCH = {"x": np.ones((4, 2), np.float32), "y": np.zeros((4, 2), np.float32)}


def _doubling_state() -> jn.TrainState:
    """A `Doubling` model's state with a zero rate: its loss stays the same step to step."""
    model, params, state = jn.split_model(Doubling(nnx.Rngs(0)))
    return jn.TrainState.create(model, params, state, optax.sgd(0.0))


def _count_lookups(monkeypatch) -> list:
    """A list that gets an entry at each call of `train_step`'s keyed path (`_lookup`)."""
    from jaxnitro._src.steps import state as state_mod

    looked: list = []
    real = state_mod._lookup
    monkeypatch.setattr(state_mod, "_lookup", lambda *a, **k: looked.append(1) or real(*a, **k))
    return looked


@pytest.mark.slow
def test_a_step_checks_the_code_it_traced_without_fingerprinting_it(monkeypatch):
    from jaxnitro._src.experiment import models
    from jaxnitro._src.steps import state as state_mod

    ts, batch = _doubling_state(), DOUBLING_BATCH
    for _ in range(3):
        ts, before, _ = jn.train_step(mse, ts, batch)
    calls = []

    def counted(real):
        def wrapper(*args, **kwargs):
            calls.append(real.__name__)
            return real(*args, **kwargs)

        return wrapper

    # A step on a returned state re-checks what the fingerprints read (one generated
    # check): it neither fingerprints nor finds the model's classes again.
    monkeypatch.setattr(state_mod, "remembered", counted(state_mod.remembered))
    monkeypatch.setattr(models, "model_classes", counted(models.model_classes))
    for _ in range(3):
        ts, loss, _ = jn.train_step(mse, ts, batch)
    assert calls == []
    assert float(loss) == pytest.approx(float(before))
    # ... and still sees an edit of the model's class at the next step
    monkeypatch.setattr(Doubling, "__call__", lambda self, x: 2.0 * self.l(x))
    ts, doubled, _ = jn.train_step(mse, ts, batch)
    assert float(doubled) == pytest.approx(4.0 * float(before), rel=1e-5)
    assert "remembered" in calls


def test_a_step_on_a_returned_state_sees_an_environment_variable_set_between_steps(
    monkeypatch,
):
    import os

    def scaled(model, params, state, batch):
        pred, state = jn.apply(model, params, state, batch["x"])
        gain = float(os.environ.get("JN_TEST_STEP_GAIN", "1"))  # read while tracing
        return gain * jnp.mean((pred - batch["y"]) ** 2), state

    ts, batch = _doubling_state(), DOUBLING_BATCH
    monkeypatch.setenv("JN_TEST_STEP_GAIN", "1")
    for _ in range(3):  # the fast path: each state goes back as its leaves
        ts, before, _ = jn.train_step(scaled, ts, batch)
    monkeypatch.setenv("JN_TEST_STEP_GAIN", "3")
    ts, after, _ = jn.train_step(scaled, ts, batch)
    assert float(after) == pytest.approx(3.0 * float(before), rel=1e-5)


def test_a_flag_or_variable_set_and_set_back_resumes_the_fast_path(monkeypatch):
    # the fast path compares JAX's flags and the environment with those the program was
    # traced under: a change takes the keyed path (another program), and once set back the
    # same program is found and the loop takes its fast path again
    import os

    def scaled(model, params, state, batch):
        pred, state = jn.apply(model, params, state, batch["x"])
        gain = float(os.environ.get("JN_TEST_STEP_GAIN", "1"))
        return gain * jnp.mean((pred - batch["y"]) ** 2), state

    ts, batch = _doubling_state(), DOUBLING_BATCH
    for _ in range(2):
        ts, base, _ = jn.train_step(scaled, ts, batch)
    program = ts.__dict__["_unread"][4]
    looked = _count_lookups(monkeypatch)
    monkeypatch.setenv("JN_TEST_STEP_GAIN", "2")
    ts, doubled, _ = jn.train_step(scaled, ts, batch)
    assert float(doubled) == pytest.approx(2 * float(base), rel=1e-5) and looked == [1]
    monkeypatch.delenv("JN_TEST_STEP_GAIN")
    with jax.numpy_rank_promotion("raise"):  # a flag that keys the program, set and reset
        ts, flagged, _ = jn.train_step(scaled, ts, batch)
    assert len(looked) == 2  # the variable unset, under the flag: another program
    ts, again, _ = jn.train_step(scaled, ts, batch)  # found by key: the first program
    assert ts.__dict__["_unread"][4] is program and len(looked) == 3
    for _ in range(3):
        ts, again, _ = jn.train_step(scaled, ts, batch)
    assert len(looked) == 3  # the fast path again
    assert float(again) == pytest.approx(float(base)) == pytest.approx(float(flagged))


STEP_GAIN = 1.0  # read by `gained` (rebound below)


def gained(model, params, state, batch):
    pred, state = jn.apply(model, params, state, batch["x"])
    return STEP_GAIN * jnp.mean((pred - batch["y"]) ** 2), state


def test_a_global_rebound_to_an_equal_value_resumes_the_fast_path(monkeypatch):
    # The same content read from another object: one keyed call finds the program by its
    # digest and checks the new object from then on (the loop's fast path resumes); a
    # rebinding to another value is another program.
    import sys

    ts, batch = _doubling_state(), DOUBLING_BATCH
    for _ in range(2):
        ts, base, _ = jn.train_step(gained, ts, batch)
    looked = _count_lookups(monkeypatch)
    here = sys.modules[__name__]
    monkeypatch.setattr(here, "STEP_GAIN", float("1.0"))  # equal, another object
    assert here.STEP_GAIN is not 1.0  # noqa: F632 (the point: not the same object)
    misses = jn.cache_stats()["misses"]
    for _ in range(4):
        ts, same, _ = jn.train_step(gained, ts, batch)
    assert looked == [1] and jn.cache_stats()["misses"] == misses  # then the fast path
    assert float(same) == pytest.approx(float(base))
    monkeypatch.setattr(here, "STEP_GAIN", 3.0)
    ts, tripled, _ = jn.train_step(gained, ts, batch)
    assert len(looked) == 2 and float(tripled) == pytest.approx(3 * float(base), rel=1e-5)


def test_after_a_cache_reset_a_returned_state_takes_the_keyed_path(monkeypatch):

    ts = jn.TrainState.create(mlp_apply, _dict_params(), {}, optax.sgd(0.1))
    batch = _numpy_batches(1)[0]
    for _ in range(2):
        ts, _, _ = jn.train_step(mse, ts, batch)
    program = ts.__dict__["_unread"][4]
    assert program.again is not None
    jn.cache_reset()
    assert program.again is None and not program.live  # (the dropped program's loop path)
    looked = _count_lookups(monkeypatch)
    ts, _, _ = jn.train_step(mse, ts, batch)
    assert looked == [1] and ts.__dict__["_unread"][4] is not program
