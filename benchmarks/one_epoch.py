"""A fresh handle's one-epoch run against a kept handle's next epoch and the hand loop.

    PYTHONPATH=src python benchmarks/one_epoch.py [--repeats 6] [--batch 32]

The MNIST-shaped MLP of `run.py` in one process, three contenders in rotating order:

- fresh: a new `jn.Nitro` trained one epoch (`max_epochs=1`), its programs already in the
  process (the set-up, the data put on the device, the first epoch's threads and read-backs
  count; the compiles do not, as in `run.py`'s one-epoch rows);
- kept: one handle trained one epoch further per repeat (`jn.train` again);
- hand: the hand-written `jax.jit` loop with numpy batches (`run.py`'s reference).

Reported: steps/s per repeat (jaxnitro's from its epoch: `TrainResult.steps_per_second`) and
the median of the per-repeat ratios to the hand loop. Issue 47 found the fresh handle's
epoch 13% slower than the kept one's, through the whole epoch: the copy of the arrays put on
the device at set-up still ran beside it (`feed.stage_train` now waits for it).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "src"))

import run as bench  # noqa: E402

import jaxnitro as jn  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args(argv)
    batch = args.batch
    case = dict(name=f"mlp{batch}", kind="mlp", batch=batch, samples=batch * 2048)
    data = bench.make_data(case)
    hand = bench.HandLoop(case, data, "host")
    hand.timed()  # its first pass compiles
    hand.rates.clear()
    workdir = Path(tempfile.mkdtemp(prefix="jaxnitro-one-epoch-"))

    def handle(name: str) -> jn.Nitro:
        return jn.Nitro(
            bench.experiment_for(case),
            data={"train": jn.DataLoader(data, batch, drop_last=True)},
            run_dir=workdir / name,
            progress=False,
            max_epochs=1,
        )

    jn.train(handle("warm"))  # the programs compiled once, for every handle after
    kept = handle("kept")
    jn.train(kept)
    rates: dict[str, list[float]] = {"fresh": [], "kept": [], "hand": []}

    def fresh() -> None:
        n = handle(f"fresh{len(rates['fresh'])}")
        rates["fresh"].append(jn.train(n).steps_per_second)
        del n
        gc.collect()

    def next_epoch() -> None:
        kept.max_epochs += 1
        rates["kept"].append(jn.train(kept).steps_per_second)

    def hand_loop() -> None:
        hand.timed()
        rates["hand"].append(hand.rates[-1])

    sides = [fresh, next_epoch, hand_loop]
    for r in range(args.repeats):
        for side in sides[r % 3 :] + sides[: r % 3]:
            side()
    out = {}
    for name, got in rates.items():
        ratio = statistics.median(a / b for a, b in zip(got, rates["hand"], strict=True))
        out[name] = {"steps_per_s": [round(x) for x in got], "x_hand": round(ratio, 3)}
        print(f"{name:5} × hand {ratio:.3f}  steps/s {[round(x) for x in got]}")
    return out


if __name__ == "__main__":
    main()
