"""Host augmentation feeding a small CNN: `data_wait_frac` with transform workers against the
same pipeline in a plain Python loop.

    python benchmarks/data.py [--epochs 3] [--workers 2] [--record]

The work: 32×32×3 uint8 images, per sample a random crop (4-pixel reflect padding) and a random
horizontal flip, then scaling to float32 (the script measures the ms of numpy per batch of
32 and prints it with the table), feeding a two-convolution CNN. Three ways, the same
samples, order and batch size:

  * plain loop: a re-iterable class that augments each batch in the training process (what a
    user writes without a data layer);
  * `jn.DataLoader(..., transform=augment, workers=0)`: the same transform in-process;
  * `jn.DataLoader(..., transform=augment, workers=N)`: in N forked worker processes.

and, as the ceiling no pipeline can pass, the same CNN on images augmented once beforehand
(no per-batch work at all).

Each run reports `data_wait_frac` (the share of training time the train program sat idle for
want of the next batch: time the loop spends in the data source while the previous step
still runs is not counted) and steps/s from its metrics.jsonl, averaged over the epochs after
the first (which compiles), medians over interleaved repeats. `--record` appends the table,
as ratios to the plain loop and to the ceiling, to benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import optax
from flax import nnx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))  # jaxnitro from this checkout

import jaxnitro as jn  # noqa: E402

os.environ.setdefault("JAXNITRO_NO_PLOT", "1")
N, BATCH, PAD = 2048, 32, 4


def augment(example, rng):
    """Random crop with reflect padding and a random flip; uint8 HWC -> float32 in [0, 1]."""
    img = np.pad(example["img"], ((PAD, PAD), (PAD, PAD), (0, 0)), mode="reflect")
    dy, dx = rng.integers(0, 2 * PAD + 1, size=2)
    img = img[dy : dy + 32, dx : dx + 32]
    if rng.random() < 0.5:
        img = img[:, ::-1]
    return {"img": img.astype(np.float32) / 255.0, "label": example["label"]}


class PlainLoop:
    """The same augmentation in a plain loop: shuffle by (seed, epoch), augment, stack."""

    def __init__(self, img, label, seed=0):
        self.img, self.label, self.seed, self.epoch = img, label, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return len(self.label) // BATCH

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.label))
        for b in range(len(self)):
            rows = order[b * BATCH : (b + 1) * BATCH]
            outs = [
                augment(
                    {"img": self.img[i], "label": self.label[i]},
                    jn.data.sample_rng(self.seed, self.epoch, int(i)),
                )
                for i in rows
            ]
            yield {k: np.stack([o[k] for o in outs]) for k in ("img", "label")}


class CNN(nnx.Module):
    def __init__(self, rngs):
        self.c1 = nnx.Conv(3, 8, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(8, 16, (3, 3), rngs=rngs)
        self.out = nnx.Linear(16 * 8 * 8, 10, rngs=rngs)

    def __call__(self, x):
        x = nnx.avg_pool(jax.nn.relu(self.c1(x)), (2, 2), (2, 2))
        x = nnx.avg_pool(jax.nn.relu(self.c2(x)), (2, 2), (2, 2))
        return self.out(x.reshape(x.shape[0], -1))


@jn.experiment
class AugCNN:
    max_epochs: int = 3

    def build_model(self, rng):
        return jn.split_model(CNN(nnx.Rngs(rng)))

    def build_data(self, dist):
        raise NotImplementedError  # passed as Nitro(data=...)

    def forward(self, model, params, state, *, img):
        return jn.apply(model, params, state, img)

    def loss(self, logits, *, label):
        return optax.softmax_cross_entropy_with_integer_labels(logits, label).mean()


def run(name, train, epochs, root) -> dict:
    n = jn.Nitro(
        AugCNN(max_epochs=epochs),
        data={"train": train},
        run_dir=root / name,
        progress=False,
        checkpointer=False,
    )
    t0 = time.perf_counter()
    jn.train(n)
    wall = time.perf_counter() - t0
    close = getattr(train, "close", None)
    if close:
        close()
    rows = [r for r in jn.read_jsonl(root / name / "metrics.jsonl") if r.get("context") == "data"]
    steady = rows[1:] or rows
    return {
        "name": name,
        "data_wait_frac": float(np.mean([r["data_wait_frac"] for r in steady])),
        "steps_per_s": float(np.mean([r["steps_per_s"] for r in steady])),
        "wall_s": wall,
    }


def per_batch_ms(img, label) -> float:
    loop = PlainLoop(img, label)
    it = iter(loop)
    next(it)
    t0 = time.perf_counter()
    for _ in range(10):
        next(it)
    return (time.perf_counter() - t0) * 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs; medians reported")
    ap.add_argument("--record", action="store_true", help="append the table to RESULTS.md")
    args = ap.parse_args()
    jn.setup_devices(backend="cpu")
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, size=(N, 32, 32, 3), dtype=np.uint8)
    label = rng.integers(0, 10, size=N).astype(np.int32)
    ms = per_batch_ms(img, label)

    def loader(workers):
        return jn.DataLoader(
            {"img": img, "label": label},
            batch_size=BATCH,
            shuffle=True,
            drop_last=True,
            seed=0,
            transform=augment,
            workers=workers,
        )

    once = PlainLoop(img, label)  # epoch 0's augmentation, stored: no per-batch work
    pre = {k: np.concatenate([b[k] for b in once]) for k in ("img", "label")}
    ways = {
        "plain loop": lambda: PlainLoop(img, label),
        "jn.DataLoader workers=0": lambda: loader(0),
        "jn.DataLoader workers=1": lambda: loader(1),
        f"jn.DataLoader workers={args.workers}": lambda: loader(args.workers),
        "ceiling: augmented beforehand": lambda: jn.DataLoader(
            pre, batch_size=BATCH, shuffle=True, drop_last=True, seed=0
        ),
    }
    runs: dict[str, list] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):  # interleaved, so a drifting machine hits all alike
            for name, make in ways.items():
                runs[name].append(run(name, make(), args.epochs, Path(tmp) / str(rep)))
    results = [
        {
            "name": name,
            **{k: float(np.median([r[k] for r in rs])) for k in ("data_wait_frac", "steps_per_s")},
            "repeats": rs,
        }
        for name, rs in runs.items()
    ]
    base, ceiling = results[0], results[-1]
    lines = [
        f"Data pipeline (`benchmarks/data.py`, {datetime.date.today()}): random crop + flip of "
        f"32×32 images, {ms:.1f} ms of numpy per batch of {BATCH}, feeding a 2-conv CNN, "
        f"{os.cpu_count()} cores, medians of {args.repeats} interleaved runs of epochs "
        f"2–{args.epochs} (load average "
        f"{os.getloadavg()[0]:.1f}: a shared machine, read the ratios as ranges):",
        "",
        "| pipeline | data_wait_frac | steps/s | × plain loop | × ceiling |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['name']} | {r['data_wait_frac']:.1%} | {r['steps_per_s']:.0f} | "
            f"{r['steps_per_s'] / base['steps_per_s']:.2f}× | "
            f"{r['steps_per_s'] / ceiling['steps_per_s']:.2f}× |"
        )
    table = "\n".join(lines)
    print(table)
    print(json.dumps(results, indent=1))
    if args.record:
        with open(HERE / "RESULTS.md", "a") as f:
            f.write("\n" + table + "\n")


if __name__ == "__main__":
    main()
