"""Keras 3 `fit` on run.py's MLP (784→128→10, RAdam 1e-3): the reference row of `host.py`.

The JAX backend, `jit_compile=True`, numpy arrays in (Keras slices and sends each batch), no
shuffling, `verbose=0` (Keras writes nothing per batch). Keras has no RAdam: `RAdam` below is
the same rule as `optax.radam` (b1 0.9, b2 0.999, eps 1e-8, the variance rectified from the
5th step on), written with `keras.ops`, so the two do the same work per step.

    python benchmarks/keras_ref.py [--batch 32] [--epochs 3]

`KerasFit.timed()` trains one more epoch (`fit(epochs=1)`: the train function compiled by the
first call is kept) and returns that epoch's steps/s, timed from its `on_epoch_begin` to its
`on_epoch_end` callback, as jaxnitro's epoch line times its own.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "jax")  # read when keras is first imported

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import ops  # noqa: E402

HERE = Path(__file__).resolve().parent


class RAdam(keras.optimizers.Optimizer):
    """Rectified Adam as `optax.radam` computes it (`eps_root` 0, threshold 5)."""

    def __init__(self, learning_rate=1e-3, beta_1=0.9, beta_2=0.999, epsilon=1e-8, **kwargs):
        super().__init__(learning_rate=learning_rate, name="radam", **kwargs)
        self.beta_1, self.beta_2, self.epsilon = beta_1, beta_2, epsilon

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._mu = [self.add_variable_from_reference(v, "mu") for v in var_list]
        self._nu = [self.add_variable_from_reference(v, "nu") for v in var_list]

    def update_step(self, gradient, variable, learning_rate):
        index = self._get_variable_index(variable)
        mu, nu = self._mu[index], self._nu[index]
        lr = ops.cast(learning_rate, variable.dtype)
        g = ops.cast(gradient, variable.dtype)
        t = ops.cast(self.iterations + 1, variable.dtype)
        b1, b2 = self.beta_1, self.beta_2
        self.assign(mu, b1 * mu + (1 - b1) * g)
        self.assign(nu, b2 * nu + (1 - b2) * ops.square(g))
        b2_t = ops.power(b2, t)
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * t * b2_t / (1 - b2_t)
        mu_hat = mu / (1 - ops.power(b1, t))
        nu_hat = nu / (1 - b2_t)
        # (clamped where unused, so the square root stays finite on the early steps)
        ratio = ops.maximum((rho_t - 4) * (rho_t - 2) * rho_inf, 0.0) / (
            (rho_inf - 4) * (rho_inf - 2) * rho_t
        )
        rectified = ops.sqrt(ratio) * mu_hat / (ops.sqrt(nu_hat) + self.epsilon)
        self.assign_sub(variable, lr * ops.where(rho_t >= 5.0, rectified, mu_hat))


class _EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.seconds = time.perf_counter() - self.t0


class KerasFit:
    """A compiled Keras MLP on `data` ({"x": (n, 784) float32, "y": (n,) int32}); its first
    epoch is trained here (compiles apart, like jaxnitro's and the hand loop's)."""

    def __init__(self, data: dict[str, np.ndarray], batch: int):
        keras.utils.set_random_seed(0)
        self.x, self.y, self.batch = data["x"], data["y"], batch
        self.steps = len(self.x) // batch
        n = self.steps * batch  # whole batches only, as the other loops (drop_last)
        self.x, self.y = self.x[:n], self.y[:n]
        self.model = keras.Sequential(
            [
                keras.Input((784,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        self.model.compile(
            optimizer=RAdam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
        self.rates: list[float] = []
        self.timed()  # the first epoch: compiles
        self.rates.clear()

    def timed(self) -> float:
        """One more epoch; its steps/s (also appended to `rates`)."""
        timer = _EpochTimer()
        self.model.fit(
            self.x, self.y, batch_size=self.batch, epochs=1, shuffle=False, verbose=0,
            callbacks=[timer],
        )  # fmt: skip
        self.rates.append(self.steps / timer.seconds)
        return self.rates[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=int, default=3, help="epochs timed after the first")
    args = ap.parse_args()
    sys.path.insert(0, str(HERE))
    import run as bench  # the MLP's data

    samples = {32: 32 * 2048, 1024: 1024 * 64}.get(args.batch, args.batch * 512)
    data = bench.make_data(dict(kind="mlp", samples=samples))
    fit = KerasFit(data, args.batch)
    for _ in range(args.epochs):
        print(f"keras fit, batch {args.batch}: {fit.timed():,.0f} steps/s")


if __name__ == "__main__":
    main()
