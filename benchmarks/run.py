"""Side-by-side benchmarks: jaxnitro against a hand-written `jax.jit` loop, PyTorch and Lightning.

    make bench                                       # CPU sizes; under 5 minutes on 2 cores
    python benchmarks/run.py [--quick] [--gpu] [--out FILE.json] [--cases mlp32,gpt] [--record]

Each work (an MLP at batch 32 and 1024, a small CNN, a GPT) is one comparison, measured in one
process (a fresh worker process per comparison, so peak-memory counters and compile caches start
clean): the same model code, the same data in the same order and the same batch size, trained

  * by hand: a `jax.jit` step with donated params and optimizer state, the way a careful user
    writes it, three ways: batches sent from the host each step (the reference every "x hand"
    ratio uses), batches already on the device, and 32 steps fused per call with `lax.scan`;
  * through jaxnitro: `jn.train(jn.Nitro(...))` with `steps_per_call=1` and `32`;
  * with PyTorch, when it is installed: an eager loop (batches on the device) and Lightning's
    `Trainer.fit`, timed end to end (the reference every "x Lightning" ratio uses).

Steady-state rates (compiling excluded) are medians over interleaved repeats; a ratio to the
hand loop is the median of back-to-back pairs, so a machine whose speed drifts cancels out. The
output is a markdown table (printed, and written beside the JSON) and a JSON file
with every figure, its ratios, the targets and the machine and versions. `--record` replaces this
machine's table in benchmarks/RESULTS.md. See benchmarks/README.md for what each column means.
"""

import argparse
import dataclasses
import datetime
import functools
import gc
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))  # gpt.py, torch_ref.py
sys.path.insert(1, str(ROOT / "src"))  # jaxnitro from this checkout, installed or not

import gpt  # noqa: E402

import jaxnitro as jn  # noqa: E402
from jaxnitro._src.core.units import format_bytes  # noqa: E402
from jaxnitro._src.dist.devices import cache_in_use  # noqa: E402

H100_CLASS_PEAK = 989e12  # dense bf16 FLOP/s of an H100/H200 SXM, the MFU denominator there
SCAN_K = 32  # steps fused per call: the hand-written lax.scan loop and jaxnitro's steps_per_call


# -- what to run ----------------------------------------------------------------------------
def cases(profile: str, quick: bool) -> list[dict]:
    """The comparisons for a profile ("cpu" or "gpu"). Sizes keep `make bench` under 5 minutes
    on a 2-core CPU; on a GPU they match shared/bench/anchors.md."""
    q = quick
    if profile == "gpu":  # the GPT first: a run cut short by a time limit still has it
        return [
            dict(
                name="gpt",
                kind="gpt",
                batch=16,
                samples=16 * (16 if q else 40),
                repeats=2,
                gpt="gpt2_small",
                attention="cudnn",
                precision="bf16",
            ),
            dict(name="mlp32", kind="mlp", batch=32, samples=32 * (512 if q else 4096), repeats=3),
            dict(
                name="mlp1024", kind="mlp", batch=1024, samples=1024 * (64 if q else 512), repeats=3
            ),
            dict(name="cnn", kind="cnn", batch=256, samples=256 * (64 if q else 256), repeats=2),
        ]
    # No fused (lax.scan) variants of the CNN on a CPU: XLA:CPU runs convolutions inside a
    # loop about 10x slower (4-5 steps/s against 46-59 here, by hand and through jaxnitro alike).
    return [
        dict(
            name="mlp32",
            kind="mlp",
            batch=32,
            samples=32 * (256 if q else 2048),
            repeats=2 if q else 5,
        ),
        dict(
            name="mlp1024",
            kind="mlp",
            batch=1024,
            samples=1024 * (32 if q else 64),
            repeats=2 if q else 6,
        ),
        dict(
            name="cnn",
            kind="cnn",
            batch=64,
            samples=64 * (32 if q else 64),
            repeats=1 if q else 3,
            fused=False,
        ),
        dict(
            name="gpt",
            kind="gpt",
            batch=8,
            samples=8 * (16 if q else 32),
            repeats=1 if q else 3,
            gpt="tiny",
            attention=None,
            precision=None,
        ),
    ]


def describe(case: dict) -> str:
    if case["kind"] == "mlp":
        what = "MLP 784→128→10"
    elif case["kind"] == "cnn":
        what = "CNN (3 convs 16/32/32, 28×28×1)"
    else:
        c = gpt_config(case)
        what = (
            f"GPT {c.layers} layers, d={c.d}, {c.heads} heads, seq {c.seq}, vocab {c.vocab}"
            f" ({gpt.n_params(c) / 1e6:.1f}M params, {case.get('precision') or 'f32'}, "
            f"attention {c.attention or 'default'})"
        )
    steps = case["samples"] // case["batch"]
    return f"{what}, RAdam 1e-3, batch {case['batch']}, {steps} steps per epoch"


# -- the models (the same code for jaxnitro and the hand loop) ------------------------------
class MLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden, self.out = nnx.Linear(784, 128, rngs=rngs), nnx.Linear(128, 10, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.hidden(x)))


class CNN(nnx.Module):
    """28x28x1 -> 3x3 convs of 16, 32 (stride 2) and 32 (stride 2) channels -> linear."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.c1 = nnx.Conv(1, 16, (3, 3), rngs=rngs)
        self.c2 = nnx.Conv(16, 32, (3, 3), strides=2, rngs=rngs)
        self.c3 = nnx.Conv(32, 32, (3, 3), strides=2, rngs=rngs)
        self.head = nnx.Linear(32 * 7 * 7, 10, rngs=rngs)

    def __call__(self, x):
        x = jax.nn.relu(self.c3(jax.nn.relu(self.c2(jax.nn.relu(self.c1(x))))))
        return self.head(x.reshape(x.shape[0], -1))


def gpt_config(case: dict) -> gpt.GPTConfig:
    return getattr(gpt.GPTConfig, case["gpt"])(attention=case.get("attention"))


def build_model(case: dict, key) -> nnx.Module:
    rngs = nnx.Rngs(key)
    if case["kind"] == "gpt":
        return gpt.GPT(gpt_config(case), rngs=rngs)
    return {"mlp": MLP, "cnn": CNN}[case["kind"]](rngs=rngs)


def make_data(case: dict) -> dict[str, np.ndarray]:
    """MNIST-shaped random images and labels, or random token rows for the GPT."""
    n = case["samples"]
    if case["kind"] == "gpt":
        return {"tokens": gpt.random_tokens(n, gpt_config(case))}
    return _images(case["kind"], n)


@functools.lru_cache(maxsize=1)
def _images(kind: str, n: int) -> dict[str, np.ndarray]:
    """Made once per case: every contender gets the arrays already in memory (generating
    200 MB of random images takes 0.3-0.6 s, which jaxnitro's build_data would otherwise
    pay inside its end-to-end time and the hand loops outside theirs)."""
    rng = np.random.default_rng(0)
    shape = (n, 784) if kind == "mlp" else (n, 28, 28, 1)
    return {"x": rng.random(shape, dtype=np.float32), "y": rng.integers(0, 10, n, dtype=np.int32)}


def classify_loss(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@jn.experiment
class Classify:
    """MNIST-shaped classification with the MLP or the CNN above."""

    arch: jn.GraphConst[str] = "mlp"
    batch: int = 32
    samples: int = 65536
    max_epochs: int = 1

    def build_model(self, rng):
        return jn.split_model(build_model({"kind": self.arch}, rng))

    def build_data(self, dist):
        data = make_data({"kind": self.arch, "samples": self.samples})
        return {"train": jn.DataLoader(data, self.batch, drop_last=True)}

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return classify_loss(logits, y)


def experiment_for(case: dict):
    if case["kind"] == "gpt":
        return gpt.GPTLM(config=gpt_config(case), batch=case["batch"], samples=case["samples"])
    return Classify(arch=case["kind"], batch=case["batch"], samples=case["samples"])


def hand_forward_and_loss(case: dict):
    """The same forward and loss as the experiments' hooks, for the hand-written step."""
    if case["kind"] == "gpt":
        return (
            lambda model, b: model(b["tokens"][:, :-1]),
            lambda logits, b: gpt.next_token_loss(logits, b["tokens"]),
        )
    return lambda model, b: model(b["x"]), lambda logits, b: classify_loss(logits, b["y"])


# -- timing helpers -------------------------------------------------------------------------
def init_key(seed: int = 42):
    """The key jaxnitro's Nitro(seed=42) initializes the model with, so both start equal."""
    return jax.random.split(jax.random.PRNGKey(seed))[0]


def batches_of(data: dict, batch: int, steps: int):
    return [{k: v[i * batch : (i + 1) * batch] for k, v in data.items()} for i in range(steps)]


class HandLoop:
    """The hand-written loop: one `jax.jit` step (params and optimizer state donated).

    way = "host" (numpy batches sent each step), "device" (all batches put on the device
    first) or "scan" (SCAN_K steps per call with `lax.scan`, batches on the device).
    """

    def __init__(self, case: dict, data: dict, way: str):
        self.case, self.way, self.batch = case, way, case["batch"]
        self.steps = case["samples"] // case["batch"]
        forward, loss = hand_forward_and_loss(case)
        bf16 = case.get("precision") == "bf16"
        t0 = time.perf_counter()
        graphdef, params, rest = nnx.split(build_model(case, init_key()), nnx.Param, ...)
        tx = optax.radam(1e-3)
        opt_state = tx.init(params)

        def cast(tree):
            return jax.tree.map(
                lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a,
                tree,
            )

        def loss_fn(params, batch):
            model = nnx.merge(graphdef, cast(params) if bf16 else params, rest)
            out = forward(model, cast(batch) if bf16 else batch)
            return loss(out.astype(jnp.float32), batch)

        def step(params, opt_state, batch):
            value, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        def fused(params, opt_state, batches):
            def body(carry, b):
                p, s, value = step(*carry, b)
                return (p, s), value

            (params, opt_state), values = jax.lax.scan(body, (params, opt_state), batches)
            return params, opt_state, values

        host = batches_of(data, self.batch, self.steps)
        if way == "host":
            self.fn, self.inputs = jax.jit(step, donate_argnums=(0, 1)), host
        elif way == "device":
            self.fn, self.inputs = jax.jit(step, donate_argnums=(0, 1)), jax.device_put(host)
        else:
            stacked = {
                k: v[: self.steps * self.batch].reshape(
                    self.steps // SCAN_K, SCAN_K, self.batch, *v.shape[1:]
                )
                for k, v in data.items()
            }
            self.fn = jax.jit(fused, donate_argnums=(0, 1))
            self.inputs = [
                jax.device_put({k: v[i] for k, v in stacked.items()})
                for i in range(self.steps // SCAN_K)
            ]
        jax.block_until_ready(self.inputs)
        self.params, self.opt_state, value = self.fn(params, opt_state, self.inputs[0])
        jax.block_until_ready(value)
        self.ttfs = time.perf_counter() - t0  # build, data to device (if any), compile, 1 call
        self.first_loop_s: float | None = None
        self.rates: list[float] = []
        self.mean_loss = None

    def timed(self) -> None:
        values = []
        t0 = time.perf_counter()
        for b in self.inputs:
            self.params, self.opt_state, value = self.fn(self.params, self.opt_state, b)
            values.append(value)
        jax.block_until_ready(value)
        dt = time.perf_counter() - t0
        self.first_loop_s = self.first_loop_s or dt
        self.rates.append(self.steps / dt)
        if self.mean_loss is None:  # the first epoch: comparable to jaxnitro's train_loss
            self.mean_loss = float(jnp.mean(jnp.concatenate([jnp.ravel(v) for v in values])))

    def row(self) -> dict:
        label = {
            "host": "hand jit, batches sent per step",
            "device": "hand jit, batches on device",
            "scan": f"hand jit, lax.scan {SCAN_K} steps per call",
        }[self.way]
        return {
            "way": f"hand_{self.way}",
            "label": label,
            "steps_per_s": median(self.rates),
            "rates": self.rates,
            "ttfs_s": self.ttfs,
            "e2e_s": self.ttfs + self.first_loop_s,
            "programs_compiled": _cache_size(self.fn),
            "train_loss": self.mean_loss,
        }


def _cache_size(fn) -> int | None:
    try:
        return int(fn._cache_size())
    except Exception:  # noqa: BLE001 - a private counter; absent in some jax versions
        return None


class NitroRuns:
    """jaxnitro on the same work: a cold run (compiles) and warm repeats (fresh Nitro each)."""

    def __init__(self, case: dict, data: dict, steps_per_call: int, workdir: Path):
        self.case, self.data, self.spc, self.workdir = case, data, steps_per_call, workdir
        self.steps = case["samples"] // case["batch"]
        self.runs = 0
        t0 = time.perf_counter()
        n = self._nitro()
        phases: list[tuple[str, float]] = []
        jn.on_phase(lambda phase, *_: phases.append((phase, time.perf_counter())), nitro=n)
        r = jn.train(n)
        self.e2e_cold = time.perf_counter() - t0
        started = next((t for p, t in phases if p == "Training"), None)
        self.ttfs = started - t0 if started is not None else None
        self.programs_compiled = r.programs_compiled
        self.cold_rate = r.steps_per_second
        self.data_line = _data_line(n)  # the first run: its peak is this work's alone
        self.plan_bytes = int(jn.memory_plan(n).total)
        rows = jn.history(n).rows
        self.train_loss = rows[-1]["train_loss"] if rows else None
        self.warm_programs = 0
        self.rates: list[float] = []
        self.e2es: list[float] = []
        self.waits: list[float] = []
        self.epochs: list[dict] = []  # each warm run's epoch line: its FLOPs and time split
        del n
        gc.collect()
        self.e2e_warm_start, self.loaded_warm_start = self._warm_start()
        # its programs stay in the process-wide cache: the warm runs compile nothing

    def _warm_start(self) -> tuple[float | None, int | None]:
        """The first run of a new process whose persistent compilation cache the cold run
        filled: every in-memory cache dropped (jaxnitro's and JAX's), so each program,
        the eager init ops included, is loaded from disk instead of compiled."""
        if cache_in_use() is None:
            return None, None
        jn.cache_reset()
        jax.clear_caches()
        t0 = time.perf_counter()
        n = self._nitro()
        r = jn.train(n)
        seconds = time.perf_counter() - t0
        del n
        gc.collect()
        return seconds, r.programs_loaded

    def _nitro(self):
        self.runs += 1
        loader = jn.DataLoader(self.data, self.case["batch"], drop_last=True)
        return jn.Nitro(
            experiment_for(self.case),
            data={"train": loader},
            run_dir=self.workdir / f"spc{self.spc}-{self.runs}",
            progress=False,
            steps_per_call=self.spc,
            precision=self.case.get("precision"),
        )

    def timed(self) -> None:
        t0 = time.perf_counter()
        n = self._nitro()
        r = jn.train(n)
        e2e = time.perf_counter() - t0
        self.warm_programs = max(self.warm_programs, r.programs_compiled)
        self.rates.append(r.steps_per_second)
        self.e2es.append(e2e)
        self.waits.append(_data_line(n).get("data_wait_frac"))
        self.epochs.append(_data_line(n, context="epoch"))
        del n
        gc.collect()

    def row(self) -> dict:
        label = "jaxnitro" + (f", steps_per_call={self.spc}" if self.spc > 1 else "")
        return {
            "way": "jaxnitro" if self.spc == 1 else f"jaxnitro_spc{self.spc}",
            "label": label,
            "steps_per_s": median(self.rates),
            "rates": self.rates,
            "ttfs_s": self.ttfs,
            "e2e_s": median(self.e2es),
            "e2e_cold_s": self.e2e_cold,
            "e2e_warm_start_s": self.e2e_warm_start,
            "programs_loaded_warm_start": self.loaded_warm_start,
            "programs_compiled": self.programs_compiled,
            "programs_compiled_warm": self.warm_programs,
            "data_wait_frac": median(self.waits),
            "data_wait_fracs": self.waits,
            "data_wait_frac_cold": self.data_line.get("data_wait_frac"),
            "peak_bytes": self.data_line.get("peak_bytes_in_use"),
            "plan_bytes": self.plan_bytes,
            "train_loss": self.train_loss,
            **self._observed(),
        }

    def _observed(self) -> dict:
        """jaxnitro's own view of the warm runs (their epoch lines): TFLOP/s and FLOPs per step
        from XLA's cost analysis, and the median fraction of each part of the time split."""
        lines = [e for e in self.epochs if e.get("wall_s")]
        if not lines:
            return {}
        out: dict = {
            "split": {
                k: median([e.get(f"{k}_frac", 0.0) for e in lines])
                for k in ("device", "host", "data_wait", "compile", "eval", "checkpoint_stall")
            }
        }
        flops = [
            e["tflops_per_s"] * 1e12 / e["steps_per_s"]
            for e in lines
            if e.get("tflops_per_s") and e.get("steps_per_s")
        ]
        if flops:
            out["jn_flops_per_step"] = median(flops)
            out["jn_tflops"] = median([e["tflops_per_s"] for e in lines if e.get("tflops_per_s")])
        return out


def _data_line(n, context: str = "data") -> dict:
    """The last `context` line (data: data_wait_frac, peak bytes; epoch: throughput and the
    time split) of the run's metrics.jsonl."""
    log = Path(n.run_dir) / "metrics.jsonl"
    lines = [ln for ln in jn.read_jsonl(log) if ln.get("context") == context]
    return lines[-1] if lines else {}


def _split_text(split: dict | None) -> str:
    """'device 81% · host 12% · data 5%' (the three largest parts)."""
    if not split:
        return "–"
    names = {"data_wait": "data", "checkpoint_stall": "checkpoint"}
    top = sorted(split.items(), key=lambda kv: kv[1], reverse=True)[:3]
    return " · ".join(f"{names.get(k, k)} {v:.0%}" for k, v in top)


def matmul_peak() -> tuple[float, str]:
    """FLOP/s to report MFU against: 989 TFLOP/s on an H100/H200, else a measured matmul."""
    kind = jax.devices()[0].device_kind
    if "H100" in kind or "H200" in kind:
        return H100_CLASS_PEAK, f"{kind}: 989 TFLOP/s dense bf16"
    dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    size = 8192 if jax.default_backend() == "gpu" else 1024
    a = jnp.ones((size, size), dtype)
    f = jax.jit(lambda a: a @ a)
    f(a).block_until_ready()
    reps = 10
    t0 = time.perf_counter()
    for _ in range(reps):
        out = f(a)
    out.block_until_ready()
    dt = (time.perf_counter() - t0) / reps
    return 2 * size**3 / dt, f"measured {size}³ {jnp.dtype(dtype).name} matmul on {kind}"


# -- one comparison (run in its own process) ------------------------------------------------
def run_case(case: dict, *, torch_rows: bool = True) -> dict:
    data = make_data(case)
    steps = case["samples"] // case["batch"]
    fused = case.get("fused", case["kind"] != "gpt") and steps % SCAN_K == 0
    # Compile the eager ops of model and optimizer init once, untimed, so that whichever
    # contender builds its model first does not pay for the others' first step.
    workdir = Path(tempfile.mkdtemp(prefix=f"jaxnitro-bench-{case['name']}-"))
    # An empty persistent compilation cache per case: the cold run compiles, the warm start
    # (a new process's first run, emulated in this one) loads what the cold run wrote.
    jn.setup_devices(compilation_cache=workdir / "xla")
    jax.block_until_ready(optax.radam(1e-3).init(nnx.state(build_model(case, init_key()))))
    t_case = time.perf_counter()
    try:
        # jaxnitro's cold runs go first: the peak memory they log is theirs alone.
        contenders = [NitroRuns(case, data, 1, workdir)]
        if fused:
            contenders.append(NitroRuns(case, data, SCAN_K, workdir))
        contenders += [HandLoop(case, data, "host"), HandLoop(case, data, "device")]
        if fused:
            contenders.append(HandLoop(case, data, "scan"))
        for _ in range(case["repeats"]):  # interleaved, so drift hits every contender alike
            for c in contenders:
                c.timed()
        rows = [c.row() for c in contenders]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    out = {
        "case": case,
        "work": describe(case),
        "rows": rows,
        # the same work: the first epoch's mean loss, by hand and through jaxnitro
        "train_loss": {r["way"]: r.get("train_loss") for r in rows if r.get("train_loss")},
    }
    peak, source = matmul_peak()
    out["peak_flops"], out["peak_source"] = peak, source
    for row in rows:  # jaxnitro's MFU from its own FLOP count, against the same peak
        if row.get("jn_tflops"):
            row["jn_mfu"] = row["jn_tflops"] * 1e12 / peak
    if case["kind"] == "gpt":
        cfg = gpt_config(case)
        out["flops_per_step"] = flops = gpt.train_flops_per_token(cfg) * case["batch"] * cfg.seq
        counted = [r["jn_flops_per_step"] for r in rows if r.get("jn_flops_per_step")]
        if counted:  # XLA's count of a step against the hand count (6N + attention)
            out["flops_vs_hand"] = counted[0] / flops
    # PyTorch last: its thread pools would otherwise compete with XLA's on a small CPU.
    out["rows"] += torch_side(case, data) if torch_rows else []
    for row in out["rows"]:
        rate = row.get("steps_per_s")
        if rate:
            unit = case["batch"] * (gpt_config(case).seq if case["kind"] == "gpt" else 1)
            row["units_per_s"] = rate * unit
            if case["kind"] == "gpt":
                row["tflops"] = rate * flops / 1e12
                row["mfu"] = rate * flops / peak
    out["seconds"] = time.perf_counter() - t_case
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out["env"] = environment()
    return out


def torch_side(case: dict, data: dict) -> list[dict]:
    try:
        import torch_ref
    except ImportError as e:
        note = f"skipped: {e} (make bench installs the bench extra: torch and lightning)"
        return [
            {"way": "torch_eager", "label": "PyTorch eager", "skipped": note},
            {"way": "lightning", "label": "Lightning fit", "skipped": note},
        ]
    kw = dict(
        batch=case["batch"],
        steps=case["samples"] // case["batch"],
        gpt_config=gpt_config(case) if case["kind"] == "gpt" else None,
        bf16=case.get("precision") == "bf16",
    )
    rows = []
    eager = torch_ref.eager(case["kind"], data, **kw)
    threads = f", {eager['threads']} CPU thread(s)" if eager.get("threads") else ""
    rows.append(
        {
            "way": "torch_eager",
            "label": f"PyTorch eager, batches on device{threads}",
            "steps_per_s": eager["steps_per_s"],
            "ttfs_s": eager["ttfs_s"],
            "e2e_s": eager["ttfs_s"] + eager["seconds"],
            "peak_bytes": eager["peak_bytes"],
            "train_loss": None,
        }
    )
    for way, label, defaults in (
        ("lightning", "Lightning fit, stripped", False),
        ("lightning_defaults", "Lightning fit, Trainer defaults (logger, checkpoint, bar)", True),
    ):
        try:
            fit = torch_ref.lightning_fit(case["kind"], data, defaults=defaults, **kw)
        except ImportError as e:
            rows.append({"way": way, "label": label, "skipped": f"skipped: {e}"})
            continue
        rows.append(
            {
                "way": way,
                "label": f"{label}, one epoch incl. setup{threads}",
                "steps_per_s": fit["steps_per_s"],
                "e2e_s": fit["e2e_s"],
            }
        )
    return rows


def environment() -> dict:
    env = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "backend": jax.default_backend(),
        "device": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "jax": jax.__version__,
        "jaxnitro": jn.__version__,
        "numpy": np.__version__,
        "git": _git_rev(),
    }
    for name in ("jaxlib", "flax", "optax", "torch", "lightning"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - not installed
            env[name] = None
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_rev() -> str | None:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            text=True,
            capture_output=True,
            timeout=10,
        ).stdout.strip()
        return (rev + ("+dirty" if dirty else "")) if rev else None
    except (OSError, subprocess.SubprocessError):
        return None


# -- ratios, targets, tables ----------------------------------------------------------------
def median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def add_ratios(result: dict) -> None:
    """Every figure against the hand-written per-step loop and Lightning (higher = faster).

    Against the hand loop, steps/s is the median of the per-repeat ratios: each repeat times
    every contender back to back, so a machine that drifts (a shared VM) cancels out of a pair.
    """
    rows = {r["way"]: r for r in result["rows"]}
    refs = {"hand": rows.get("hand_host"), "lightning": rows.get("lightning")}
    for row in result["rows"]:
        ratios = {}
        for name, ref in refs.items():
            if not ref or ref.get("skipped") or row.get("skipped"):
                continue
            paired = row.get("rates") and len(row["rates"]) == len(ref.get("rates") or ())
            ratios[name] = {
                "steps_per_s": median(
                    [a / b for a, b in zip(row["rates"], ref["rates"], strict=True)]
                )
                if paired
                else _div(row.get("steps_per_s"), ref.get("steps_per_s")),
                "e2e": _div(ref.get("e2e_s"), row.get("e2e_s")),  # a speed-up: ref time / ours
                "e2e_cold": _div(ref.get("e2e_s"), row.get("e2e_cold_s")),
                "e2e_warm_start": _div(ref.get("e2e_s"), row.get("e2e_warm_start_s")),
                "ttfs": _div(ref.get("ttfs_s"), row.get("ttfs_s")),
            }
        row["ratios"] = ratios


def _div(a, b):
    return a / b if a and b else None


def targets(results: list[dict], profile: str) -> list[dict]:
    """The issue's targets, each as a measured ratio. `applies` says where a target holds."""
    by = {r["case"]["name"]: {row["way"]: row for row in r["rows"]} for r in results}

    def ratio(case, way, ref, key="steps_per_s"):
        row = by.get(case, {}).get(way)
        return (row or {}).get("ratios", {}).get(ref, {}).get(key)

    out = []

    def add(what, measured, required, applies, *, above=True):
        ok = None if measured is None else (measured >= required if above else measured < required)
        here = applies in ("all", profile)
        out.append(
            {
                "target": what,
                "measured": measured,
                "required": required,
                "comparison": ">=" if above else "<",
                "applies": applies,
                "met": ok if here else None,
                "status": ("n/a" if measured is None else ("met" if ok else "NOT met"))
                if here
                else f"{applies.upper()} target"
                + ("" if measured is None else ", measured here for reference"),
            }
        )

    for case in by:
        add(
            f"per-step overhead: jaxnitro / hand per-step loop, {case}",
            ratio(case, "jaxnitro", "hand"),
            0.97,
            "all",
        )
    add(
        "steps_per_call=32 / hand per-step loop, mlp32",
        ratio("mlp32", "jaxnitro_spc32", "hand"),
        3.0,
        "gpu",
    )
    for case in ("mlp32", "mlp1024"):
        best = max(
            filter(
                None,
                [
                    ratio(case, "jaxnitro_spc32", "lightning", "e2e_cold"),
                    ratio(case, "jaxnitro", "lightning", "e2e_cold"),
                ],
            ),
            default=None,
        )
        add(
            f"end to end (cold: setup + compile + epoch) / Lightning fit, {case}",
            best,
            30.0 if profile == "gpu" else 10.0,
            profile,
        )
        add(
            f"end to end (warm start: a new process, programs loaded from the persistent "
            f"cache) / Lightning fit, {case}",
            max(
                filter(
                    None,
                    [
                        ratio(case, "jaxnitro_spc32", "lightning", "e2e_warm_start"),
                        ratio(case, "jaxnitro", "lightning", "e2e_warm_start"),
                    ],
                ),
                default=None,
            ),
            30.0 if profile == "gpu" else 10.0,
            profile,
        )
    wait = by.get("mlp1024", {}).get("jaxnitro", {}).get("data_wait_frac")
    add("prefetch: data_wait_frac at batch 1024", wait, 0.05, "all", above=False)
    add("GPT: jaxnitro / hand step, same model code", ratio("gpt", "jaxnitro", "hand"), 0.98, "all")
    gpt = by.get("gpt", {}).get("jaxnitro", {})  # MFU of the tiny CPU GPT would mean nothing
    add(
        "GPT-2 small MFU (bf16, cuDNN attention) on an H200",
        gpt.get("mfu") if profile == "gpu" else None,
        0.40,
        "gpu",
    )
    return out


def _fmt(v, spec=",.0f", suffix=""):
    return "–" if v is None else f"{v:{spec}}{suffix}"


def _bytes(v):
    return "–" if v is None else format_bytes(v)


def _notes(res: dict) -> list[str]:
    """The notes under a case's table: the same work's losses, the MFU's peak, the FLOPs."""
    notes = []
    losses = res.get("train_loss", {})
    if losses:
        notes.append(
            "same work, first epoch's mean loss: "
            + ", ".join(f"{way} {v:.4f}" for way, v in losses.items())
        )
    if res.get("peak_source"):
        notes.append(
            f"MFU against {res['peak_source']} ({res['peak_flops'] / 1e12:.3g} TFLOP/s); "
            f"MFU (XLA count) and the time split are jaxnitro's own epoch lines"
        )
    if res.get("flops_vs_hand") is not None:
        notes.append(f"XLA's FLOPs per step / the hand count: {res['flops_vs_hand']:.3f}")
    return notes


def markdown(report: dict) -> str:
    env = report["env"]
    lines = [
        f"### {report['machine']} · {report['date']}",
        "",
        (
            "JAX on the CPU"
            if env.get("backend") == "cpu"
            else f"{env.get('device_count')}× {env.get('device')} ({env.get('backend')})"
        )
        + f", {env.get('cpu_count')} CPU cores "
        f"({env.get('cpu')}); Python {env.get('python')}, jax {env.get('jax')}, flax "
        f"{env.get('flax')}, optax {env.get('optax')}, jaxnitro {env.get('jaxnitro')} "
        f"(git {env.get('git')}), torch {env.get('torch') or 'not installed'}, lightning "
        f"{env.get('lightning') or 'not installed'}. Profile `{report['profile']}`"
        f"{' (quick)' if report['quick'] else ''}; `{report['command']}`, "
        f"{report['seconds']:.0f} s.",
        "",
    ]
    for res in report["results"]:
        if "error" in res:
            lines += [f"**{res['case']['name']}**: failed: `{res['error']}`", ""]
            continue
        gpt = res["case"]["kind"] == "gpt"
        unit = "tokens/s" if gpt else "samples/s"
        lines += [f"**{res['case']['name']}**: {res['work']}", ""]
        head = [
            "way",
            "steps/s",
            "× hand",
            "× Lightning",
            unit,
            "end to end s",
            "e2e × Lightning",
            "first step s",
            "compiled",
            "data wait",
            "peak / plan",
        ]
        if gpt:
            head += ["TFLOP/s", "MFU"]
        head += ["MFU (XLA count)", "time split"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for row in res["rows"]:
            if row.get("skipped"):
                lines.append(f"| {row['label']} | {row['skipped']} |" + " |" * (len(head) - 2))
                continue
            r = row.get("ratios", {})
            e2e = _fmt(row.get("e2e_s"), ".2f")
            e2e_l = _fmt(r.get("lightning", {}).get("e2e"), ".1f", "×")
            if row.get("e2e_cold_s") is not None:
                e2e = f"{e2e} (cold {row['e2e_cold_s']:.2f})"
                e2e_l += f" (cold {_fmt(r.get('lightning', {}).get('e2e_cold'), '.1f', '×')})"
            if row.get("e2e_warm_start_s") is not None:
                e2e = f"{e2e} (warm start {row['e2e_warm_start_s']:.2f})"
                warm = _fmt(r.get("lightning", {}).get("e2e_warm_start"), ".1f", "×")
                e2e_l += f" (warm start {warm})"
            compiled = _fmt(row.get("programs_compiled"), "d")
            if row.get("programs_compiled_warm") is not None:
                compiled += f" (warm {row['programs_compiled_warm']})"
            peak = (
                f"{_bytes(row.get('peak_bytes'))} / {_bytes(row.get('plan_bytes'))}"
                if row.get("plan_bytes") is not None
                else _bytes(row.get("peak_bytes"))
            )
            rate = _fmt(row.get("steps_per_s"))
            if len(row.get("rates") or ()) > 1:
                rate += f" ({min(row['rates']):,.0f}–{max(row['rates']):,.0f})"
            cells = [
                row["label"],
                rate,
                _fmt(r.get("hand", {}).get("steps_per_s"), ".2f", "×"),
                _fmt(r.get("lightning", {}).get("steps_per_s"), ".1f", "×"),
                _fmt(row.get("units_per_s")),
                e2e,
                e2e_l,
                _fmt(row.get("ttfs_s"), ".2f"),
                compiled,
                _fmt(row.get("data_wait_frac"), ".1%"),
                peak,
            ]
            if gpt:
                cells += [_fmt(row.get("tflops"), ".3g"), _fmt(row.get("mfu"), ".1%")]
            cells += [_fmt(row.get("jn_mfu"), ".1%"), _split_text(row.get("split"))]
            lines.append("| " + " | ".join(cells) + " |")
        notes = _notes(res)
        if notes:
            lines += ["", "; ".join(notes) + "."]
        lines.append("")
    lines += ["**Targets**", "", "| target | measured | required | status |", "|---|---|---|---|"]
    for t in report["targets"]:
        m = t["measured"]
        shown = (
            "–"
            if m is None
            else (f"{m:.1%}" if "frac" in t["target"] or "MFU" in t["target"] else f"{m:.2f}×")
        )
        req = (
            f"{t['comparison']} {t['required']:.0%}"
            if "frac" in t["target"] or "MFU" in t["target"]
            else f"{t['comparison']} {t['required']:g}×"
        )
        lines.append(f"| {t['target']} | {shown} | {req} | {t['status']} |")
    return "\n".join(lines) + "\n"


def record(report: dict, md: str, path: Path = HERE / "RESULTS.md") -> None:
    """Replace (or add) this machine's section of RESULTS.md: the latest table per machine."""
    begin, end = f"<!-- machine: {report['machine']} -->", f"<!-- end: {report['machine']} -->"
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    block = f"{begin}\n{md}{end}\n"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1].lstrip("\n")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def machine_name(env: dict) -> str:
    if not env:
        return "unknown machine (every comparison failed)"
    if env.get("backend") == "cpu":
        return f"{env.get('cpu_count')}-core CPU ({env.get('cpu')})"
    return f"{env.get('device_count')}× {env.get('device')}"


# -- the driver -----------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats (a smoke run)")
    p.add_argument(
        "--gpu",
        action="store_true",
        help="GPU sizes: GPT-2 small (124M, bf16, cuDNN attention); needs a GPU",
    )
    p.add_argument(
        "--out",
        default=str(ROOT / "runs" / "bench" / "bench.json"),
        help="the JSON file to write (the markdown table goes beside it, .md)",
    )
    p.add_argument("--cases", default=None, help="comma-separated subset: mlp32,mlp1024,cnn,gpt")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch and Lightning rows")
    p.add_argument("--inline", action="store_true", help="run every case in this process")
    p.add_argument(
        "--record",
        action="store_true",
        help="replace this machine's table in benchmarks/RESULTS.md",
    )
    p.add_argument("--record-from", metavar="JSON", help="record a saved JSON file and exit")
    p.add_argument("--worker", metavar="CASE", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.record_from:
        report = json.loads(Path(args.record_from).read_text())
        report["targets"] = targets(
            [r for r in report["results"] if "rows" in r], report["profile"]
        )
        record(report, markdown(report))
        print(f"recorded {report['machine']} in {HERE / 'RESULTS.md'}")
        return 0

    profile = "gpu" if args.gpu else "cpu"
    chosen = cases(profile, args.quick)
    if args.cases:
        names = args.cases.split(",")
        unknown = sorted(set(names) - {c["name"] for c in chosen})
        if unknown:
            p.error(f"unknown case(s) {unknown}; choose from {[c['name'] for c in chosen]}")
        chosen = [c for c in chosen if c["name"] in names]

    if args.worker:  # one comparison, in this fresh process
        if args.gpu and jax.default_backend() != "gpu":
            raise SystemExit(f"--gpu needs a GPU; jax sees {jax.devices()}")
        case = next(c for c in chosen if c["name"] == args.worker)
        result = run_case(case, torch_rows=not args.no_torch)
        Path(args.worker_out).write_text(json.dumps(result, default=_json_default))
        return 0

    t0 = time.perf_counter()
    command = " ".join(["python", "benchmarks/run.py", *(sys.argv[1:] if argv is None else argv)])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for case in chosen:
        print(f"[bench] {case['name']}: {describe_light(case)} ...", flush=True)
        c0 = time.perf_counter()
        result = run_case(case, torch_rows=not args.no_torch) if args.inline else _spawn(case, args)
        results.append(result)
        print(
            f"[bench] {case['name']}: {time.perf_counter() - c0:.1f} s"
            + (f" FAILED: {result['error']}" if "error" in result else ""),
            flush=True,
        )
        # Written after every comparison: a run cut short still leaves what it measured.
        report = build_report(
            results,
            profile=profile,
            quick=args.quick,
            command=command,
            seconds=time.perf_counter() - t0,
        )
        md = markdown(report)
        out.write_text(json.dumps(report, indent=1, default=_json_default))
        out.with_suffix(".md").write_text(md)
    print("\n" + md)
    print(f"[bench] wrote {out} and {out.with_suffix('.md')} ({report['seconds']:.0f} s)")
    if args.record:
        record(report, md)
        print(f"[bench] recorded {report['machine']} in {HERE / 'RESULTS.md'}")
    return 1 if any("error" in r for r in results) else 0


def build_report(
    results: list[dict], *, profile: str, quick: bool, command: str, seconds: float
) -> dict:
    for r in results:
        if "rows" in r:
            add_ratios(r)
    # From a worker: this process never initializes a backend (on a GPU it would take the
    # memory the workers need).
    env = next((r["env"] for r in results if "env" in r), {})
    return {
        "date": datetime.date.today().isoformat(),
        "machine": machine_name(env),
        "env": env,
        "profile": profile,
        "quick": quick,
        "command": command,
        "seconds": seconds,
        "results": results,
        "targets": targets([r for r in results if "rows" in r], profile),
    }


def describe_light(case: dict) -> str:
    return f"{case['kind']}, batch {case['batch']}, {case['samples'] // case['batch']} steps"


def _spawn(case: dict, args) -> dict:
    """Run one comparison in a fresh process; its result comes back as a JSON file."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--worker", case["name"], "--worker-out", str(out)]
        cmd += ["--quick"] * args.quick + ["--gpu"] * args.gpu + ["--no-torch"] * args.no_torch
        proc = subprocess.run(cmd, text=True, capture_output=True, timeout=1200)
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            print("\n".join(tail), file=sys.stderr)
            return {"case": case, "error": tail[-1] if tail else f"exit {proc.returncode}"}
        return json.loads(out.read_text())


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return repr(o)


if __name__ == "__main__":
    sys.exit(main())
