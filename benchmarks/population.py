"""Population training against sequential runs and a hand-written `vmap`, in one process.

N small MLP members (a 32→64→64→10 MLP, batches of 64, Adam) trained three ways on the same
data: `jn.Nitro(exp, population=N)` (one program for all members), N sequential `jn.Nitro`
runs, and a hand-written `jax.jit(jax.vmap(step))` loop that sends each batch per step.
Throughput is member-steps per second of training (compiles excluded), median of `--repeats`
interleaved runs, reported as ratios.

    python benchmarks/population.py [--members 8] [--epochs 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn

jn.setup_devices(backend="cpu")
N_TRAIN, BATCH = 8192, 64


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(32, 64, rngs=rngs)
        self.l2 = nnx.Linear(64, 64, rngs=rngs)
        self.l3 = nnx.Linear(64, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N_TRAIN, 32)).astype(np.float32)
    y = (x[:, :10] + 0.5 * rng.normal(size=(N_TRAIN, 10))).argmax(-1).astype(np.int32)
    return x, y


@jn.experiment
class Members:
    max_epochs: int = 3

    def build_model(self, rng):
        return jn.split_model(MLP(rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        x, y = data()
        return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=BATCH, drop_last=True)}

    def optimizer(self, group):
        return optax.adam

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def _run(epochs: int, **kw) -> tuple[int, float]:
    """(member-steps, seconds of training) of one jaxnitro run."""
    with tempfile.TemporaryDirectory() as d:
        n = jn.Nitro(Members(max_epochs=epochs), run_dir=d, progress=False, logger=False, **kw)
        result = jn.train(n)
        members = kw.get("population", 1)
        steps = n.step * members
        return steps, steps / (result.steps_per_second * members)


def population(members: int, epochs: int) -> float:
    steps, seconds = _run(epochs, population=members)
    return steps / seconds


def sequential(members: int, epochs: int) -> float:
    total_steps, total_s = 0, 0.0
    for i in range(members):
        steps, seconds = _run(epochs, seed=42 + i)
        total_steps, total_s = total_steps + steps, total_s + seconds
    return total_steps / total_s


def hand_vmap(members: int, epochs: int) -> float:
    x, y = data()
    tx = optax.adam(1e-3)
    graphdef, _ = nnx.split(MLP(rngs=nnx.Rngs(0)), nnx.Param)
    params = jax.vmap(lambda k: nnx.split(MLP(rngs=nnx.Rngs(k)), nnx.Param)[1])(
        jax.random.split(jax.random.PRNGKey(0), members)
    )
    opt = jax.vmap(tx.init)(params)

    def one(p, o, xb, yb):
        def loss(p):
            logits = nnx.merge(graphdef, p)(xb)
            return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

        value, grads = jax.value_and_grad(loss)(p)
        updates, o = tx.update(grads, o, p)
        return optax.apply_updates(p, updates), o, value

    step = jax.jit(jax.vmap(one, in_axes=(0, 0, None, None)), donate_argnums=(0, 1))
    params, opt, value = step(params, opt, x[:BATCH], y[:BATCH])  # compile
    jax.block_until_ready(value)
    per_epoch = N_TRAIN // BATCH
    t = time.perf_counter()
    for _ in range(epochs):
        for i in range(per_epoch):
            s = slice(i * BATCH, (i + 1) * BATCH)
            params, opt, value = step(params, opt, x[s], y[s])
    jax.block_until_ready(value)
    return members * epochs * per_epoch / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rows: dict[str, list[float]] = {"population": [], "sequential": [], "hand vmap": []}
    for _ in range(args.repeats):  # interleaved, so drift on a shared machine hits all three
        rows["population"].append(population(args.members, args.epochs))
        rows["sequential"].append(sequential(args.members, args.epochs))
        rows["hand vmap"].append(hand_vmap(args.members, args.epochs))
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{args.members} members, {args.epochs} epochs of {N_TRAIN // BATCH} steps, CPU")
    print("| way | member-steps/s (median) | × sequential | × hand vmap | runs |")
    print("|---|---|---|---|---|")
    for k, v in med.items():
        runs = ", ".join(f"{r:,.0f}" for r in rows[k])
        print(
            f"| {k} | {v:,.0f} | {v / med['sequential']:.2f}× | {v / med['hand vmap']:.2f}× "
            f"| {runs} |"
        )


if __name__ == "__main__":
    main()
