"""The low-level layer against a hand-written `jax.jit` loop, side by side in one process.

The Lux tutorial's work: an MLP 2→32→32→2 (ReLU), Adam 1e-3, batches of 32, in three cases,
each against the fastest careful hand step for the same inputs:

- `dict-numpy`: the tutorial's way. Parameters a plain dict, `apply_fn(params, state, x)`,
  numpy batches. The hand step is a `jax.jit` over (params dict, optimizer state, x, y) with
  both state arguments donated, called with the same numpy arrays.
- `nnx-numpy`: an NNX model from `jn.split_model`, numpy batches. The hand step carries the
  parameters as a flat list of arrays (an NNX `State` is slow to flatten in Python),
  donated, and merges the module inside the program.
- `nnx-device`: an NNX model, batches already on the device, a hand step that takes the NNX
  `State` itself (the case this benchmark measured first).

Each loop is built once (compiled, three warm-up steps) and then timed `--repeats` times for
`--steps` steps, the two loops of a case back to back in alternating order, so drift on a
shared machine hits both. Two clocks: wall time (what a user waits) and this process's CPU
time (all its threads; on a machine shared with other jobs it moves far less, since time
spent waiting for a core is not counted). Reported per clock: the medians of steps/s, their
ratio, and the median and quartiles of the per-run ratios.

    python benchmarks/lowlevel.py [--steps 500] [--repeats 31] [--cases dict-numpy,nnx-numpy]
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


def numpy_batches(n: int = 32) -> list[dict[str, np.ndarray]]:
    x = np.random.default_rng(0).normal(size=(n, 32, 2)).astype(np.float32)
    y = np.where(x.sum(-1, keepdims=True) > 0, 1.0, 0.0).astype(np.float32) * np.ones(2, "f4")
    return [{"x": x[i], "y": y[i]} for i in range(n)]


def device_batches(n: int = 32) -> list[dict[str, jax.Array]]:
    return [{k: jnp.asarray(v) for k, v in b.items()} for b in numpy_batches(n)]


# -------------------------------------------------------------- plain dict parameters


def dict_params(seed: int = 0) -> dict:
    """The MLP's weights as a plain nested dict (what the Lux tutorial's users hold)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    sizes = [(2, 32), (32, 32), (32, 2)]
    return {
        f"l{i + 1}": {
            "w": jax.random.normal(k, s, jnp.float32) / np.sqrt(s[0]),
            "b": jnp.zeros((s[1],), jnp.float32),
        }
        for i, (k, s) in enumerate(zip(keys, sizes, strict=True))
    }


def mlp_apply(params, state, x):
    for name in ("l1", "l2"):
        x = jax.nn.relu(x @ params[name]["w"] + params[name]["b"])
    return x @ params["l3"]["w"] + params["l3"]["b"], state


def loss_fn(model, params, state, batch):
    out, state = jn.apply(model, params, state, batch["x"])
    return jnp.mean((out - batch["y"]) ** 2), state


def loop(step, carry, batches):
    """`run(steps) -> (steps per second, steps per CPU second of this process)` of
    `carry = step(carry, batch)`, the carry kept across runs."""
    box = [carry]
    for b in batches[:3]:  # compile, and reach the steady state (a returned TrainState)
        box[0] = step(box[0], b)
    jax.block_until_ready(box[0])

    def run(steps: int) -> tuple[float, float]:
        carry = box[0]
        wall, cpu = time.perf_counter(), time.process_time()
        for i in range(steps):
            carry = step(carry, batches[i % len(batches)])
        jax.block_until_ready(carry)
        box[0] = carry
        return steps / (time.perf_counter() - wall), steps / (time.process_time() - cpu)

    return run


def ours(ts, batches):
    def step(carry, batch):
        ts, _ = carry
        ts, loss, _ = jn.train_step(loss_fn, ts, batch)
        return ts, loss

    return loop(step, (ts, None), batches)


def dict_ours(batches):
    ts = jn.TrainState.create(mlp_apply, dict_params(), {}, optax.adam(1e-3))
    return ours(ts, batches)


def dict_hand(batches):
    tx = optax.adam(1e-3)
    params = dict_params()
    opt = tx.init(params)

    @jax.jit(donate_argnums=(0, 1))
    def step(params, opt, x, y):
        def loss(p):
            return jnp.mean((mlp_apply(p, {}, x)[0] - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    def one(carry, batch):
        params, opt, _ = carry
        return step(params, opt, batch["x"], batch["y"])

    return loop(one, (params, opt, None), batches)


# ------------------------------------------------------------------------ NNX model


def nnx_ours(batches):
    model, params, state = jn.split_model(MLP(nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.adam(1e-3))
    return ours(ts, batches)


def nnx_hand_flat(batches):
    tx = optax.adam(1e-3)
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    opt = tx.init(leaves)

    @jax.jit(donate_argnums=(0, 1))
    def step(leaves, opt, x, y):
        def loss(flat):
            model = nnx.merge(graphdef, jax.tree.unflatten(treedef, flat))
            return jnp.mean((model(x) - y) ** 2)

        value, grads = jax.value_and_grad(loss)(leaves)
        updates, opt = tx.update(grads, opt, leaves)
        return optax.apply_updates(leaves, updates), opt, value

    def one(carry, batch):
        leaves, opt, _ = carry
        return step(leaves, opt, batch["x"], batch["y"])

    return loop(one, (leaves, opt, None), batches)


def nnx_hand_state(batches):
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

    def one(carry, batch):
        params, opt, _ = carry
        return step(params, opt, batch)

    return loop(one, (params, opt, None), batches)


#: case -> (what the user passes, jn.train_step loop, hand loop, batches)
CASES = {
    "dict-numpy": ("dict params, numpy batches", dict_ours, dict_hand, numpy_batches),
    "nnx-numpy": ("NNX model, numpy batches", nnx_ours, nnx_hand_flat, numpy_batches),
    "nnx-device": ("NNX model, batches on device", nnx_ours, nnx_hand_state, device_batches),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=500, help="steps per timed run")
    ap.add_argument("--repeats", type=int, default=31)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated: " + ", ".join(CASES))
    args = ap.parse_args()
    names = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(names) - set(CASES))
    if unknown:
        ap.error(f"unknown case(s) {unknown}; choose from {sorted(CASES)}")
    loops = {}
    for name in names:
        _, make_ours, make_hand, make_batches = CASES[name]
        batches = make_batches()
        loops[name] = (make_ours(batches), make_hand(batches))
    # speeds[case][side][clock]: side 0 = jn.train_step, 1 = hand; clock 0 = wall, 1 = CPU
    speeds = {n: ([], []) for n in names}
    for r in range(args.repeats):
        for name in names:  # both loops back to back, in alternating order
            for side in (0, 1) if r % 2 == 0 else (1, 0):
                speeds[name][side].append(loops[name][side](args.steps))
    print(f"{args.repeats} interleaved runs of {args.steps} steps each\n")
    print("| case | clock | jn.train_step steps/s | hand steps/s | × hand | per run (IQR) |")
    print("|---|---|---:|---:|---:|---:|")
    for name in names:
        for clock, label in ((0, "wall"), (1, "CPU")):
            o = [run[clock] for run in speeds[name][0]]
            h = [run[clock] for run in speeds[name][1]]
            q1, mid, q3 = statistics.quantiles([a / b for a, b in zip(o, h, strict=True)], n=4)
            om, hm = statistics.median(o), statistics.median(h)
            print(
                f"| {CASES[name][0]} | {label} | {om:,.0f} | {hm:,.0f} | {om / hm:.2f}× "
                f"| {mid:.2f}× ({q1:.2f}–{q3:.2f}) |"
            )


if __name__ == "__main__":
    main()
