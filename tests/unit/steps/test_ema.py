"""Weight averaging (`Nitro(ema=...)`): the average in the train program, checkpointed and
resumed bit for bit, validation and predict/evaluate/export with either weights."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import Tiny, host_copy, leaves_equal, make_data, nitro
from flax import nnx
from helpers.paths import TESTS

import jaxnitro as jn
from jaxnitro._src.core.errors import CheckpointError, ConfigError
from jaxnitro._src.steps.ema import pick


def _checkpoints(run_dir: Path) -> dict[int, dict]:
    """{step: trees} of every checkpoint a run kept."""
    out = {}
    for meta in (run_dir / "checkpoints").glob("*/meta.json"):
        trees, info = jn.load_checkpoint(meta.parent)
        out[info["step"]] = trees
    return out


def _reference(trajectory: list, decay: float, *, every: int = 1, warmup: bool = True):
    """The EMA by hand: the initial params, then after optimizer step n (1-based)
    `d * ema + (1 - d) * params_n`, d = min(decay, (1 + t) / (10 + t)) with t = n - 1,
    compounded to d**every, on the steps n that `every` divides."""
    ema = [np.asarray(x, np.float64) for x in trajectory[0]]
    for n, params in enumerate(trajectory[1:], start=1):
        if n % every:
            continue
        t = n - 1
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        d = d**every
        ema = [
            d * e + (1 - d) * np.asarray(p, np.float64) for e, p in zip(ema, params, strict=True)
        ]
    return ema


@pytest.mark.slow
@pytest.mark.parametrize(("every", "warmup"), [(1, True), (3, True), (2, False)])
def test_ema_equals_a_hand_computed_average_of_the_trajectory(run_dir, every, warmup):
    # one step per epoch, a checkpoint each: every step's params and average are on disk
    exp = Tiny(n_train=32, n_val=20, max_epochs=7)
    ck = jn.TopKCheckpointer(k=100)
    n = nitro(exp, run_dir=run_dir, checkpointer=ck, ema=0.8, ema_every=every, ema_warmup=warmup)
    first = [np.asarray(x) for x in jax.tree.leaves(n.params)]
    jn.train(n)
    saved = _checkpoints(run_dir)
    assert sorted(saved) == list(range(1, 8))
    trajectory = [first] + [jax.tree.leaves(saved[s]["params"]) for s in range(1, 8)]
    for step in range(1, 8):
        want = _reference(trajectory[: step + 1], 0.8, every=every, warmup=warmup)
        got = jax.tree.leaves(saved[step]["ema"]["params"])
        for g, w in zip(got, want, strict=True):
            assert g.dtype == np.float32
            np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7)
    final = jax.tree.leaves(host_copy(n.train_state.ema["params"]))
    assert all(
        np.array_equal(a, b)
        for a, b in zip(final, jax.tree.leaves(saved[7]["ema"]["params"]), strict=True)
    )


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_changing_the_decay_compiles_nothing_and_on_off_one_train_program(run_dir):
    jn.cache_reset()
    r = jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir / "a", ema=0.99, ema_eval="both"))
    assert r.programs_compiled == 2  # train + val: the average validates with the same program
    assert jn.cache_stats()["misses"] == 2
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir / "b", ema=0.999))
    assert jn.cache_stats()["misses"] == 2  # the decay is traced
    jn.train(nitro(Tiny(max_epochs=1), run_dir=run_dir / "c"))
    assert jn.cache_stats()["misses"] == 3  # off: one new train program, the eval one reused


@pytest.mark.slow
def test_validation_uses_the_average_and_both_logs_the_raw_weights(run_dir):
    ck = jn.TopKCheckpointer(k=5)
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, checkpointer=ck, ema=0.9, ema_eval="both")
    result = jn.train(n)
    row = result.history[-1]
    ema_val, raw_val = jn.evaluate(n, "val"), jn.evaluate(n, "val", weights="raw")
    assert ema_val == jn.evaluate(n, "val", weights="ema")
    assert row["val_loss"] == ema_val["val_loss"] and row["acc"] == ema_val["acc"]
    assert row["val_raw_loss"] == raw_val["val_loss"] and row["val_raw_acc"] == raw_val["acc"]
    assert row["val_loss"] != row["val_raw_loss"]
    # the checkpointer ranked by the metrics of the weights it validated with
    _, meta = jn.load_checkpoint(n.checkpointer.best())
    assert meta["metrics"]["val_loss"] == min(r["val_loss"] for r in result.history)
    assert meta["weights"] == "ema"
    # ema_eval=False: validation (and the default of predict/evaluate) is the raw weights
    m = nitro(Tiny(max_epochs=1), run_dir=run_dir / "raw", ema=0.9, ema_eval=False)
    r = jn.train(m)
    assert r.history[-1]["val_loss"] == jn.evaluate(m, "val", weights="raw")["val_loss"]
    assert r.history[-1]["val_loss"] != jn.evaluate(m, "val", weights="ema")["val_loss"]


@pytest.mark.slow
def test_predict_and_checkpoint_loading_take_weights(run_dir):
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, ema=0.9)
    jn.train(n)
    x, _ = make_data(6, seed=3)
    ema_out = jn.predict(n, {"x": x}, weights="ema")
    raw_out = jn.predict(n, {"x": x}, weights="raw")
    np.testing.assert_array_equal(jn.predict(n, {"x": x}), ema_out)  # the default: as validated
    assert not np.allclose(ema_out, raw_out)
    ema_params = jax.tree.leaves(host_copy(n.train_state.ema["params"]))
    # checkpoint=: the average by default (validation used it), the raw weights when asked
    loaded = nitro(Tiny(), run_dir=run_dir / "loaded", checkpoint=run_dir)
    assert leaves_equal(jax.tree.leaves(loaded.params), ema_params)
    np.testing.assert_array_equal(jn.predict(loaded, {"x": x}), ema_out)
    raw = nitro(Tiny(), run_dir=run_dir / "raw", checkpoint=run_dir, weights="raw")
    np.testing.assert_array_equal(jn.predict(raw, {"x": x}), raw_out)
    # a handle that loaded the average holds no raw weights: asked for them, it says so and
    # how to load them, and asked for the average it answers with what it loaded
    with pytest.raises(ConfigError, match=r"loaded the weight average.*weights='raw'\)"):
        jn.predict(loaded, {"x": x}, weights="raw")
    np.testing.assert_array_equal(jn.predict(loaded, {"x": x}, weights="ema"), ema_out)
    with pytest.raises(ConfigError, match="keeps no average"):  # the raw handle has none
        jn.predict(raw, {"x": x}, weights="ema")
    # a run without an average: weights="ema" is refused, naming the fix
    plain = run_dir / "plain"
    jn.train(nitro(Tiny(max_epochs=1), run_dir=plain))
    with pytest.raises(CheckpointError, match="holds no weight average"):
        nitro(Tiny(), run_dir=run_dir / "x", checkpoint=plain, weights="ema")
    m = nitro(Tiny(), run_dir=run_dir / "y", checkpoint=plain)
    with pytest.raises(ConfigError, match=r"keeps no average.*ema=0.999"):
        jn.predict(m, {"x": x}, weights="ema")
    with pytest.raises(ConfigError, match="weights='best'"):
        jn.evaluate(n, "val", weights="best")


@pytest.mark.slow
def test_export_with_ema_weights_serves_the_average(run_dir):
    n = nitro(Tiny(max_epochs=2), run_dir=run_dir, ema=0.9, ema_eval="both")
    jn.train(n)
    x, _ = make_data(5, seed=7)
    bundle = jn.load_bundle(jn.export_model(n, run_dir / "ema", weights="ema", platforms=["cpu"]))
    np.testing.assert_allclose(
        bundle(x), jn.predict(n, {"x": x}, weights="ema"), rtol=1e-5, atol=1e-5
    )
    raw = jn.load_bundle(jn.export_model(n, run_dir / "raw", weights="raw", platforms=["cpu"]))
    np.testing.assert_allclose(raw(x), jn.predict(n, {"x": x}, weights="raw"), rtol=1e-5, atol=1e-5)
    assert not np.allclose(bundle(x), raw(x))
    # each manifest says which weights it holds, and the checkpoint's scores are theirs
    last = n.progress.history[-1]
    for b, which, key in ((bundle, "ema", "val_loss"), (raw, "raw", "val_raw_loss")):
        prov = b.manifest["provenance"]
        assert prov["weights"] == which
        assert prov["checkpoint"]["metrics"]["val_loss"] == pytest.approx(last[key])
        assert not any(k.startswith("val_raw_") for k in prov["checkpoint"]["metrics"])


class NormMLP(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, 16, rngs=rngs)
        self.norm = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(jax.nn.relu(self.norm(self.hidden(x))))


@jn.experiment
class Norm(Tiny):
    def build_model(self, rng):
        return jn.split_model(NormMLP(rngs=nnx.Rngs(rng)))


@pytest.mark.slow
def test_batchnorm_statistics_are_copied_unless_ema_state(run_dir):
    copied = nitro(Norm(max_epochs=1), run_dir=run_dir / "a", ema=0.9)
    jn.train(copied)
    ts = copied.train_state
    assert "state" not in ts.ema
    params, state = pick(copied, "ema")
    assert leaves_equal(state, ts.state)  # the running statistics of the raw model
    assert not leaves_equal(params, ts.params)

    averaged = nitro(Norm(max_epochs=1), run_dir=run_dir / "b", ema=0.9, ema_state=True)
    jn.train(averaged)
    ts = averaged.train_state
    assert leaves_equal(ts.params, copied.params)  # the average never feeds back
    _, state = pick(averaged, "ema")
    assert leaves_equal(
        state, jax.tree.map(lambda a, x: a.astype(x.dtype), ts.ema["state"], ts.state)
    )
    assert not leaves_equal(state, ts.state)
    assert jn.evaluate(averaged, "val") != jn.evaluate(copied, "val")
    # the saved average holds the statistics: a resume must average them too
    with pytest.raises(CheckpointError, match="Resume with the same ema_state"):
        nitro(Norm(max_epochs=2), run_dir=run_dir / "b", resume=True, ema=0.9)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"ema": 1.0}, r"ema=1.0; the decay is a number strictly between 0 and 1"),
        ({"ema": 0}, r"ema=0;"),
        ({"ema": "0.9"}, r"ema='0.9';"),
        ({"ema": True}, r"ema=True;"),
        ({"ema": 0.9, "ema_every": 0}, r"ema_every=0; pass a whole number"),
        ({"ema": 0.9, "ema_eval": "raw"}, r"ema_eval='raw'; use True"),
        ({"ema": 0.9, "ema_warmup": "yes"}, r"ema_warmup='yes'; use True or False"),
        ({"ema_every": 5}, r"ema_every=5 without ema; .*Nitro\(ema=0.999, ema_every=5\)"),
        ({"ema_state": True}, r"ema_state=True without ema"),
        ({"weights": "ema"}, r"weights='ema' without checkpoint="),
        ({"weights": "best", "checkpoint": "x"}, r"weights='best'; use 'ema'"),
    ],
)
def test_bad_values_are_named(run_dir, options, match):
    with pytest.raises(ConfigError, match=match):
        nitro(Tiny(), run_dir=run_dir, **options)


CHILD = r"""
import sys
sys.path.insert(0, {tests!r})
import jaxnitro as jn
from conftest import Tiny, nitro

n = nitro(Tiny(max_epochs=int(sys.argv[2])), run_dir=sys.argv[1], resume="auto", ema=0.9,
          ema_every=2, checkpoint_every=3)
print("START", n.step, flush=True)
jn.train(n)
print("DONE", flush=True)
"""


@pytest.mark.slow  # a child process: ~10 s alone, ~30 s on a loaded 2-core machine
def test_kill_and_resume_continues_the_average_bit_for_bit(run_dir, tmp_path):
    epochs = 12  # x 8 steps: the child is killed long before the end
    straight = nitro(Tiny(max_epochs=epochs), run_dir=tmp_path / "straight", ema=0.9, ema_every=2)
    jn.train(straight)
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(tests=str(TESTS)))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    child = subprocess.Popen(
        [sys.executable, str(script), str(run_dir), str(epochs)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and child.poll() is None:
        if len(list((run_dir / "checkpoints").glob("*/meta.json"))) >= 2:
            break
        time.sleep(0.05)
    child.send_signal(signal.SIGKILL)
    assert child.wait(30) == -signal.SIGKILL
    with pytest.warns(UserWarning, match="taking over the run lock"):  # the killed child's
        resumed = nitro(
            Tiny(max_epochs=epochs), run_dir=run_dir, resume="auto", ema=0.9, ema_every=2
        )
    assert 0 < resumed.step < epochs * 8
    jn.train(resumed)
    assert leaves_equal(resumed.params, straight.params)
    assert leaves_equal(resumed.train_state.ema, straight.train_state.ema)


def test_the_memory_plan_counts_the_average(tmp_path):
    plain = jn.memory_plan(nitro(Tiny(), run_dir=tmp_path / "a"))
    averaged = jn.memory_plan(nitro(Tiny(), run_dir=tmp_path / "b", ema=0.99))
    extra = plain.params_bytes + 4  # an f32 copy of the params and the decay
    assert averaged.opt_state_bytes == plain.opt_state_bytes + extra
    assert averaged.checkpoint_staging_bytes == plain.checkpoint_staging_bytes + extra


@pytest.mark.slow
def test_a_custom_train_step_updates_the_average_too(run_dir):
    from test_custom_step import Alternating

    ck = jn.TopKCheckpointer(k=100, metric="mse")
    n = nitro(
        Alternating(max_epochs=1),
        run_dir=run_dir,
        checkpointer=ck,
        ema=0.7,
        checkpoint_every=1,
        val_every=1,
    )
    first = [np.asarray(x) for x in jax.tree.leaves(n.params)]
    jn.train(n)
    saved = _checkpoints(run_dir)
    assert sorted(saved) == list(range(1, 9))
    trajectory = [first] + [jax.tree.leaves(saved[s]["params"]) for s in range(1, 9)]
    got = jax.tree.leaves(host_copy(n.train_state.ema["params"]))
    for g, w in zip(got, _reference(trajectory, 0.7), strict=True):
        np.testing.assert_allclose(g, w, rtol=2e-6, atol=2e-7)


@pytest.mark.slow
def test_each_population_member_keeps_its_average(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir, population=2, ema=0.9)
    jn.train(n)
    avg = host_copy(n.train_state.ema["params"])
    assert all(x.shape[0] == 2 for x in jax.tree.leaves(avg))
    assert not leaves_equal(jax.tree.map(lambda x: x[0], avg), jax.tree.map(lambda x: x[1], avg))
    one = jn.member(n, 1)
    assert leaves_equal(one.train_state.ema["params"], jax.tree.map(lambda x: x[1], avg))
    assert jn.evaluate(one, "val") != jn.evaluate(one, "val", weights="raw")


def test_the_checkpointer_may_rank_by_the_raw_weights_metrics(run_dir):
    ck = jn.TopKCheckpointer(k=1, metric="val_raw_loss")
    result = jn.train(
        nitro(Tiny(max_epochs=2), run_dir=run_dir, checkpointer=ck, ema=0.9, ema_eval="both")
    )
    _, meta = jn.load_checkpoint(result.best_checkpoint)
    assert meta["metrics"]["val_raw_loss"] == min(r["val_raw_loss"] for r in result.history)


@pytest.mark.slow
def test_fused_steps_give_the_same_average_and_bf16_keeps_it_f32(run_dir):
    one = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "a", ema=0.9, ema_every=3)
    fused = nitro(
        Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "b", ema=0.9, ema_every=3, steps_per_call=4
    )
    jn.train(one)
    jn.train(fused)
    assert leaves_equal(one.train_state.ema, fused.train_state.ema)
    bf16 = nitro(
        Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "c", ema=0.9, precision="bf16", accum=2
    )
    jn.train(bf16)
    avg = bf16.train_state.ema["params"]
    assert {x.dtype for x in jax.tree.leaves(avg)} == {np.dtype(np.float32)}
    assert not leaves_equal(avg, bf16.params)


FSDP_SCRIPT = """
import json, sys, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("ignore")
import jax, numpy as np
from conftest import Tiny, host_copy, nitro
import jaxnitro as jn

assert len(jax.devices()) == 8
tmp, out = {tmp!r}, {{}}
fsdp = jn.Sharding(fsdp=True, min_shard_bytes=0)  # every divisible array is split


def run(name, epochs, **kw):
    n = nitro(Tiny(max_epochs=epochs, val_batch=40), run_dir=tmp + "/" + name, ema=0.9, **kw)
    jn.train(n)
    return n


def specs(n):
    ts = n.train_state
    pairs = zip(jax.tree.leaves(ts.params), jax.tree.leaves(ts.ema["params"]), strict=True)
    return [[str(p.sharding.spec), str(e.sharding.spec), p.sharding == e.sharding]
            for p, e in pairs]


def diff(a, b):
    return max(float(np.abs(x - y).max()) for x, y in
               zip(jax.tree.leaves(host_copy(a)), jax.tree.leaves(host_copy(b)), strict=True))


one = run("one", 2, n_devices=1)
straight = run("fsdp", 2, n_devices=8, sharding=fsdp)
out["specs"] = specs(straight)
out["vs_one"] = diff(straight.train_state.ema, one.train_state.ema)
run("resumed", 1, n_devices=8, sharding=fsdp)
resumed = run("resumed", 2, n_devices=8, sharding=fsdp, resume="auto")
out["resumed_specs"] = specs(resumed)
out["resumed_vs_straight"] = diff(resumed.train_state.ema, straight.train_state.ema)
out["resumed_step"] = [resumed.step, straight.step]
print("OUT" + json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.multi_device
def test_fsdp_shards_the_average_like_the_params_and_resumes_it(tmp_path):
    script = tmp_path / "fsdp_ema.py"
    script.write_text(FSDP_SCRIPT.format(tests=str(TESTS), tmp=str(tmp_path)))
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
    }
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.split("OUT", 1)[1])
    for specs in (out["specs"], out["resumed_specs"]):
        assert any("data" in param for param, _, _ in specs)  # FSDP did split something
        for param, average, same in specs:
            assert same, f"the average is placed as {average}, its param as {param}"
    assert out["vs_one"] < 1e-5  # the sharded average is the one-device average
    assert out["resumed_step"][0] == out["resumed_step"][1]
    assert out["resumed_vs_straight"] == 0.0  # the resume continues it bit for bit
