"""Every model adapter through the full driver: BatchNorm state trains, eval leaves it frozen."""

from __future__ import annotations

import equinox as eqx
import flax.linen as linen
import jax
import numpy as np
import optax
import pytest
from conftest import host_copy, leaves_equal, make_data, nitro
from flax import nnx

import jaxnitro as jn


class NNXNet(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.l2 = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.l2(self.drop(jax.nn.relu(self.bn(self.l1(x)))))


class LinenNet(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool = False):
        x = linen.Dense(16)(x)
        x = linen.BatchNorm(use_running_average=not train)(x)
        x = linen.Dropout(0.1, deterministic=not train)(jax.nn.relu(x))
        return linen.Dense(4)(x)


class EqxNet(eqx.Module):
    l1: eqx.nn.Linear
    bn: eqx.nn.BatchNorm
    l2: eqx.nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.l1 = eqx.nn.Linear(8, 16, key=k1)
        self.bn = eqx.nn.BatchNorm(16, axis_name="batch", mode="batch")
        self.l2 = eqx.nn.Linear(16, 4, key=k2)

    def __call__(self, x, state):
        h, state = self.bn(self.l1(x), state)
        return self.l2(jax.nn.relu(h)), state


def plain_triple(rng):
    w = jax.random.normal(rng, (8, 4)) * 0.1
    params = {"w": w, "b": np.zeros(4, np.float32)}
    state = {"mean": np.zeros(8, np.float32)}

    def apply_fn(params, state, x, *, train=False):
        if train:  # a running mean, updated only in training
            state = {"mean": 0.9 * state["mean"] + 0.1 * x.mean(0)}
        return (x - state["mean"]) @ params["w"] + params["b"], state

    return apply_fn, params, state


BUILDERS = {
    "nnx": lambda rng: jn.split_model(NNXNet(nnx.Rngs(rng))),
    "linen": lambda rng: jn.split_model(LinenNet(), rng, np.zeros((1, 8), np.float32)),
    "equinox": lambda rng: jn.split_model(*eqx.nn.make_with_state(EqxNet)(rng)),
    "plain": plain_triple,
}


@jn.experiment
class AnyNet:
    kind: jn.GraphConst[str] = "nnx"
    max_epochs: int = 2

    def build_model(self, rng):
        return BUILDERS[self.kind](rng)

    def build_data(self, dist):
        x, y = make_data(192)
        return {
            "train": jn.DataLoader({"x": x[:128], "y": y[:128]}, 32, shuffle=True, drop_last=True),
            "val": jn.DataLoader({"x": x[128:], "y": y[128:]}, 32),
        }

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_adapter_trains_and_freezes_state_in_eval(kind, run_dir):
    n = nitro(AnyNet(kind=kind), run_dir=run_dir)
    state0 = host_copy(n.state)
    params0 = host_copy(n.params)
    result = jn.train(n)
    assert not leaves_equal(n.params, params0)
    assert not leaves_equal(n.state, state0), "batch statistics must update in training"
    trained = host_copy(n.state)
    a, b = jn.validate(n), jn.validate(n)
    assert a == b  # eval is deterministic
    assert leaves_equal(n.state, trained), "eval must not touch the model state"
    assert np.isfinite(result.history[-1]["val_loss"])
    out = jn.predict(n, {"x": make_data(5)[0]})
    assert out.shape == (5, 4)
