"""The CPU compile defaults (`compile/backend_options.py`) against XLA's own, per program and
batch size, each pair in one process.

    PYTHONPATH=src python benchmarks/compile_options_ab.py [--cases mlp32,mlp256,mlp1024,cnn,gpt]
                                                           [--passes 5] [--nitro 32,1024]

For each case of `run.py`: its hand-written `jax.jit` step lowered once and compiled twice,
with `backend_options.CPU` and with XLA's defaults, then run over the case's batches in
alternating passes (each pass on a copy of the state). For `--nitro` batch sizes: two
`jn.Nitro` handles of the MNIST MLP, one with `compile_options=backend_options.CPU` and one
with `compile_options={}`, trained one epoch further in alternating order. Reported: the
median of the per-pass ratios, the option's steps/s over XLA's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent / "src"))

import jax  # noqa: E402
import run as bench  # noqa: E402  (the cases, their data and hand loops)

import jaxnitro as jn  # noqa: E402
from jaxnitro._src.compile import backend_options  # noqa: E402

CASES = {
    "mlp32": dict(name="mlp32", kind="mlp", batch=32, samples=32 * 2048),
    "mlp256": dict(name="mlp256", kind="mlp", batch=256, samples=256 * 128),
    "mlp1024": dict(name="mlp1024", kind="mlp", batch=1024, samples=1024 * 64),
    "cnn": dict(name="cnn", kind="cnn", batch=64, samples=64 * 32, fused=False),
    "gpt": dict(
        name="gpt", kind="gpt", batch=8, samples=8 * 16, gpt="tiny", attention=None, precision=None
    ),
}


def alternate(runs: dict, passes: int) -> dict:
    """Steps/s of each of `runs` (name -> callable giving steps/s), in alternating order."""
    rates: dict[str, list[float]] = {k: [] for k in runs}
    for p in range(passes):
        for k in list(runs) if p % 2 else list(runs)[::-1]:
            rates[k].append(runs[k]())
    ratio = statistics.median(a / b for a, b in zip(rates["option"], rates["xla"], strict=True))
    return {
        "ratio": round(ratio, 3),
        **{k: round(statistics.median(v), 1) for k, v in rates.items()},
    }


def hand(case: dict, passes: int) -> dict:
    data = bench.make_data(case)
    loop = bench.HandLoop(case, data, "host")
    loop.timed()  # compiled by jit, warmed
    lowered = loop.fn.lower(loop.params, loop.opt_state, loop.inputs[0])
    programs = {
        "option": lowered.compile(compiler_options=backend_options.CPU),
        "xla": lowered.compile(),
    }

    def runner(program):
        def run() -> float:
            params, opt = jax.tree.map(lambda a: a.copy(), (loop.params, loop.opt_state))
            t0 = time.perf_counter()
            for batch in loop.inputs:
                params, opt, value = program(params, opt, batch)
            jax.block_until_ready(value)
            return len(loop.inputs) / (time.perf_counter() - t0)

        run()  # warm
        return run

    return alternate({k: runner(p) for k, p in programs.items()}, passes)


def nitro(batch: int, passes: int, workdir: Path) -> dict:
    case = dict(CASES["mlp32"], batch=batch, samples=CASES[f"mlp{batch}"]["samples"])
    data = bench.make_data(case)
    handles = {}
    for side, options in (("option", backend_options.CPU), ("xla", {})):
        n = jn.Nitro(
            bench.experiment_for(case),
            data={"train": jn.DataLoader(data, batch, drop_last=True)},
            run_dir=workdir / f"{side}{batch}",
            progress=False,
            max_epochs=1,
            compile_options=options,
        )
        jn.train(n)  # compiled; the epochs timed are the later ones
        handles[side] = n

    def runner(n):
        def run() -> float:
            n.max_epochs = n.epoch + 1
            jn.train(n)
            lines = jn.read_jsonl(Path(n.run_dir) / "metrics.jsonl")
            return [r for r in lines if r.get("context") == "epoch"][-1]["steps_per_s"]

        return run

    return alternate({k: runner(n) for k, n in handles.items()}, passes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="mlp32,mlp256,mlp1024,cnn,gpt")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--nitro", default="32,1024", help="batch sizes of the jaxnitro pairs")
    args = ap.parse_args()
    if jax.default_backend() != "cpu" or not backend_options.cpu_known():
        sys.exit("this compares CPU programs: run it on a CPU with a jaxlib that knows the option")
    results = {}
    for name in [c for c in args.cases.split(",") if c]:
        results[f"hand {name}"] = hand(CASES[name], args.passes)
        print(f"hand {name}: {json.dumps(results[f'hand {name}'])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="jaxnitro-options-") as tmp:
        for b in [int(b) for b in args.nitro.split(",") if b]:
            results[f"jaxnitro mlp{b}"] = nitro(b, args.passes, Path(tmp))
            print(f"jaxnitro mlp{b}: {json.dumps(results[f'jaxnitro mlp{b}'])}", flush=True)
    print("\n| program | option × XLA's defaults | option steps/s | XLA's steps/s |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['ratio']:.3f}× | {r['option']:,} | {r['xla']:,} |")


if __name__ == "__main__":
    main()
