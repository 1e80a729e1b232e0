"""The host's work per step: what jaxnitro adds over the hand loop's bare dispatch.

    python benchmarks/host.py [--repeats 5] [--item-epochs 3] [--batches 32,1024] [--json FILE]
                              [--no-keras] [--xla-own]

The MNIST-shaped MLP of `run.py` (784→128→10, RAdam 1e-3, numpy batches, donated state) at
each batch size, in one process: a hand-written `jax.jit` loop (batches sent from the host per
step, run.py's reference) and one `jn.Nitro` handle trained one epoch further per repeat
(`max_epochs` raised by one, `jn.train(n)`: the epochs after the first, programs compiled).
With Keras 3 installed (the `bench` extra), Keras `fit` on the same MLP (`keras_ref.py`: JAX
backend, `jit_compile=True`, one more epoch per repeat) joins them. They alternate, back to
back, in rotating order, so drift on a shared machine hits each. jaxnitro compiles with the
backend's defaults it picks (on a CPU, YNNPACK fusion off: `compile/backend_options.py`);
`--xla-own` compiles its programs with XLA's own, as the hand loop and Keras are.

Reported per batch size:

- steps/s of each (jaxnitro's from its epoch line: the epoch's train time, compiles apart) and
  the ratio, the median of the per-repeat ratios (to the hand loop, and to Keras);
- the host time per step jaxnitro adds: 1/rate minus the hand loop's 1/rate, in µs (median of
  the per-repeat differences);
- the same on this process's CPU time (all its threads, XLA's too; jaxnitro's epoch alone,
  from `run_epoch`), which a machine shared with other jobs moves far less than wall time;
- jaxnitro's own train program called in a bare loop (`bare_epoch`: copies of the state, the
  epoch's inputs prepared first, one read at the end), interleaved: the run's rate against
  it, and the wall time per step the run adds over it (the host work the device's queue does
  not hide);
- the CPU time of the training thread alone per step, jaxnitro's less the hand loop's (its
  waits for the device apart, and XLA's threads): negative where jaxnitro's thread does less
  per step than the hand loop's (which sends each batch from the host);
- per item, the median over `--item-epochs` more epochs with timers around the epoch's parts
  (each timer costs ~0.4 µs itself), as wall time and as the training thread's CPU time: the
  dispatch wrapper around the compiled call, the read-back chunk's own work (rows built,
  logged, the bar; the transfer apart), the feed (wait bookkeeping and the source) and
  `feed.prepare`, and the rest of the loop body (its CPU time: all of `run_epoch`'s, the
  epoch's start and end too); their sum is the host work per step added over a bare
  dispatch. The compiled call itself is the floor the hand loop pays too. On a CPU backend
  XLA's threads run the steps on the same cores as the training thread, so each µs of its
  Python costs more than a µs of wall time.

On a CPU backend the device *is* the host's cores: every µs of Python per step is taken from the
step's compute. On a shared machine absolute figures move run to run; the ratios, measured
interleaved, are what to compare.
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

import run as bench  # noqa: E402  (the MLP, its data and the hand loop)

try:  # first: it sets KERAS_BACKEND, and the environment is part of jaxnitro's program keys
    import keras_ref  # noqa: E402

    NO_KERAS = ""
except ImportError as e:  # keras is in the bench extra
    keras_ref, NO_KERAS = None, str(e)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxnitro as jn  # noqa: E402
from jaxnitro._src.compile import cache  # noqa: E402
from jaxnitro._src.data import feed as feed_mod  # noqa: E402
from jaxnitro._src.data import prefetch as prefetch_mod  # noqa: E402
from jaxnitro._src.programs.builders import train_layout  # noqa: E402
from jaxnitro._src.train import carry as carry_mod  # noqa: E402
from jaxnitro._src.train import epoch as epoch_mod  # noqa: E402

SAMPLES = {32: 32 * 2048, 1024: 1024 * 64}  # run.py's CPU profile: 2048 and 64 steps


class Timers:
    """Seconds spent inside named functions, by patching them for one epoch: wall time
    (`seconds`) and the calling thread's CPU time (`cpu`)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.undo: list = []

    def wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)
        self.seconds.setdefault(label, 0.0)
        self.cpu.setdefault(label, 0.0)
        perf, thread = time.perf_counter, time.thread_time
        totals, cpu = self.seconds, self.cpu

        def timed(*args, **kwargs):
            t0, c0 = perf(), thread()
            try:
                return inner(*args, **kwargs)
            finally:
                totals[label] += perf() - t0
                cpu[label] += thread() - c0

        setattr(owner, name, timed)
        self.undo.append((owner, name, inner))

    def restore(self) -> None:
        for owner, name, inner in reversed(self.undo):
            setattr(owner, name, inner)


def one_epoch(n) -> dict:
    """Train `n` one epoch further; its epoch line (steps_per_s, the time split)."""
    n.max_epochs = n.epoch + 1
    jn.train(n)
    lines = [r for r in jn.read_jsonl(Path(n.run_dir) / "metrics.jsonl") if r.get("context")]
    return [r for r in lines if r["context"] == "epoch"][-1]


def bare_epoch(n) -> float:
    """Steps/s of the handle's own compiled train program called on one epoch's calls in a
    bare loop (copies of its state; its inputs prepared before the clock; one read at the
    end): what the run would do with no host work beside the dispatch."""
    spec = n.spec
    prog = n.programs.train[("train", spec.steps_per_call)]
    fn, layout = cache.direct_call(prog.compiled), train_layout(prog)
    units = feed_mod.train_units(spec, spec.splits["train"], 0, n.epoch)
    prepare = feed_mod.train_prepare(spec, n.step, n.device.hyper_base)
    calls = [c for unit in units for c in prepare(unit)[0]]
    carry = carry_mod.StateCarry([jnp.copy(x) for x in n.state_leaves], n.step)
    extras = n.device.extras
    jax.block_until_ready((carry.moving, calls[-1].batch))
    t0 = time.perf_counter()
    for c in calls:
        out = carry.run(fn, layout, c.steps, c.batch, extras, c.hyper)
    jax.block_until_ready(out)
    return sum(c.steps for c in calls) / (time.perf_counter() - t0)


def items(n, steps: int) -> dict[str, tuple[float, float]]:
    """µs per step of each part of one more epoch (see the module): (wall, the training
    thread's CPU)."""
    t = Timers()
    prepare_s = [0.0, 0.0]
    real_prepare = feed_mod.train_prepare

    def train_prepare(*args, **kwargs):
        inner = real_prepare(*args, **kwargs)

        def prepare(unit):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return inner(unit)
            finally:
                prepare_s[0] += time.perf_counter() - t0
                prepare_s[1] += time.thread_time() - c0

        return prepare

    t.wrap(epoch_mod, "_dispatch", "dispatch")
    t.wrap(carry_mod.StateCarry, "run", "call")
    t.wrap(epoch_mod, "_drain", "drain")
    t.wrap(epoch_mod, "read_back", "read_back")
    if hasattr(epoch_mod, "read_columns"):  # the chunk's transfer, read as columns
        t.wrap(epoch_mod, "read_columns", "read_back")
    t.wrap(prefetch_mod.InlineFeed, "__next__", "feed")
    feed_mod.train_prepare = train_prepare
    try:
        one_epoch(n)
    finally:
        feed_mod.train_prepare = real_prepare
        t.restore()
    clock, per = _LAST_CLOCK, 1e6 / steps
    parts = {}
    for k, (s, whole) in enumerate(((t.seconds, clock["train_s"]), (t.cpu, clock["thread_s"]))):
        timed = s["dispatch"] + s["drain"] + s["feed"]
        parts[k] = {
            "dispatch wrapper": (s["dispatch"] - s["call"]) * per,
            "read-back chunk's work (rows, log, bar)": (s["drain"] - s["read_back"]) * per,
            "feed: waits and source": (s["feed"] - prepare_s[k]) * per,
            "feed.prepare": prepare_s[k] * per,
            # the epoch's time less everything above, the calls and the read-backs
            "loop body, rest": (whole - timed) * per,
            "compiled call (the floor)": s["call"] * per,
        }
    return {name: (parts[0][name], parts[1][name]) for name in parts[0]}


#: the last epoch's `dispatch_s` (the compiled calls alone), compile_s, train time, CPU time
_LAST_CLOCK: dict[str, float] = {}


def _keep_clock() -> None:
    """Keep each epoch's clock, for `items`, and its process CPU time."""
    from jaxnitro._src.train import driver

    real = epoch_mod.run_epoch

    def run_epoch(n, epoch):
        cpu, thread = time.process_time(), time.thread_time()
        result = real(n, epoch)
        _LAST_CLOCK.update(
            cpu_s=time.process_time() - cpu,
            thread_s=time.thread_time() - thread,
            dispatch_s=result.clock.dispatch_s,
            compile_s=result.clock.compile_s,
            train_s=result.seconds,
        )
        return result

    driver.run_epoch = run_epoch


def keras_fit(data: dict, batch: int):
    """Keras `fit` on the same MLP and data (`keras_ref.KerasFit`), or None without Keras."""
    if keras_ref is None:
        print(f"(no Keras row: {NO_KERAS}; `pip install keras==3.15.1`, the bench extra)")
        return None
    return keras_ref.KerasFit(data, batch)


def measure(
    batch: int,
    repeats: int,
    item_epochs: int,
    workdir: Path,
    keras: bool,
    compile_options: dict | None = None,
) -> dict:
    case = dict(name=f"mlp{batch}", kind="mlp", batch=batch, samples=SAMPLES[batch])
    data = bench.make_data(case)
    steps = case["samples"] // batch
    hand = bench.HandLoop(case, data, "host")
    hand.timed()  # the hand loop's first pass: its first epoch, like jaxnitro's below
    n = jn.Nitro(
        bench.experiment_for(case),
        data={"train": jn.DataLoader(data, batch, drop_last=True)},
        run_dir=workdir / f"b{batch}",
        progress=False,
        max_epochs=1,
        compile_options=compile_options,
    )
    jn.train(n)  # the first epoch: compiles, prefetch and threads start
    fit = keras_fit(data, batch) if keras else None  # its first epoch: compiles
    hand.rates.clear()
    ours: list[float] = []
    bare: list[float] = []
    hand_cpu: list[float] = []  # process CPU seconds per step (all threads: XLA's too)
    hand_thread: list[float] = []  # the training thread's own CPU seconds per step
    our_thread: list[float] = []
    our_cpu: list[float] = []
    keras_cpu: list[float] = []
    sides = ["hand", "ours", "bare"] + (["keras"] if fit is not None else [])
    for r in range(repeats):
        for side in sides[r % len(sides) :] + sides[: r % len(sides)]:  # rotating order
            cpu, thread = time.process_time(), time.thread_time()
            if side == "hand":
                hand.timed()
                hand_cpu.append((time.process_time() - cpu) / steps)
                hand_thread.append((time.thread_time() - thread) / steps)
            elif side == "bare":
                bare.append(bare_epoch(n))
            elif side == "keras":
                assert fit is not None
                fit.timed()
                keras_cpu.append((time.process_time() - cpu) / fit.steps)
            else:
                ours.append(one_epoch(n)["steps_per_s"])
                our_cpu.append(_LAST_CLOCK["cpu_s"] / steps)
                our_thread.append(_LAST_CLOCK["thread_s"] / steps)
    runs = [items(n, steps) for _ in range(item_epochs)]
    per_step = {
        k: tuple(statistics.median(run[k][i] for run in runs) for i in (0, 1)) for k in runs[0]
    }
    pairs = list(zip(ours, hand.rates, strict=True))
    cpu_pairs = list(zip(our_cpu, hand_cpu, strict=True))
    keras_pairs = list(zip(ours, fit.rates, strict=True)) if fit is not None else []
    keras_cpu_pairs = list(zip(our_cpu, keras_cpu, strict=True)) if fit is not None else []
    return {
        "batch": batch,
        "steps": steps,
        "keras_steps_per_s": statistics.median(fit.rates) if fit is not None else None,
        "keras_ratio": statistics.median(o / k for o, k in keras_pairs) if keras_pairs else None,
        "keras_ratios": [o / k for o, k in keras_pairs],
        "keras_cpu_ratio": (
            statistics.median(k / o for o, k in keras_cpu_pairs) if keras_cpu_pairs else None
        ),
        "hand_steps_per_s": statistics.median(hand.rates),
        "bare_steps_per_s": statistics.median(bare),
        "bare_ratio": statistics.median(o / b for o, b in zip(ours, bare, strict=True)),
        "over_bare_us_per_step": statistics.median(
            1e6 / o - 1e6 / b for o, b in zip(ours, bare, strict=True)
        ),
        "jaxnitro_steps_per_s": statistics.median(ours),
        "ratio": statistics.median(o / h for o, h in pairs),
        "ratios": [o / h for o, h in pairs],
        "added_us_per_step": statistics.median(1e6 / o - 1e6 / h for o, h in pairs),
        "cpu_ratio": statistics.median(h / o for o, h in cpu_pairs),  # a speed-up, as above
        "cpu_ratios": [h / o for o, h in cpu_pairs],
        "added_cpu_us_per_step": statistics.median(1e6 * (o - h) for o, h in cpu_pairs),
        # the training thread's own CPU time (XLA's threads apart, waits apart): the host
        # work jaxnitro adds per step, robust to a busy machine
        "added_thread_us_per_step": statistics.median(
            1e6 * (o - h) for o, h in zip(our_thread, hand_thread, strict=True)
        ),
        "items_us_per_step": per_step,
    }


def table(results: list[dict], repeats: int) -> str:
    lines = [
        f"MLP 784→128→10, RAdam, numpy batches; epochs after the first, {repeats} interleaved "
        "repeats (medians)",
        "",
        "| batch | hand steps/s | jaxnitro steps/s | × hand, wall (per repeat) | added µs/step "
        "| × hand, CPU time (per repeat) | added CPU µs/step | added training-thread CPU µs/step |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        spread = ", ".join(f"{x:.2f}" for x in r["ratios"])
        cpu = ", ".join(f"{x:.2f}" for x in r["cpu_ratios"])
        lines.append(
            f"| {r['batch']} | {r['hand_steps_per_s']:,.0f} | {r['jaxnitro_steps_per_s']:,.0f} "
            f"| {r['ratio']:.2f}× ({spread}) | {r['added_us_per_step']:+.1f} "
            f"| {r['cpu_ratio']:.2f}× ({cpu}) | {r['added_cpu_us_per_step']:+.1f} "
            f"| {r['added_thread_us_per_step']:+.1f} |"
        )
    lines += [
        "",
        "jaxnitro's own train program called in a bare loop on the same epoch's inputs "
        "(interleaved): the rate the run would have with no host work beside the dispatch",
        "",
        "| batch | bare loop steps/s | the run × bare | the run's µs/step over bare |",
        "|---|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['batch']} | {r['bare_steps_per_s']:,.0f} | {r['bare_ratio']:.3f}× "
            f"| {r['over_bare_us_per_step']:+.1f} |"
        )
    if any(r["keras_ratio"] is not None for r in results):
        lines += [
            "",
            "Keras 3 `fit` (JAX backend, jit_compile=True), interleaved:",
            "",
            "| batch | Keras steps/s | jaxnitro × Keras, wall (per repeat) | × Keras, CPU time |",
            "|---|---:|---:|---:|",
        ]
        for r in results:
            if r["keras_ratio"] is not None:
                spread = ", ".join(f"{x:.2f}" for x in r["keras_ratios"])
                lines.append(
                    f"| {r['batch']} | {r['keras_steps_per_s']:,.0f} | {r['keras_ratio']:.2f}× "
                    f"({spread}) | {r['keras_cpu_ratio']:.2f}× |"
                )
    lines += [
        "",
        "µs per step, the median of the instrumented epochs: wall time / the training "
        "thread's CPU time",
        "",
    ]
    names = list(results[0]["items_us_per_step"])
    lines.append("| item | " + " | ".join(f"batch {r['batch']}" for r in results) + " |")
    lines.append("|---|" + "---:|" * len(results))
    for name in [*names, "host work (all but the call)"]:
        cells = []
        for r in results:
            got = r["items_us_per_step"]
            if name in got:
                wall, cpu = got[name]
            else:
                wall, cpu = (sum(v[i] for k, v in got.items() if "floor" not in k) for i in (0, 1))
            cells.append(f"{wall:.1f} / {cpu:.1f}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--item-epochs", type=int, default=3, help="instrumented epochs per batch")
    ap.add_argument("--batches", default="32,1024", help="comma-separated: 32, 1024")
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--no-keras", action="store_true", help="leave out the Keras `fit` row")
    ap.add_argument(
        "--xla-own",
        action="store_true",
        help="compile jaxnitro's programs with XLA's own defaults (compile_options={}), as "
        "the hand loop and Keras are, not the backend defaults jaxnitro picks",
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b]
    unknown = sorted(set(batches) - set(SAMPLES))
    if unknown:
        ap.error(f"unknown batch size(s) {unknown}; choose from {sorted(SAMPLES)}")
    _keep_clock()
    with tempfile.TemporaryDirectory(prefix="jaxnitro-host-") as tmp:
        results = [
            measure(
                b,
                args.repeats,
                args.item_epochs,
                Path(tmp),
                not args.no_keras,
                {} if args.xla_own else None,
            )
            for b in batches
        ]
    print(table(results, args.repeats))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
