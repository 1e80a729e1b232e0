"""CPU time per `jn.train_step` call in a loop (a 2-layer NNX MLP, batch 32): what the
per-call key costs. `jn.train_step` keys each call by the content of the loss function and
the model's code (its fingerprints), so this is the price of seeing an edited helper.

    PYTHONPATH=src python benchmarks/train_step_cost.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(2, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


def mse(model, params, state, batch):
    pred, state = jn.apply(model, params, state, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2), state


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.adam(1e-2))
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    batch = {"x": x, "y": x**2}
    for _ in range(10):  # compiled here
        ts, loss, _ = jn.train_step(mse, ts, batch)
    jax.block_until_ready(loss)
    per_step = []
    for _ in range(args.repeats):
        t0 = time.process_time()
        for _ in range(args.steps):
            ts, loss, _ = jn.train_step(mse, ts, batch)
        jax.block_until_ready(loss)
        per_step.append((time.process_time() - t0) / args.steps * 1e6)
    out = {"jaxnitro": jn.__file__, "cpu_us_per_step": round(statistics.median(per_step), 1)}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
