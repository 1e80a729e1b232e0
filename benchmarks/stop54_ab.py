"""Issue 47, stop 54's before/after, interleaved on one handle in one process.

    PYTHONPATH=src python benchmarks/stop54_ab.py [--before 1d931a9] [--repeats 10] [--batch 32]

`host.py` measures each tree in its own process; on a shared machine whose speed moves ~1.5×
within an hour, that moves more than a few percent. This loads the pieces stop 54 changed as
they were at `--before` (the JSON logger's column encoder, the chunk's step lines, the
read-back of a chunk, the bar's update) beside this tree's, and sends the constant
hyperparameters as numpy (before) or as one device array (after). Whole epochs of the
MNIST-shaped MLP of `run.py` run on the same handle (its programs compiled once; the same
program serves both sides), in alternating order.

Reported per side: steps/s (`jn.train`'s), µs per step of the training thread's CPU time in
the epoch loop (its own work, the dispatches, and its waits where they spin), and of the
read-back chunk's work
(the drain less its read-back, wall time and thread CPU time); after/before, the median of
the per-repeat ratios (above 1: after is faster).
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

import host  # noqa: E402  (first: Keras' environment, then the MLP and its hand loop)
from old_tree import old_module  # noqa: E402

import jaxnitro as jn  # noqa: E402
from jaxnitro._src.data import feed  # noqa: E402
from jaxnitro._src.observe import display  # noqa: E402
from jaxnitro._src.observe.loggers import jsonl  # noqa: E402
from jaxnitro._src.train import driver  # noqa: E402
from jaxnitro._src.train import epoch as epoch_mod  # noqa: E402


class _HostHyper:
    """`feed.jnp` for the before side: the constant hyperparameters stay numpy."""

    @staticmethod
    def asarray(x):
        return x


def sides(before: str) -> dict[str, dict]:
    """The patches of each side: (owner, attribute) -> value."""
    src = "src/jaxnitro/_src/"
    old_jsonl = old_module("old_jsonl", src + "observe/loggers/jsonl.py", before)
    old_lines = old_module("old_steplines", src + "train/steplines.py", before)
    old_read = old_module("old_readback", src + "train/readback.py", before)
    old_display = old_module("old_display", src + "observe/display.py", before)
    now = {
        (jsonl, "_encode_columns"): jsonl._encode_columns,
        (epoch_mod, "chunk_lines"): epoch_mod.chunk_lines,
        (epoch_mod, "read_columns"): epoch_mod.read_columns,
        (display.Display, "update"): display.Display.update,
        (feed, "jnp"): feed.jnp,
    }
    then = {
        (jsonl, "_encode_columns"): old_jsonl._encode_columns,
        (epoch_mod, "chunk_lines"): old_lines.chunk_lines,
        (epoch_mod, "read_columns"): old_read.read_columns,
        (display.Display, "update"): old_display.Display.update,
        (feed, "jnp"): _HostHyper,
    }
    return {"before": then, "after": now}


def one_epoch(n, patches: dict, steps: int) -> dict[str, float]:
    """One more epoch with `patches` applied: steps/s, and µs per step of the training
    thread's CPU time and of the chunk's work (wall and thread CPU)."""
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    feed_drain, feed_read = epoch_mod._drain, epoch_mod.read_columns
    spent = {"drain": 0.0, "read": 0.0, "drain_cpu": 0.0, "read_cpu": 0.0}

    def timed(fn, wall: str, cpu: str):
        def run(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[wall] += time.perf_counter() - t0
                spent[cpu] += time.thread_time() - c0

        return run

    epoch_mod._drain = timed(feed_drain, "drain", "drain_cpu")
    epoch_mod.read_columns = timed(feed_read, "read", "read_cpu")
    n.max_epochs = n.epoch + 1
    real_epoch, thread = driver.run_epoch, [0.0]

    def run_epoch(*args):  # the epoch loop alone (no set-up, checkpoint or epoch line)
        c0 = time.thread_time()
        try:
            return real_epoch(*args)
        finally:
            thread[0] += time.thread_time() - c0

    driver.run_epoch = run_epoch
    try:
        result = jn.train(n)
    finally:
        epoch_mod._drain, epoch_mod.read_columns = feed_drain, feed_read
        driver.run_epoch = real_epoch
    per = 1e6 / steps
    return {
        "steps_per_s": result.steps_per_second,
        "thread_us": thread[0] * per,
        "chunk_us": (spent["drain"] - spent["read"]) * per,
        "chunk_cpu_us": (spent["drain_cpu"] - spent["read_cpu"]) * per,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="1d931a9", help="the tree to compare against")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--batch", type=int, default=32, choices=sorted(host.SAMPLES))
    args = ap.parse_args()
    patches = sides(args.before)
    case = dict(
        name=f"mlp{args.batch}", kind="mlp", batch=args.batch, samples=host.SAMPLES[args.batch]
    )
    data = host.bench.make_data(case)
    steps = case["samples"] // args.batch
    with tempfile.TemporaryDirectory(prefix="jaxnitro-ab-") as tmp:
        n = jn.Nitro(
            host.bench.experiment_for(case),
            data={"train": jn.DataLoader(data, args.batch, drop_last=True)},
            run_dir=Path(tmp) / "ab",
            progress=False,
            max_epochs=1,
        )
        jn.train(n)  # compiles; the first epoch's start-up
        for name in ("before", "after"):
            one_epoch(n, patches[name], steps)  # each side's code warm
        got: dict[str, list[dict]] = {"before": [], "after": []}
        for r in range(args.repeats):
            for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
                got[name].append(one_epoch(n, patches[name], steps))
        one_epoch(n, patches["after"], steps)  # (this tree's code back in place)
        compiled = jn.cache_stats()["misses"]
    print(f"MLP batch {args.batch}, {args.repeats} epochs a side, before = {args.before}")
    print("| side | steps/s | thread CPU µs/step | chunk's work µs/step (wall / CPU) |")
    print("|---|---:|---:|---:|")
    for name, runs in got.items():
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(
            f"| {name} | {med['steps_per_s']:,.0f} | {med['thread_us']:.1f} "
            f"| {med['chunk_us']:.1f} / {med['chunk_cpu_us']:.1f} |"
        )
    pairs = list(zip(got["after"], got["before"], strict=True))
    speed = statistics.median(a["steps_per_s"] / b["steps_per_s"] for a, b in pairs)
    print(f"\nafter/before steps/s: {speed:.3f}× (per repeat: ", end="")
    print(", ".join(f"{a['steps_per_s'] / b['steps_per_s']:.2f}" for a, b in pairs) + ")")
    print(f"programs compiled in the process: {compiled}")


if __name__ == "__main__":
    main()
