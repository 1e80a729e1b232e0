"""Issue 47's before/after, interleaved in one process: the per-step host work it cut.

    PYTHONPATH=src python benchmarks/host_ab.py [--before cfa5a4a] [--repeats 9]

`host.py` measures each tree in its own process; on a shared machine the load moves between
two processes more than the change. This loads the old modules from git (`--before`, default
the last commit before issue 47) beside this tree's and times, in alternating order:

- rows: a read-back chunk of 16 single-step calls (MLP batch 32: `loss`, a fixed rate, the
  chunk's rates) turned into step lines and written to the run's `metrics.jsonl`: before,
  `step_rows` and `_step_row` per step (a `log_metrics` call, a JSON encode and a write per
  line); after, `read_columns` and `chunk_lines` (one call, one encode, one write). Both read
  the same outputs back (ready: no wait for the device). With `--before` a tree that already
  reads chunks (4f134c4, before issue 43 made the epoch one function), its `_chunk_rows`
  against this tree's `chunk_lines`: the same work, reshaped.
- feed: one ask per step of an epoch of 2,048 batches (row indices of arrays kept on the
  device): the `WaitClock` around the loader's `iter_rows`, with the device busy.

Reported: µs per step (median of the repeats) and old/new, the median of per-repeat ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "src"))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import run as bench  # noqa: E402
from old_tree import old_module  # noqa: E402

import jaxnitro as jn  # noqa: E402
from jaxnitro._src.data import waits  # noqa: E402
from jaxnitro._src.train.readback import InFlight, read_back, read_columns, step_rows  # noqa: E402
from jaxnitro._src.train.steplines import Lines, chunk_lines  # noqa: E402


def old_iter_rows(loader, start: int, count: int):
    """`DataLoader.iter_rows` before issue 47: an arange, an astype and a reshape per group."""
    order, bs = loader._order(), loader.batch_size
    full = loader.num_samples // bs
    for i in range(start, full, count):
        k = min(count, full - i)
        lo, hi = i * bs, (i + k) * bs
        rows = np.arange(lo, hi) if order is None else order[lo:hi]
        yield {"rows": rows.astype(np.int32).reshape(k, bs)}, k


class Busy:
    """An output whose step is still running."""

    def is_ready(self) -> bool:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="cfa5a4a", help="the commit to compare against")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--chunks", type=int, default=200, help="read-back chunks per repeat")
    args = ap.parse_args()
    old_epoch = old_module("old_epoch", "src/jaxnitro/_src/train/epoch.py", args.before)
    old_waits = old_module("old_waits", "src/jaxnitro/_src/data/waits.py", args.before)

    case = dict(name="mlp32", kind="mlp", batch=32, samples=32 * 2048)
    data = bench.make_data(case)
    with tempfile.TemporaryDirectory() as tmp:
        n = jn.Nitro(
            bench.experiment_for(case),
            data={"train": jn.DataLoader(data, 32, drop_last=True)},
            run_dir=Path(tmp) / "run",
            progress=False,
            max_epochs=1,
        )
        jn.train(n)
        n.logger.open(n.run_dir, resume=True)
        items = [InFlight(i + 1, i + 1, 1, {"loss": jnp.float32(2.3 + i / 100)}) for i in range(16)]
        new, old = Lines.of(n, 1), old_epoch._Cursor(n, 1)
        rates = old.rates = {"samples_per_s": 1234.5}
        old.fire = False

        def rows_new():
            chunk_lines(new, items, read_columns(items, on_host=True), rates)

        def rows_old():
            if hasattr(old, "_chunk_rows"):  # a tree after issue 47 (issue 43's before)
                old._chunk_rows(items, read_columns(items, on_host=True))
                return
            for item, host in zip(items, read_back(items, on_host=True), strict=True):
                for row in step_rows(item, host, accum=1, members=False):
                    old._step_row(row, None)

        loader, busy = jn.DataLoader(data, 32, drop_last=True), Busy()
        res: dict[str, list[float]] = {f"{w} {s}": [] for w in ("rows", "feed") for s in "ab"}
        for r in range(args.repeats):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                fn = rows_old if side == "a" else rows_new
                t0 = time.perf_counter()
                for _ in range(args.chunks):
                    fn()
                res[f"rows {side}"].append((time.perf_counter() - t0) / args.chunks / 16 * 1e6)
                clock = (old_waits if side == "a" else waits).WaitClock(lambda: busy)
                source = old_iter_rows(loader, 0, 1) if side == "a" else loader.iter_rows(0, 1)
                t0 = time.perf_counter()
                for _ in range(2048):
                    clock.run(lambda: next(source))  # noqa: B023 - called at once
                res[f"feed {side}"].append((time.perf_counter() - t0) / 2048 * 1e6)
        n.logger.close()
    print(f"{args.repeats} interleaved repeats; before = {args.before}, after = this tree\n")
    print("| per step | before µs | after µs | before / after (per-repeat median) |")
    print("|---|---:|---:|---:|")
    for what in ("rows", "feed"):
        a, b = res[f"{what} a"], res[f"{what} b"]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(
            f"| {what} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.2f}× |"
        )


if __name__ == "__main__":
    main()
