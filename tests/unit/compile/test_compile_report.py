"""Compile reports: measured fields, and the flags for unrolled loops and baked constants."""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.compile import report


def compile_record(fn, *args, kind=None, **jit_kw):
    t0 = time.perf_counter()
    lowered = jax.jit(fn, **jit_kw).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return report.record(
        kind or fn.__name__,
        "test",
        lowered,
        compiled,
        lower_seconds=t1 - t0,
        compile_seconds=t2 - t1,
    )


def kinds(rec):
    return [f.kind for f in rec.flags]


X = jnp.ones((4, 16))
W = jnp.full((16, 16), 0.01)


def python_loop(x, w):
    for _ in range(200):
        x = jnp.tanh(x @ w)
    return x.sum()


def scanned(x, w):
    x, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=200)
    return x.sum()


def test_unrolled_python_loop_is_flagged_and_scan_is_not():
    unrolled, rolled = compile_record(python_loop, X, W), compile_record(scanned, X, W)

    assert kinds(unrolled) == ["op_count"]
    message = unrolled.flags[0].message
    assert "200 times" in message and "jax.lax.scan" in message and "forward()" in message
    assert kinds(rolled) == []
    assert unrolled.stablehlo_ops > 20 * rolled.stablehlo_ops


@pytest.mark.slow
def test_a_loop_in_the_gradient_is_flagged_too():
    rec = compile_record(jax.grad(python_loop, argnums=1), X, W, kind="train")
    assert kinds(rec) == ["op_count"] and "program 'train'" in rec.flags[0].message


@pytest.mark.slow
def test_per_parameter_repetition_is_not_a_loop():
    # 48 unrolled layers with their own params: the same ops repeat 48 times, but once per
    # parameter leaf, as in any deep model; not what the loop flag is for.
    tx = optax.adam(1e-3)
    layers = [{"w": jnp.full((8, 8), 0.01), "b": jnp.zeros(8)} for _ in range(48)]

    def step(params, opt_state, x):
        def loss(params):
            h = x
            for layer in params:
                h = jnp.tanh(h @ layer["w"] + layer["b"])
            return h.sum()

        grads = jax.grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    lowered = jax.jit(step).lower(layers, tx.init(layers), jnp.ones((2, 8)))
    repeats, _ = report._longest_repeat(report._stablehlo_ops(lowered.as_text()), 256)
    assert repeats >= report.Thresholds().repeats  # the repetition is there ...
    rec = report.record(
        "train", "test", lowered, lowered.compile(), lower_seconds=0.0, compile_seconds=0.0
    )
    assert kinds(rec) == []  # ... and is not taken for a loop


def test_closure_over_a_big_array_is_flagged_and_an_argument_is_not():
    table = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)  # 4 MiB

    def closure(x):
        return (x @ jnp.asarray(table)[:16, :16]).sum()

    def argument(x, table):
        return (x @ table[:16, :16]).sum()

    baked = compile_record(closure, X, kind="train")
    assert kinds(baked) == ["baked_constants"]
    assert baked.constant_bytes == table.nbytes
    assert "4.0 MiB" in baked.flags[0].message and "jn.Device" in baked.flags[0].message
    passed = compile_record(argument, X, jnp.asarray(table))
    assert kinds(passed) == [] and passed.constant_bytes == 0


def test_splat_constants_are_free():
    rec = compile_record(lambda x: x + jnp.zeros((1024, 1024)), jnp.ones((1024, 1024)))
    assert rec.constant_bytes == 0 and kinds(rec) == []


@pytest.fixture(scope="module")
def mlp_step_record():
    key1, key2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(key1, (8, 32)) * 0.1,
        "b1": jnp.zeros(32),
        "w2": jax.random.normal(key2, (32, 4)) * 0.1,
        "b2": jnp.zeros(4),
    }
    tx = optax.adam(1e-3)

    def train_step(params, opt_state, x, y):
        def loss(params):
            h = jax.nn.relu(x @ params["w1"] + params["b1"])
            logits = h @ params["w2"] + params["b2"]
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        value, grads = jax.value_and_grad(loss)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    x, y = jnp.ones((64, 8)), jnp.zeros(64, jnp.int32)
    return compile_record(
        train_step, params, tx.init(params), x, y, kind="train", donate_argnums=(0, 1)
    )


@pytest.mark.slow
def test_clean_train_step_has_no_flags_and_populated_fields(mlp_step_record):
    rec = mlp_step_record
    assert rec.flags == ()
    assert rec.hlo_ops > 0 and rec.stablehlo_ops > 0 and rec.text_bytes > 0
    assert rec.flops is not None and rec.flops > 0
    m = rec.memory
    assert m["estimate"] > 0 and m["aliased"] > 0  # donated params and optimizer state
    assert m["estimate"] == (
        m["arguments"] + m["outputs"] - m["aliased"] + m["temporaries"] + m["code"]
    )


def test_slow_compile_is_flagged_with_the_persistent_cache():
    lowered = jax.jit(scanned).lower(X, W)
    rec = report.record(
        "eval", "test", lowered, lowered.compile(), lower_seconds=0.1, compile_seconds=75.0
    )
    assert kinds(rec) == ["slow_compile"]
    assert "compilation_cache=" in rec.flags[0].message


@pytest.mark.slow
def test_format_table_lists_every_program_and_flag(mlp_step_record):
    loop = compile_record(python_loop, X, W, kind="eval")
    text = report.format_table([mlp_step_record, loop])
    lines = text.splitlines()
    assert lines[0].split()[0] == "program"
    assert any(line.startswith("train ") for line in lines)
    assert any(line.startswith("eval ") for line in lines)
    assert any(line.startswith("! program 'eval'") for line in lines)


def test_a_narrow_terminal_gets_a_table_that_fits_and_names_what_it_left_out(mlp_step_record):
    full = report.format_table([mlp_step_record])
    widest = max(len(line) for line in full.splitlines())
    assert widest > 80  # wider than the terminals below
    assert report.format_table([mlp_step_record], width=widest) == full  # it fits: as is
    for width in (widest - 1, 80, 60, 40):
        lines = report.format_table([mlp_step_record], width=width).splitlines()
        assert all(len(line) <= width for line in lines[:-1]), (width, lines)
        assert "compile s" in lines[0] and "memory" in lines[0], lines  # what tells the most
        assert lines[2].startswith("train ")
        assert lines[-1].startswith("(left out to fit: StableHLO ops"), lines
        assert "jn.compile_report(n)" in lines[-1]


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_the_run_prints_the_report_to_fit_the_terminal(tmp_path):
    import io

    from rich.console import Console

    from jaxnitro._src.observe.display import Display

    n = jn.Nitro(Tiny(max_epochs=1), run_dir=tmp_path / "r", progress=False)
    buf = io.StringIO()
    d = Display("rich", file=buf)
    d.console = Console(file=buf, force_terminal=True, width=70, color_system=None)
    n.services.display = d
    jn.cache_reset()  # the report is of what this run compiles: whatever ran before it
    jn.train(n)
    table = [line for line in buf.getvalue().splitlines() if line.startswith(("program", "train "))]
    assert table and all(len(line) <= 70 for line in table), table
    assert "(left out to fit:" in buf.getvalue()


@pytest.mark.slow
def test_unrolled_loop_and_baked_array_are_flagged_clean_model_is_not(run_dir):
    big = np.random.default_rng(0).normal(size=(1 << 20,)).astype(np.float32)  # 4 MB

    @jn.experiment
    class Loop(Tiny):
        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            for _ in range(200):
                out = jnp.tanh(out) * 0.99
            return out, state

    @jn.experiment
    class Baked(Tiny):
        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            return out + jnp.asarray(big).mean(), state

    with pytest.warns(UserWarning, match="jax.lax.scan"):
        n = nitro(Loop(max_epochs=1, n_val=0), run_dir=run_dir / "loop")
        jn.train(n)
    assert any(f.kind == "op_count" for r in jn.compile_report(n) for f in r.flags)
    with pytest.warns(UserWarning, match="Pass it as a jn.Device field or a batch field"):
        jn.train(nitro(Baked(max_epochs=1, n_val=0), run_dir=run_dir / "baked"))
    jn.cache_reset()
    clean = nitro(Tiny(max_epochs=1), run_dir=run_dir / "clean")
    jn.train(clean)
    records = jn.compile_report(clean)
    assert len(records) == 2 and not any(r.flags for r in records)
    assert all(r.hlo_ops > 0 and r.compile_seconds > 0 for r in records)
    lines = [json.loads(s) for s in (run_dir / "clean" / "metrics.jsonl").read_text().splitlines()]
    compiles = [ln["compile"] for ln in lines if ln["type"] == "other" and "compile" in ln]
    assert [c["kind"] for c in compiles] == ["train", "eval"]


def test_the_table_shows_each_field_in_its_unit():
    """GFLOP is XLA's count / 1e9, sizes are bytes formatted, seconds two decimals, and a
    program loaded from the persistent cache says so."""
    rec = report.CompileRecord(
        kind="train",
        label="Tiny",
        trace_seconds=None,
        lower_seconds=0.123,
        compile_seconds=1.5,
        hlo_ops=1234,
        stablehlo_ops=56,
        text_bytes=2048,
        constant_bytes=0,
        flops=2.5e9,
        memory={"estimate": 3 * 2**20},
        flags=(),
        loaded=True,
    )
    header, *rows = [line.split("  ") for line in report.format_table([rec]).splitlines()[:3]]
    cells = [c.strip() for c in rows[-1] if c.strip()]
    assert cells == [
        "train", "Tiny", "0.12", "1.50 (loaded)", "1,234", "56", "2.0 KiB", "0 B", "2.5", "3.0 MiB",
    ], cells  # fmt: skip
