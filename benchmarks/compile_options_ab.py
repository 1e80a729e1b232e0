"""The CPU compile defaults (`compile/backend_options.py`) against XLA's own, per program and
batch size, each pair in one process.

    PYTHONPATH=src python benchmarks/compile_options_ab.py [--cases tiny,mlp32,mlp256,...]
                                        [--passes 5] [--nitro 32,1024] [--one-thread]

For each case of `run.py` (and `tiny`, `train_step_cost.py`'s 2-32-2 MLP step): its
hand-written `jax.jit` step lowered once and compiled twice, with `backend_options.CPU`
(resolved for the program, `backend_options.resolve`) and with XLA's defaults, then run over
the case's batches in alternating passes (each pass on a copy of the state). For `--nitro`
batch sizes: two `jn.Nitro` handles of the MNIST MLP, one with
`compile_options=backend_options.CPU` and one with `compile_options={}`, trained one epoch
further in alternating order. With `--one-thread` the second side is the defaults without
`ONE_THREAD` (YNNPACK fusion off alone): what one-thread Eigen adds. Reported: the median of
the per-pass ratios, the defaults' steps/s over the other side's.
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
    "tiny": dict(name="tiny", kind="tiny", batch=32),
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


def sides(one_thread: bool) -> dict[str, dict]:
    """The two option sets compared: the CPU defaults against XLA's own, or (`one_thread`)
    against the same defaults without `ONE_THREAD` (YNNPACK fusion off alone)."""
    if one_thread:
        ynn_only = {k: v for k, v in backend_options.CPU.items() if k != backend_options.ONE_THREAD}
        return {"option": dict(backend_options.CPU), "xla": ynn_only}
    return {"option": dict(backend_options.CPU), "xla": {}}


def compiled_both(lowered, options: dict[str, dict]) -> dict:
    return {
        side: lowered.compile(compiler_options=backend_options.resolve(o, lowered) or None)
        for side, o in options.items()
    }


def hand(case: dict, passes: int, options: dict[str, dict]) -> dict:
    if case["kind"] == "tiny":
        return tiny(passes, options)
    data = bench.make_data(case)
    loop = bench.HandLoop(case, data, "host")
    loop.timed()  # compiled by jit, warmed
    lowered = loop.fn.lower(loop.params, loop.opt_state, loop.inputs[0])
    programs = compiled_both(lowered, options)

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


def tiny(passes: int, options: dict[str, dict], steps: int = 2000) -> dict:
    """`train_step_cost.py`'s step: a 2-32-2 MLP, Adam, batch 32 (~3e4 FLOPs)."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    params = {
        "w1": jnp.asarray(rng.normal(size=(2, 32)), jnp.float32),
        "b1": jnp.zeros(32),
        "w2": jnp.asarray(rng.normal(size=(32, 2)), jnp.float32),
        "b2": jnp.zeros(2),
    }
    tx = optax.adam(1e-2)
    x = rng.normal(size=(32, 2)).astype(np.float32)
    y = x**2

    def step(params, opt, x, y):
        def loss(p):
            h = jax.nn.gelu(x @ p["w1"] + p["b1"])
            return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, value

    lowered = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), x, y)
    programs = compiled_both(lowered, options)

    def runner(program):
        def run() -> float:
            p, opt = jax.tree.map(lambda a: a.copy(), (params, tx.init(params)))
            t0 = time.perf_counter()
            for _ in range(steps):
                p, opt, value = program(p, opt, x, y)
            jax.block_until_ready(value)
            return steps / (time.perf_counter() - t0)

        run()  # warm
        return run

    return alternate({k: runner(p) for k, p in programs.items()}, passes)


def nitro(batch: int, passes: int, workdir: Path, options: dict[str, dict]) -> dict:
    case = dict(CASES["mlp32"], batch=batch, samples=CASES[f"mlp{batch}"]["samples"])
    data = bench.make_data(case)
    handles = {}
    for side, given in options.items():
        n = jn.Nitro(
            bench.experiment_for(case),
            data={"train": jn.DataLoader(data, batch, drop_last=True)},
            run_dir=workdir / f"{side}{batch}",
            progress=False,
            max_epochs=1,
            compile_options=given,
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
    ap.add_argument("--cases", default="tiny,mlp32,mlp256,mlp1024,cnn,gpt")
    ap.add_argument("--passes", type=int, default=5)
    ap.add_argument("--nitro", default="32,1024", help="batch sizes of the jaxnitro pairs")
    ap.add_argument(
        "--one-thread",
        action="store_true",
        help="the defaults against themselves without ONE_THREAD (YNNPACK fusion off alone)",
    )
    args = ap.parse_args()
    if jax.default_backend() != "cpu" or not backend_options.cpu_known():
        sys.exit("this compares CPU programs: run it on a CPU with a jaxlib that knows the option")
    options = sides(args.one_thread)
    results = {}
    for name in [c for c in args.cases.split(",") if c]:
        results[f"hand {name}"] = hand(CASES[name], args.passes, options)
        print(f"hand {name}: {json.dumps(results[f'hand {name}'])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="jaxnitro-options-") as tmp:
        for b in [int(b) for b in args.nitro.split(",") if b]:
            results[f"jaxnitro mlp{b}"] = nitro(b, args.passes, Path(tmp), options)
            print(f"jaxnitro mlp{b}: {json.dumps(results[f'jaxnitro mlp{b}'])}", flush=True)
    base = "without one thread" if args.one_thread else "XLA's defaults"
    print(f"\n| program | defaults × {base} | defaults steps/s | {base} steps/s |")
    print("|---|---:|---:|---:|")
    for name, r in results.items():
        print(f"| {name} | {r['ratio']:.3f}× | {r['option']:,} | {r['xla']:,} |")


if __name__ == "__main__":
    main()
