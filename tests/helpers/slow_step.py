"""An experiment whose train step takes a known time on the device (a host callback inside
the program): the time split and the data-wait tests measure against it."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jaxnitro as jn


def _sleep(x, seconds):
    time.sleep(seconds)
    return x


class Lin(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
        return self.lin(x)


@jn.experiment
class SlowStep:
    """A train step that takes `step_s` on the device (a host callback inside the program)."""

    step_s: jn.GraphConst[float] = 0.04
    max_epochs: int = 1

    def build_model(self, rng):
        return jn.split_model(Lin(nnx.Rngs(rng)))

    def build_data(self, dist):
        raise NotImplementedError  # passed as Nitro(data=...)

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        held = jax.pure_callback(
            lambda v: _sleep(v, self.step_s),
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.lax.stop_gradient(logits).sum(),
        )
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + 0.0 * held
