"""How long an epoch-end checkpoint stalls training: background writes against foreground ones.

A 10 MB model (an MLP 784→1536→1536→10, 2.6M float32 parameters; with Adam's two moments
about 30 MB written per checkpoint) trains for `--epochs` epochs of `--steps` steps. Each
checkpoint's stall (the time training waits: the copy to host memory) is read from the run's
log, and set against the epoch's time and against writing the same checkpoint in the
foreground.

    python benchmarks/checkpoint.py [--epochs 3] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

import jaxnitro as jn

jn.setup_devices(backend="cpu")


class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(784, 1536, rngs=rngs)
        self.l2 = nnx.Linear(1536, 1536, rngs=rngs)
        self.l3 = nnx.Linear(1536, 10, rngs=rngs)

    def __call__(self, x):
        return self.l3(jax.nn.relu(self.l2(jax.nn.relu(self.l1(x)))))


@jn.experiment
class Big:
    steps: int = 200
    max_epochs: int = 3

    def build_model(self, rng):
        return jn.split_model(MLP(rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.steps * 32, 784)).astype(np.float32)
        y = rng.integers(0, 10, self.steps * 32).astype(np.int32)
        return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32, drop_last=True)}

    def optimizer(self, group):
        return optax.adam

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        n = jn.Nitro(Big(steps=args.steps, max_epochs=args.epochs), run_dir=d, progress=False)
        result = jn.train(n)
        lines = [json.loads(s) for s in (Path(d) / "metrics.jsonl").read_text().splitlines()]
        stalls = [r["checkpoint_stall_s"] for r in lines if "checkpoint_stall_s" in r]
        epoch_s = args.steps / result.steps_per_second
        ts = n.train_state
        trees = {"params": ts.params, "model_state": ts.state, "opt_state": ts.opt_state}
        fg = []
        for i in range(3):
            ck = jn.TopKCheckpointer(dir=Path(d) / f"fg{i}")
            t0 = time.perf_counter()
            ck.save(epoch=1, step=1, metrics={}, trees=trees, meta={})
            fg.append(time.perf_counter() - t0)
        size = sum(x.nbytes for x in jax.tree.leaves(trees))
    stall, write = statistics.median(stalls), statistics.median(fg)
    print(f"{size / 2**20:.1f} MiB per checkpoint, epoch {epoch_s:.2f} s ({args.steps} steps)")
    print("| checkpoint | training waits (median) | × epoch time |\n|---|---:|---:|")
    print(f"| background (the default) | {stall * 1e3:.1f} ms | {stall / epoch_s:.1%} |")
    print(f"| foreground | {write * 1e3:.1f} ms | {write / epoch_s:.1%} |")
    print(f"stalls: {', '.join(f'{s * 1e3:.1f}' for s in stalls)} ms")


if __name__ == "__main__":
    main()
