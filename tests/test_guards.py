"""Pitfall guards through the driver: stale programs, miss explanations, blow-ups, memory."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, make_data, nitro

import jaxnitro as jn


def test_graphconst_change_is_explained(run_dir):
    jn.train(nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    n = nitro(Tiny(max_epochs=1, n_val=0, width=24), run_dir=run_dir / "b")
    jn.train(n)
    why = jn.explain(n)
    assert why and any("GraphConst `width` changed 16 → 24" in r for r in why[0]["reasons"])


def test_predict_bucket_compile_is_explained_with_the_shape(run_dir):
    jn.cache_reset()  # other tests predict with Tiny too: make these two real compiles
    n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir)
    x, _ = make_data(12)
    jn.predict(n, {"x": x[:8]})
    jn.predict(n, {"x": x[:3]})  # padded to the next bucket, 4 rows: planned, no warning
    why = [r for row in jn.explain(n) if row["kind"] == "predict" for r in row["reasons"]]
    assert any("(8, 8) → (4, 8)" in r for r in why), why
    assert not any("drop_last" in r for r in why)  # predict pads to buckets: not a short batch
    assert any("another predict bucket" in r for r in why)


def test_live_nitro_warns_once_when_a_hook_is_edited(run_dir):
    @jn.experiment
    class Live(Tiny):
        pass

    n = nitro(Live(max_epochs=1, n_val=0), run_dir=run_dir)
    jn.train(n)
    misses = jn.cache_stats()["misses"]

    def loss(self, logits, *, y):
        return 3.0 * Tiny.loss(self, logits, y=y)

    Live.loss = loss
    n.max_epochs = 2
    with pytest.warns(UserWarning, match=r"`loss` changed since this Nitro compiled"):
        jn.train(n)
    assert jn.cache_stats()["misses"] == misses + 1


def test_helper_method_edit_is_seen(run_dir):
    @jn.experiment
    class WithHelper(Tiny):
        def scale(self):
            return 1.0

        def loss(self, logits, *, y):
            return self.scale() * Tiny.loss(self, logits, y=y)

    jn.train(nitro(WithHelper(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    misses = jn.cache_stats()["misses"]
    WithHelper.scale = lambda self: 2.0
    n = nitro(WithHelper(max_epochs=1, n_val=0), run_dir=run_dir / "b")
    jn.train(n)
    assert jn.cache_stats()["misses"] == misses + 1


MODULE = """
import jax, optax
import jaxnitro as jn
from conftest import Tiny

SCALE = {scale}

def penalty(logits):
    return {penalty} * (logits ** 2).mean()

@jn.experiment
class Reloadable(Tiny):
    def loss(self, logits, *, y):
        return SCALE * Tiny.loss(self, logits, y=y) + penalty(logits)
"""


@pytest.mark.parametrize("edit", ["helper", "constant", "unchanged"])
def test_reload_of_an_edited_module(tmp_path, run_dir, monkeypatch, edit):
    name = f"reloadable_{edit}"
    path = tmp_path / f"{name}.py"
    path.write_text(MODULE.format(scale=1.0, penalty=0.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module(name)
    jn.train(nitro(mod.Reloadable(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    misses = jn.cache_stats()["misses"]
    if edit == "helper":
        path.write_text(MODULE.format(scale=1.0, penalty=0.5))
    elif edit == "constant":
        path.write_text(MODULE.format(scale=2.0, penalty=0.0))
    else:
        path.write_text(MODULE.format(scale=1.0, penalty=0.0) + "\n\n# a comment\n")
    os.utime(path, (0, 1e9 + 10))  # a new mtime, whatever the clock resolution
    mod = importlib.reload(mod)
    n = nitro(mod.Reloadable(max_epochs=1, n_val=0), run_dir=run_dir / "b")
    jn.train(n)
    assert jn.cache_stats()["misses"] == misses + (0 if edit == "unchanged" else 1)
    if edit == "helper":
        assert any("penalty" in r for w in jn.explain(n) for r in w["reasons"])


def test_documented_hole_mutated_global_array_and_the_escape_hatch(run_dir):
    """docs/recompilation.md: an array mutated in place inside a global object is not seen."""
    import conftest

    conftest.TABLE = {"w": np.ones(4, np.float32)}

    @jn.experiment
    class Hole(Tiny):
        def loss(self, logits, *, y):
            import conftest as c

            return (jnp.asarray(c.TABLE["w"]) * logits).mean() + Tiny.loss(self, logits, y=y)

    jn.train(nitro(Hole(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    misses = jn.cache_stats()["misses"]
    conftest.TABLE["w"][:] = 5.0  # in place, inside a module attribute: invisible to the key
    jn.train(nitro(Hole(max_epochs=1, n_val=0), run_dir=run_dir / "b"))
    assert jn.cache_stats()["misses"] == misses  # the documented hole: the stale program ran
    jn.cache_reset()
    jn.train(nitro(Hole(max_epochs=1, n_val=0), run_dir=run_dir / "c"))
    assert jn.cache_stats()["misses"] == 1  # the escape hatch recompiles


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


def test_memory_plan_refuses_before_step_one(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir, memory_budget=2048)
    with pytest.raises(jn.MemoryPlanError) as e:
        jn.train(n)
    msg = str(e.value)
    assert "params" in msg and "optimizer state" in msg and "temporaries" in msg
    assert n.step == 0 and n.checkpointer.latest() is None
    plan = jn.memory_plan(nitro(Tiny(), run_dir=run_dir / "b"))
    assert plan.fits and plan.total > plan.params_bytes > 0


def test_inspect_prints_binding_groups_programs_and_memory(run_dir, capsys):
    n = nitro(Tiny(), run_dir=run_dir)
    result = jn.inspect(n)
    out = capsys.readouterr().out
    assert "width" in out and "GraphConst" in out and "forward() receives: x" in out
    assert "default" in out and "radam" in out
    assert "train" in out and "eval" in out and "capacity" in out
    assert result.memory


PERSIST = textwrap.dedent("""
    import sys, jax
    sys.path.insert(0, {tests!r})
    import jaxnitro as jn
    hits = []
    jax.monitoring.register_event_listener(
        lambda name, **kw: hits.append(name) if "cache_hits" in name else None)
    jn.setup_devices(backend="cpu", compilation_cache={cache!r})
    from conftest import Tiny, nitro
    jn.train(nitro(Tiny(max_epochs=1, n_val=0), run_dir={run!r}))
    print("HITS", len(hits))
""")


@pytest.mark.slow
def test_persistent_compilation_cache_is_reused_by_a_second_process(tmp_path):
    cache = tmp_path / "xla-cache"
    script = tmp_path / "run.py"
    tests = os.path.dirname(__file__)
    script.write_text(PERSIST.format(tests=tests, cache=str(cache), run=str(tmp_path / "run")))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    outs = [
        subprocess.run(
            [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
        )
        for _ in range(2)
    ]
    for o in outs:
        assert o.returncode == 0, o.stderr[-2000:]
    first = int(outs[0].stdout.split("HITS")[-1])
    second = int(outs[1].stdout.split("HITS")[-1])
    assert first == 0 and second >= 1
    assert any(cache.iterdir())


def test_compile_options_reach_xla_and_the_key(run_dir):
    jn.cache_reset()
    jn.train(nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "a"))
    n = nitro(
        Tiny(max_epochs=1, n_val=0),
        run_dir=run_dir / "b",
        compile_options={"xla_embed_ir_in_executable": True},
    )
    jn.train(n)
    assert jn.cache_stats()["misses"] == 2  # a new program for the new options
    assert any("compile option" in r for w in jn.explain(n) for r in w["reasons"])
    with pytest.raises(jn.ConfigError, match="compile_options maps XLA option names"):
        nitro(Tiny(), run_dir=run_dir / "c", compile_options={"x": [1]})
