"""Issue 43's before/after of the epoch loop, interleaved on one handle in one process.

    PYTHONPATH=src python benchmarks/loop_ab.py [--before 4f134c4] [--repeats 9] [--batch 32]

`host.py` measures each tree in its own process; on a shared machine the load moves between
two processes more than the change. This loads the old `train/epoch.py` (and the
`run/commands.py` it calls) from git (`--before`, default the last commit before the loop
became one function) beside this tree's, and runs whole epochs of the MNIST-shaped MLP of
`run.py` (batch 32: the step is short, so the host's work per step shows) through each
`run_epoch` in turn, in alternating order, on the same handle (its programs compiled once).

Reported per side: µs per step of the epoch's train time (compiles apart), of its host time
(`host_s`: the driver's own Python between dispatches), of this process's CPU time (XLA's
threads too), and of the training thread's CPU time (`thread`: the loop's own work and the
dispatches, which a loaded machine moves least); and
before/after, the median of the per-repeat ratios (above 1: after is faster).
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

import run as bench  # noqa: E402
from old_tree import old_module  # noqa: E402

import jaxnitro as jn  # noqa: E402
from jaxnitro._src.train import epoch as new_epoch  # noqa: E402


def stub(n) -> None:
    """Each train program of `n` replaced by one that returns its inputs' state at once, with
    a loss already computed (ready: no wait at read-back)."""
    import dataclasses

    import jax.numpy as jnp

    out = {"loss": jnp.float32(0.5)}
    for key, prog in n.programs.train.items():
        n.programs.train[key] = dataclasses.replace(
            prog, compiled=lambda leaves, batch, extras, hyper: (leaves, out)
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="4f134c4", help="the commit to compare against")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2048, help="steps per epoch")
    ap.add_argument(
        "--stub",
        action="store_true",
        help="the train program replaced by a function that returns at once: the loop's own "
        "work per step alone (no device work to hide it)",
    )
    args = ap.parse_args()
    old_epoch = old_module("old_epoch", "src/jaxnitro/_src/train/epoch.py", args.before)
    old_epoch.commands = old_module(
        "old_commands", "src/jaxnitro/_src/run/commands.py", args.before
    )
    nitro_cls = jn.Nitro
    if not hasattr(nitro_cls, "_commit"):  # the old loop hands over through `_commit`
        nitro_cls._commit = lambda self, **parts: self.take(**parts)

    case = dict(name="mlp", kind="mlp", batch=args.batch, samples=args.batch * args.steps)
    data = bench.make_data(case)
    res: dict[str, list[float]] = {
        f"{w} {s}": [] for w in ("wall", "host", "cpu", "thread") for s in "ab"
    }
    with tempfile.TemporaryDirectory() as tmp:
        n = jn.Nitro(
            bench.experiment_for(case),
            data={"train": jn.DataLoader(data, args.batch, drop_last=True)},
            run_dir=Path(tmp) / "run",
            progress=False,
            max_epochs=1,
        )
        jn.train(n)  # the programs compiled, the threads started
        if args.stub:
            stub(n)
        n.logger.open(n.run_dir, resume=True)
        n.services.control.begin()
        for r in range(args.repeats):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                module = old_epoch if side == "a" else new_epoch
                cpu, thread = time.process_time(), time.thread_time()
                done = module.run_epoch(n, n.epoch)
                cpu, thread = time.process_time() - cpu, time.thread_time() - thread
                split = done.clock.split(done.data_wait_s)
                res[f"wall {side}"].append(done.seconds / done.steps * 1e6)
                res[f"host {side}"].append(split["host_s"] / done.steps * 1e6)
                res[f"cpu {side}"].append(cpu / done.steps * 1e6)
                res[f"thread {side}"].append(thread / done.steps * 1e6)
        n.services.control.clear()
        n.logger.close()
    print(
        f"{args.repeats} interleaved epochs each of {args.steps} steps (MLP, batch {args.batch});"
    )
    print(f"before = {args.before}, after = this tree\n")
    print("| per step | before µs | after µs | before / after (per-repeat median) |")
    print("|---|---:|---:|---:|")
    for what in ("wall", "host", "cpu", "thread"):
        a, b = res[f"{what} a"], res[f"{what} b"]
        ratio = statistics.median(x / y for x, y in zip(a, b, strict=True))
        print(
            f"| {what} | {statistics.median(a):.1f} | {statistics.median(b):.1f} | {ratio:.2f}× |"
        )


if __name__ == "__main__":
    main()
