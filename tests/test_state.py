"""The low-level layer: compile a model, check it against eager, train with a TrainState."""

from __future__ import annotations

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

    with pytest.raises(jn.HookError, match=r"scalar.*\(4,\)"):
        jn.train_step(
            per_sample, ts, {"x": np.ones((4, 2), np.float32), "y": np.ones((4, 2), np.float32)}
        )


def test_optimizer_key_is_kept_per_transformation_and_tells_rates_apart():
    from jaxnitro.compile import cache

    a, b = optax.adam(1e-3), optax.adam(1e-2)
    assert cache.optimizer_key(a) is cache.optimizer_key(a)  # computed once per object
    assert cache.optimizer_key(a) == cache.optimizer_key(optax.adam(1e-3))
    assert cache.optimizer_key(a) != cache.optimizer_key(b)


def test_the_fast_path_recompiles_a_redefined_loss_and_cache_reset_clears_it():
    import jaxnitro.state as state_mod

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
