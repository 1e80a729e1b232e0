"""Where the time and the FLOPs go: throughput and MFU from the compiler's FLOP count, the
epoch's time split, goodput and the profiler window (issue 30)."""

from __future__ import annotations

import gzip
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import nitro
from flax import nnx
from helpers.slow_step import SlowStep

import jaxnitro as jn
from jaxnitro._src.observe import throughput


# -- the peak table ---------------------------------------------------------------------------
def test_the_peak_comes_from_the_option_or_the_table_and_never_for_a_cpu():
    assert throughput.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert throughput.peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert throughput.peak_tflops("NVIDIA A100-SXM4-80GB", "bf16") == 312.0
    assert throughput.peak_tflops("TPU v5 lite", "bf16") == 197.0
    assert throughput.peak_tflops("cpu", "f32") is None  # none invented
    assert throughput.peak_tflops("cpu", "f32", given=2.5) == 2.5
    rates = throughput.Throughput(samples=32, tokens=None, flops=2e12, peak=None).rates(4, 2.0)
    assert rates == {"samples_per_s": 64.0, "tflops_per_s": 4.0}  # no mfu without a peak
    with_peak = throughput.Throughput(samples=32, tokens=320, flops=2e12, peak=8.0)
    assert with_peak.rates(4, 2.0)["mfu"] == 0.5 and with_peak.rates(4, 2.0)["tokens_per_s"] == 640


# -- FLOPs against a hand count -----------------------------------------------------------------
D_IN, WIDTH, D_OUT, BATCH = 256, 512, 256, 128


class Wide(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(D_IN, WIDTH, rngs=rngs)
        self.b = nnx.Linear(WIDTH, D_OUT, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


@jn.experiment
class WideMLP:
    max_epochs: int = 1
    peak_tflops: float = 4.0  # an option set by a field: mfu against it

    def build_model(self, rng):
        return jn.split_model(Wide(nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(BATCH * 4, D_IN)).astype(np.float32)
        return {"train": jn.DataLoader({"x": x, "y": x[:, :D_OUT]}, batch_size=BATCH)}

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, out, *, y):
        return ((out - y) ** 2).mean()


def _mlp_hand_count() -> float:
    """Forward 2·B·in·out per layer; backward: the weight gradient (2·B·in·out) for both
    layers, the input gradient only for the second (the first's input is data)."""
    a, b = BATCH * D_IN * WIDTH, BATCH * WIDTH * D_OUT
    return 2 * a + 2 * b + 2 * a + 4 * b


@pytest.mark.slow
@pytest.mark.parametrize("steps_per_call", [1, 4])
def test_train_lines_carry_throughput_with_flops_within_5pct_of_a_hand_count(
    tmp_path, steps_per_call
):
    n = nitro(WideMLP(), run_dir=tmp_path, checkpointer=False, steps_per_call=steps_per_call)
    jn.train(n)
    rows = jn.read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in rows if r.get("context") == "train"]
    assert len(train) == 4 and all("samples_per_s" in r and "mfu" in r for r in train)
    (epoch,) = [r for r in rows if r.get("context") == "epoch"]
    # per step: tflops_per_s / samples_per_s × batch = TFLOPs of one step, whatever the rate
    per_step = epoch["tflops_per_s"] * 1e12 / epoch["samples_per_s"] * BATCH
    assert per_step == pytest.approx(_mlp_hand_count(), rel=0.05)
    assert epoch["mfu"] == pytest.approx(epoch["tflops_per_s"] / 4.0)
    assert "tokens_per_s" not in epoch  # no tokens field, none declared


class Block(nnx.Module):
    """One pre-norm transformer block (single head) over (batch, seq, dim) tokens."""

    def __init__(self, vocab, dim, seq, rngs):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
        self.proj = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(dim, 4 * dim, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(4 * dim, dim, use_bias=False, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)
        self.seq = seq

    def __call__(self, tokens):
        h = self.embed(tokens)
        q, k, v = jnp.split(self.qkv(h), 3, axis=-1)
        att = jax.nn.softmax(q @ k.swapaxes(-1, -2) / jnp.sqrt(q.shape[-1]), axis=-1)
        h = h + self.proj(att @ v)
        h = h + self.down(jax.nn.gelu(self.up(h)))
        return self.head(h)


VOCAB, DIM, SEQ, TB = 512, 128, 64, 16


@jn.experiment
class OneBlock:
    max_epochs: int = 1

    def build_model(self, rng):
        return jn.split_model(Block(VOCAB, DIM, SEQ, nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        tokens = rng.integers(0, VOCAB, size=(TB * 2, SEQ)).astype(np.int32)
        return {"train": jn.DataLoader({"tokens": tokens}, batch_size=TB)}

    def forward(self, model, params, state, *, tokens):
        return jn.apply(model, params, state, tokens)

    def loss(self, logits, *, tokens):
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()


@pytest.mark.slow
def test_a_transformer_blocks_flops_within_5pct_and_tokens_per_s(tmp_path):
    n = nitro(OneBlock(), run_dir=tmp_path, checkpointer=False)
    jn.train(n)
    (epoch,) = [r for r in jn.read_jsonl(tmp_path / "metrics.jsonl") if r.get("context") == "epoch"]
    tokens = TB * SEQ
    # matmuls: qkv 3d², proj d², mlp 8d², head d·V per token; attention 2·T·d per token (QK and
    # AV); forward 2 FLOPs per multiply-add; backward twice the forward (the embedding's
    # gather has no matmul)
    per_token = 2 * (3 * DIM**2 + DIM**2 + 8 * DIM**2 + DIM * VOCAB + 2 * SEQ * DIM)
    hand = 3 * per_token * tokens
    per_step = epoch["tflops_per_s"] * 1e12 / epoch["samples_per_s"] * TB
    assert per_step == pytest.approx(hand, rel=0.05)
    assert epoch["tokens_per_s"] == pytest.approx(epoch["samples_per_s"] * SEQ)
    assert "mfu" not in epoch  # a CPU: no peak given, none invented


# -- the time split -------------------------------------------------------------------------------
class SlowBatches:
    """A plain iterable whose every batch takes `batch_s` to produce, in the loop's thread."""

    def __init__(self, batches: int, batch_s: float):
        rng = np.random.default_rng(0)
        self.x = rng.normal(size=(batches, 4, 8)).astype(np.float32)
        self.y = rng.integers(0, 4, size=(batches, 4)).astype(np.int32)
        self.batch_s = batch_s

    def __len__(self):
        return len(self.x)

    def __iter__(self):
        for x, y in zip(self.x, self.y, strict=True):
            time.sleep(self.batch_s)
            yield {"x": x, "y": y}


def _split(tmp_path, *, step_s, batch_s, batches=12):
    n = nitro(
        SlowStep(step_s=step_s),
        data={"train": SlowBatches(batches, batch_s)},
        run_dir=tmp_path,
        checkpointer=False,
    )
    result = jn.train(n)
    rows = jn.read_jsonl(tmp_path / "metrics.jsonl")
    (epoch,) = [r for r in rows if r.get("context") == "epoch"]
    parts = ["device_s", "host_s", "data_wait_s", "checkpoint_stall_s", "compile_s", "eval_s"]
    assert sum(epoch[k] for k in parts) == pytest.approx(epoch["wall_s"], rel=0.03)
    assert sum(epoch[f"{k[:-2]}_frac"] for k in parts) == pytest.approx(1.0, rel=0.03)
    return epoch, result, rows


def test_a_slow_step_is_device_time(tmp_path):
    """Steps of 60 ms, batches of 15 ms: the data is made in the step's shadow; the device
    sets the pace, and its time is the steps' (at least their sleeps; a loaded machine
    stretches them, hence the loose upper bound)."""
    epoch, result, rows = _split(tmp_path, step_s=0.06, batch_s=0.015)
    assert 0.95 * 12 * 0.06 <= epoch["device_s"] <= 2.5 * 12 * 0.06, epoch
    assert epoch["data_wait_s"] < 0.5 * epoch["device_s"], epoch
    assert 0 < result.goodput <= 1
    (finish,) = [r for r in rows if r.get("type") == "finish"]
    assert finish["goodput"] == pytest.approx(result.goodput)
    assert finish["time"]["device_s"] == pytest.approx(epoch["device_s"])


def test_a_slow_source_is_data_wait(tmp_path):
    """Steps of 10 ms, batches of 60 ms: the device waits for data most of the epoch."""
    epoch, _, _ = _split(tmp_path, step_s=0.01, batch_s=0.06)
    assert 0.9 * 12 * 0.06 <= epoch["data_wait_s"] <= 2.5 * 12 * 0.06, epoch
    assert epoch["device_s"] < 0.5 * epoch["data_wait_s"], epoch


# -- the profiler window -------------------------------------------------------------------------
@pytest.mark.slow
def test_a_profile_window_writes_a_trace_with_the_train_programs_executions(tmp_path):
    n = nitro(WideMLP(), run_dir=tmp_path, checkpointer=False, profile=(1, 3))
    jn.train(n)
    traces = list((tmp_path / "profile").rglob("*.trace.json.gz"))
    assert traces, sorted(p.name for p in (tmp_path / "profile").rglob("*"))
    with gzip.open(traces[0], "rt") as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = [e.get("name") for e in events]
    # the train program (`flat_step`) called for steps 2 and 3, each executed on the device
    assert "PjitFunction(jit(flat_step))" in names, sorted({str(x) for x in names})[:40]
    executions = names.count("CommonPjRtLoadedExecutable::ExecuteHelperOnSingleDevice")
    assert executions == 2, executions
    assert "dot" in names  # the program's own XLA ops ran inside the window
    (where,) = [r for r in jn.read_jsonl(tmp_path / "metrics.jsonl") if "profile" in r]
    assert where["profile"].startswith(str(tmp_path / "profile"))


# -- the loggers ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_csv_and_tensorboard_get_the_epoch_split_and_throughput(tmp_path):
    import csv

    from conftest import Tiny
    from test_loggers import tb_scalars

    pytest.importorskip("tensorboardX")
    tb = jn.TensorBoardLogger()
    loggers = [jn.JSONLogger(), jn.CSVLogger(), tb]
    result = jn.train(nitro(Tiny(max_epochs=1), run_dir=tmp_path, logger=loggers))
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    (epoch,) = [r for r in rows if r["context"] == "epoch"]
    assert float(epoch["device_s"]) > 0 and float(epoch["samples_per_s"]) > 0
    assert float(epoch["eval_s"]) > 0  # Tiny validates at the epoch's end
    train = [r for r in rows if r["context"] == "train"]
    assert all(float(r["samples_per_s"]) > 0 for r in train[-2:])
    tags = tb_scalars(tb.log_dir)
    assert {
        "epoch/device_s",
        "epoch/host_frac",
        "epoch/tflops_per_s",
        "train/samples_per_s",
    } <= set(tags)
    assert 0 < result.goodput < 1
    report = jn.inspect(jn.Nitro(Tiny(), run_dir=tmp_path, logger=False), show=False)
    (line,) = [x for x in report.text().splitlines() if x.startswith("time (last epoch): ")]
    assert "device" in line and "host" in line and line.endswith("s")
    from jaxnitro._src.observe.runs import list_runs

    (info,) = list_runs(tmp_path)  # what `jaxnitro runs` shows
    assert info.time_split is not None and info.time_split["device_s"] > 0


def test_the_host_bound_hint_names_steps_per_call_past_a_fifth_of_the_step():
    from jaxnitro._src.observe.timing import host_bound_hint

    hint = host_bound_hint({"host_s": 1.0, "device_s": 3.0}, 1, steps=100)
    assert hint is not None and "25% of the train time" in hint
    assert "steps_per_call=8 (now 1)" in hint
    assert (
        host_bound_hint({"host_s": 0.5, "device_s": 3.0}, 1, steps=100) is None
    )  # 14%: device-bound
    assert "steps_per_call=32 (now 8)" in host_bound_hint(
        {"host_s": 2.0, "device_s": 1.0}, 8, steps=800
    )


def test_the_host_bound_hint_comes_only_from_epochs_that_measure_dispatch():
    from jaxnitro._src.observe.timing import host_bound_hint

    split = {"host_s": 2.0, "device_s": 1.0}  # host-bound, by the numbers
    assert host_bound_hint(split, 1, steps=1) is None  # a run stopped after one step
    assert host_bound_hint(split, 4, steps=32) is None  # 8 calls: too few to measure
    assert host_bound_hint(split, 1, steps=100, profiled=True) is None  # the profiler's time
    assert host_bound_hint(split, 1, steps=100) is not None
