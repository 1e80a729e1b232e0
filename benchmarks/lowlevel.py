"""The low-level layer against a hand-written `jax.jit` loop, side by side in one process.

The Lux tutorial's work: an MLP 2→32→32→2 (ReLU), Adam 1e-3, batches of 32, 2,000 steps.
`jn.train_step(loss_fn, ts, batch)` against a `jax.jit` step over the same NNX model, both with
batches already on the device; median of `--repeats` runs, reported as a ratio.

    python benchmarks/lowlevel.py [--steps 2000] [--repeats 5]
"""

from __future__ import annotations

import argparse
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
        self.l2 = nnx.Linear(32, 32, rngs=rngs)
        self.l3 = nnx.Linear(32, 2, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def data(n: int = 32):
    x = np.random.default_rng(0).normal(size=(n, 32, 2)).astype(np.float32)
    y = np.where(x.sum(-1, keepdims=True) > 0, 1.0, 0.0).astype(np.float32) * np.ones(2, "f4")
    return [{"x": jnp.asarray(x[i]), "y": jnp.asarray(y[i])} for i in range(n)]


def loss_fn(model, params, state, batch):
    out, state = jn.apply(model, params, state, batch["x"])
    return jnp.mean((out - batch["y"]) ** 2), state


def run_jaxnitro(batches, steps: int) -> float:
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.adam(1e-3))
    for b in batches[:3]:
        ts, loss, _ = jn.train_step(loss_fn, ts, b)
    jax.block_until_ready(loss)
    t = time.perf_counter()
    for i in range(steps):
        ts, loss, _ = jn.train_step(loss_fn, ts, batches[i % len(batches)])
    jax.block_until_ready(loss)
    return steps / (time.perf_counter() - t)


def run_hand(batches, steps: int) -> float:
    tx = optax.adam(1e-3)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        def loss(p):
            return jnp.mean((nnx.merge(graphdef, p)(batch["x"]) - batch["y"]) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    for b in batches[:3]:
        params, opt, value = step(params, opt, b)
    jax.block_until_ready(value)
    t = time.perf_counter()
    for i in range(steps):
        params, opt, value = step(params, opt, batches[i % len(batches)])
    jax.block_until_ready(value)
    return steps / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    batches = data()
    ours, hand = [], []
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits both
        ours.append(run_jaxnitro(batches, args.steps))
        hand.append(run_hand(batches, args.steps))
    o, h = statistics.median(ours), statistics.median(hand)
    print("| way | steps/s (median) | × hand |\n|---|---|---|")
    print(f"| jn.train_step | {o:,.0f} | {o / h:.2f}× |\n| hand jax.jit | {h:,.0f} | 1.00× |")


if __name__ == "__main__":
    main()
