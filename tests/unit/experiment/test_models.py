"""Tests for experiment.models: one interface over NNX, Linen, Equinox and plain models."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxnitro._src.core.errors import ConfigError
from jaxnitro._src.experiment.models import apply, is_training, mode, split_model, structure_key

IN, HIDDEN, OUT, BATCH = 3, 16, 2, 32


@dataclasses.dataclass
class Case:
    """A split model plus how to read its BatchNorm running mean out of `state`."""

    model: Any
    params: Any
    state: Any
    running_mean: Callable[[Any], jax.Array]
    dropout_uses_mode_rng: bool = True  # NNX dropout draws from its own Rngs instead


# ------------------------------------------------------------------ the four MLPs


class NNXMLP(nnx.Module):
    def __init__(self, hidden: int, *, rngs: nnx.Rngs):
        self.dense1 = nnx.Linear(IN, hidden, rngs=rngs)
        self.norm = nnx.BatchNorm(hidden, momentum=0.9, rngs=rngs)
        self.dropout = nnx.Dropout(0.2, rngs=rngs)
        self.dense2 = nnx.Linear(hidden, OUT, rngs=rngs)

    def __call__(self, x):
        return self.dense2(self.dropout(jax.nn.relu(self.norm(self.dense1(x)))))


class LinenMLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x, train: bool = True):  # default True: split_model must override it
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.2, deterministic=not train)(jax.nn.relu(x))
        return nn.Dense(OUT)(x)


class LinenDeterministicMLP(nn.Module):
    hidden: int

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        x = nn.BatchNorm(use_running_average=deterministic, momentum=0.9)(nn.Dense(self.hidden)(x))
        x = nn.Dropout(0.2, deterministic=deterministic)(jax.nn.relu(x))
        return nn.Dense(OUT)(x)


class EqxMLP(eqx.Module):
    dense1: eqx.nn.Linear
    norm: eqx.nn.BatchNorm
    dropout: eqx.nn.Dropout
    dense2: eqx.nn.Linear
    activation: str = eqx.field(default="relu")

    def __init__(self, hidden: int, key: jax.Array, activation: str = "relu"):
        k1, k2 = jax.random.split(key)
        self.dense1 = eqx.nn.Linear(IN, hidden, key=k1)
        self.norm = eqx.nn.BatchNorm(hidden, axis_name="batch", momentum=0.9, mode="ema")
        self.dropout = eqx.nn.Dropout(0.2)
        self.dense2 = eqx.nn.Linear(hidden, OUT, key=k2)
        self.activation = activation

    def __call__(self, x, state, *, key=None):
        x, state = self.norm(self.dense1(x), state)
        x = self.dropout(getattr(jax.nn, self.activation)(x), key=key)
        return self.dense2(x), state


def plain_apply(params, state, x, *, train: bool, rng: jax.Array | None):
    """Hand-written MLP with batch norm and dropout in the plain-triple convention."""
    h = x @ params["w1"] + params["b1"]
    if train:
        mean, var = h.mean(0), h.var(0)
        state = {"mean": 0.9 * state["mean"] + 0.1 * mean, "var": 0.9 * state["var"] + 0.1 * var}
    else:
        mean, var = state["mean"], state["var"]
    h = jax.nn.relu((h - mean) / jnp.sqrt(var + 1e-5))
    if train and rng is not None:
        keep = jax.random.bernoulli(rng, 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0.0)
    return h @ params["w2"] + params["b2"], state


def x_batch(seed: int = 0) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), (BATCH, IN)) * 2.0 + 1.0


def build(kind: str, hidden: int = HIDDEN) -> Case:
    if kind == "nnx":
        model, params, state = split_model(NNXMLP(hidden, rngs=nnx.Rngs(0)))
        return Case(model, params, state, lambda s: s["norm"]["mean"][...], False)
    if kind in ("linen", "linen-deterministic"):
        cls = LinenMLP if kind == "linen" else LinenDeterministicMLP
        model, params, state = split_model(cls(hidden), jax.random.key(0), x_batch())
        return Case(model, params, state, lambda s: s["batch_stats"]["BatchNorm_0"]["mean"])
    if kind == "equinox":
        module, eqx_state = eqx.nn.make_with_state(EqxMLP)(hidden, jax.random.key(0))
        model, params, state = split_model(module, eqx_state)
        index = module.norm.ema_state_index
        return Case(model, params, state, lambda s: s.get(index)[0])
    if kind == "plain":
        k1, k2 = jax.random.split(jax.random.key(0))
        params = {
            "w1": jax.random.normal(k1, (IN, hidden)) / IN**0.5,
            "b1": jnp.zeros(hidden),
            "w2": jax.random.normal(k2, (hidden, OUT)) / hidden**0.5,
            "b2": jnp.zeros(OUT),
        }
        state = {"mean": jnp.zeros(hidden), "var": jnp.ones(hidden)}
        model, params, state = split_model((plain_apply, params, state))
        return Case(model, params, state, lambda s: s["mean"])
    raise AssertionError(kind)


KINDS = ["nnx", "linen", "linen-deterministic", "equinox", "plain"]


@pytest.fixture(params=KINDS)
def case(request) -> Case:
    return build(request.param)


# --------------------------------------------------------------------- helpers


def target(x: jax.Array) -> jax.Array:
    return jnp.stack([jnp.sin(x[:, 0]) + x[:, 1], x[:, 2] - x[:, 0]], axis=1)


def make_train_step(model, lr: float = 0.05):
    """A jitted SGD step that donates params and state, as the framework does."""

    def step(params, state, x, y, rng):
        def loss_fn(p):
            with mode(train=True, rng=rng):
                out, new_state = apply(model, p, state, x)
            return jnp.mean((out - y) ** 2), new_state

        (loss, new_state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        return params, new_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def make_eval(model, *, inside_mode: bool):
    def evaluate(params, state, x):
        if not inside_mode:
            return apply(model, params, state, x)
        with mode(train=False, rng=jax.random.key(7)):
            return apply(model, params, state, x)

    return jax.jit(evaluate)


def train_call(model, params, state, x, rng):
    with mode(train=True, rng=rng):
        return apply(model, params, state, x)


# ------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_training_lowers_loss_and_updates_batch_stats(case):
    x = x_batch()
    y = target(x)
    evaluate = make_eval(case.model, inside_mode=False)
    eval_loss = lambda p, s: float(jnp.mean((evaluate(p, s, x)[0] - y) ** 2))  # noqa: E731
    initial_mean = np.asarray(case.running_mean(case.state))
    step = make_train_step(case.model)

    # Warm the running statistics first so the eval loss compares like with like.
    params, state, losses = case.params, case.state, []
    for i in range(60):
        params, state, loss = step(params, state, x, y, jax.random.key(i))
        losses.append(float(loss))
        if i == 9:
            loss_after_warmup = eval_loss(params, state)

    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10])
    assert eval_loss(params, state) < 0.7 * loss_after_warmup
    assert not np.allclose(case.running_mean(state), initial_mean)


@pytest.mark.slow
@pytest.mark.parametrize("inside_mode", [False, True], ids=["no-mode", "eval-mode"])
def test_eval_is_deterministic_and_keeps_batch_stats(case, inside_mode):
    evaluate = make_eval(case.model, inside_mode=inside_mode)
    x = x_batch()
    out1, state1 = evaluate(case.params, case.state, x)
    out2, state2 = evaluate(case.params, state1, x)

    np.testing.assert_array_equal(out1, out2)
    np.testing.assert_array_equal(case.running_mean(state2), case.running_mean(case.state))
    # Inference normalizes with the running statistics, so it must differ from a
    # training call, which normalizes with this batch's statistics.
    train_out, _ = jax.jit(lambda p, s: train_call(case.model, p, s, x, jax.random.key(0)))(
        case.params, case.state
    )
    assert not np.allclose(out1, train_out)


def test_training_dropout_is_random(case):
    x = x_batch()
    run = jax.jit(lambda p, s, rng: train_call(case.model, p, s, x, rng))
    out_a, state_a = run(case.params, case.state, jax.random.key(1))
    out_a_again, _ = run(case.params, case.state, jax.random.key(1))
    np.testing.assert_array_equal(out_a, out_a_again)  # same key, same state: reproducible

    if case.dropout_uses_mode_rng:
        out_b, _ = run(case.params, case.state, jax.random.key(2))
    else:
        # NNX dropout draws from the module's own Rngs, whose counter lives in state.
        out_b, _ = run(case.params, state_a, jax.random.key(1))
    assert not np.allclose(out_a, out_b)


def test_apply_passes_kwargs_through():
    model, params, state = split_model(LinenDeterministicMLP(HIDDEN), jax.random.key(0), x_batch())
    # An explicit kwarg overrides the mode: train mode, but deterministic=True.
    with mode(train=True, rng=jax.random.key(0)):
        out1, _ = apply(model, params, state, x_batch(), deterministic=True)
    with mode(train=True, rng=jax.random.key(1)):
        out2, _ = apply(model, params, state, x_batch(), deterministic=True)
    np.testing.assert_array_equal(out1, out2)


# --------------------------------------------------------------------- mode


def recorder(params, state, *, train, rng):
    return (train, rng), state


def test_mode_sets_training_flag_and_restores_on_exit():
    assert not is_training()
    with mode(train=True):
        assert is_training()
        with mode(train=False):
            assert not is_training()
        assert is_training()
    assert not is_training()
    assert apply(recorder, None, None)[0] == (False, None)


def test_each_apply_call_in_a_mode_gets_its_own_key():
    def keys():
        with mode(train=True, rng=jax.random.key(0)):
            (train, k1), _ = apply(recorder, None, None)
            (_, k2), _ = apply(recorder, None, None)
        return train, jax.random.key_data(k1), jax.random.key_data(k2)

    train, k1, k2 = keys()
    assert train
    assert not np.array_equal(k1, k2)
    _, k1_again, _ = keys()  # re-entering the mode restarts the counter
    np.testing.assert_array_equal(k1, k1_again)


def test_mode_rejects_non_bool_train():
    with pytest.raises(ConfigError, match="Python bool"):
        with mode(train=jnp.array(True)):
            pass


# ----------------------------------------------------------------- structure_key


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["nnx", "linen", "equinox"])
def test_structure_key_tracks_architecture_not_weights(kind):
    same = build(kind, hidden=8).model, build(kind, hidden=8).model
    assert structure_key(same[0]) == structure_key(same[1])
    assert hash(structure_key(same[0])) == hash(structure_key(same[1]))
    assert structure_key(same[0]) != structure_key(build(kind, hidden=9).model)


@pytest.mark.slow
def test_structure_key_of_equinox_sees_non_array_fields():
    def key_for(activation: str, seed: int):
        module, state = eqx.nn.make_with_state(EqxMLP)(8, jax.random.key(seed), activation)
        return structure_key(split_model(module, state)[0])

    assert key_for("relu", 0) == key_for("relu", 1)
    assert key_for("relu", 0) != key_for("gelu", 0)


def test_structure_key_of_plain_callable_is_the_callable():
    assert structure_key(build("plain").model) is plain_apply


# ------------------------------------------------------------------------ errors


def test_unsupported_type_is_rejected_with_accepted_forms():
    with pytest.raises(ConfigError, match=r"builtins\.int.*flax\.nnx\.Module.*triple"):
        split_model(42)
    with pytest.raises(ConfigError, match="callable"):
        split_model(("not callable", {}, {}))
    with pytest.raises(ConfigError, match="split_model"):
        apply(42, {}, {})
    with pytest.raises(ConfigError, match="split_model"):
        structure_key(42)


def test_linen_without_rng_explains_the_call():
    with pytest.raises(ConfigError, match=r"jax\.random\.key"):
        split_model(LinenMLP(HIDDEN))


def test_stateful_equinox_without_state_points_to_make_with_state():
    module, _ = eqx.nn.make_with_state(EqxMLP)(HIDDEN, jax.random.key(0))
    with pytest.raises(ConfigError, match="make_with_state"):
        split_model(module)


def test_nnx_rejects_extra_arguments():
    with pytest.raises(ConfigError, match="already initialized"):
        split_model(NNXMLP(HIDDEN, rngs=nnx.Rngs(0)), jax.random.key(0))
