"""CPU time per `jn.train_step` call in a loop (a 2-layer NNX MLP, batch 32): what the
per-call key costs. `jn.train_step` keys each call by the content of the loss function and
the model's code (its fingerprints), so this is the price of seeing an edited helper.

Interleaved with the same loop over a hand-written `jax.jit` step (the parameters and the
optimizer state as flat lists of arrays, donated; the module merged inside the program), in
alternating order: `x_hand` is the hand step's CPU time over `jn.train_step`'s (above 1:
`jn.train_step` is faster), the median of the per-repeat ratios; `x_hand_wall` the same of
the wall time (steps per second: on a CPU backend the two differ where XLA's threads wait).

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


def hand_step(model: MLP, batch: dict):
    """A careful hand-written step for the same model, loss and optimizer: `run(steps)`."""
    tx = optax.adam(1e-2)
    graphdef, params = nnx.split(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    carry = [leaves, tx.init(leaves), None]

    @jax.jit(donate_argnums=(0, 1))
    def step(leaves, opt, x, y):
        def loss(flat):
            pred = nnx.merge(graphdef, jax.tree.unflatten(treedef, flat))(x)
            return jnp.mean((pred - y) ** 2)

        value, grads = jax.value_and_grad(loss)(leaves)
        updates, opt = tx.update(grads, opt, leaves)
        return optax.apply_updates(leaves, updates), opt, value

    def run(steps: int) -> None:
        leaves, opt, value = carry
        for _ in range(steps):
            leaves, opt, value = step(leaves, opt, batch["x"], batch["y"])
        jax.block_until_ready(value)
        carry[:] = [leaves, opt, value]

    run(10)  # compiled here
    return run


def cpu_per_step(run, steps: int) -> float:
    return per_step(run, steps)[0]


def per_step(run, steps: int) -> tuple[float, float]:
    """(CPU µs, wall µs) a step of `run(steps)`."""
    t0, w0 = time.process_time(), time.perf_counter()
    run(steps)
    return (time.process_time() - t0) / steps * 1e6, (time.perf_counter() - w0) / steps * 1e6


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args(argv)
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.adam(1e-2))
    x = np.random.default_rng(0).normal(size=(32, 2)).astype(np.float32)
    batch = {"x": x, "y": x**2}
    box = [ts]

    def ours(steps: int) -> None:
        ts = box[0]
        for _ in range(steps):
            ts, loss, _ = jn.train_step(mse, ts, batch)
        jax.block_until_ready(loss)
        box[0] = ts

    ours(10)  # compiled here
    hand = hand_step(MLP(nnx.Rngs(0)), batch)
    times: dict[str, list[tuple[float, float]]] = {"ours": [], "hand": []}
    for r in range(args.repeats):
        for side in ("ours", "hand") if r % 2 == 0 else ("hand", "ours"):
            times[side].append(per_step(ours if side == "ours" else hand, args.steps))

    def ratio(i: int) -> float:
        pairs = zip(times["hand"], times["ours"], strict=True)
        return round(statistics.median(h[i] / o[i] for h, o in pairs), 3)

    out = {
        "jaxnitro": jn.__file__,
        "cpu_us_per_step": round(statistics.median(t[0] for t in times["ours"]), 1),
        "hand_cpu_us_per_step": round(statistics.median(t[0] for t in times["hand"]), 1),
        "x_hand": ratio(0),
        "x_hand_wall": ratio(1),
    }
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
