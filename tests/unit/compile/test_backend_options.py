"""The XLA options a program is compiled with by default (`compile/backend_options.py`): on a
CPU, for batches of at most SMALL_ROWS rows, YNNPACK fusion off where the jaxlib knows the
option; a run's `compile_options` replace them; `jn.train_step` takes them too."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from conftest import Tiny, TinyMLP, nitro
from flax import nnx

import jaxnitro as jn
from jaxnitro._src.compile import backend_options


@pytest.fixture
def known():
    if not backend_options.cpu_known():
        pytest.skip("this jaxlib's CPU compiler does not know the option")


def _fused_by_ynn(compiled) -> bool:
    return "ynn" in compiled.as_text().lower()


def _xla_fuses_dots_with_ynn() -> bool:
    """Whether XLA's own defaults give a small dot a YNNPACK fusion on this machine's CPU."""
    dot = jax.jit(lambda a, b: a @ b).lower(np.ones((32, 64), np.float32), np.ones((64, 16)))
    return _fused_by_ynn(dot.compile())


def test_the_cpu_defaults_are_for_small_batches_and_other_backends_get_none(known):
    small = backend_options.SMALL_ROWS
    assert backend_options.defaults("cpu", 32) == backend_options.CPU
    assert backend_options.defaults("cpu", small) == backend_options.CPU
    assert backend_options.defaults("cpu", None) == backend_options.CPU  # not known: small
    assert backend_options.defaults("cpu", small + 1) == {}  # YNNPACK is as fast from here
    assert backend_options.defaults("gpu", 32) == {} and backend_options.defaults("tpu", 8) == {}
    assert backend_options.defaults("cpu", 32) is not backend_options.CPU  # a copy to keep


def test_an_option_this_jaxlib_does_not_know_is_left_out(monkeypatch):
    monkeypatch.setattr(backend_options, "CPU", {"xla_cpu_not_an_option_here": ""})
    backend_options.cpu_known.cache_clear()
    try:
        assert not backend_options.cpu_known() and backend_options.defaults("cpu", 32) == {}
    finally:
        backend_options.cpu_known.cache_clear()


def test_a_run_compiles_with_the_defaults_unless_it_gives_its_own(run_dir, known):
    default = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "a")
    assert dict(default.spec.compile_options) == backend_options.CPU
    jn.train(default)
    assert not _fused_by_ynn(default.programs.train[("train", 1)].compiled)
    # compile_options={} is XLA's own defaults: its dots go to YNNPACK fusions
    own = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir / "b", compile_options={})
    assert dict(own.spec.compile_options) == {}
    jn.train(own)
    if _xla_fuses_dots_with_ynn():  # (a CPU YNNPACK does not serve gets none either way)
        assert _fused_by_ynn(own.programs.train[("train", 1)].compiled)
    given = nitro(
        Tiny(max_epochs=1, n_val=0),
        run_dir=run_dir / "c",
        compile_options={"xla_backend_optimization_level": 2},
    )
    assert dict(given.spec.compile_options) == {"xla_backend_optimization_level": 2}


@jn.experiment
class Wide(Tiny):
    """Batches of 1,024 rows: XLA's own defaults."""

    def build_data(self, dist):
        x = np.ones((1024, 8), np.float32)
        return {"train": jn.DataLoader({"x": x, "y": np.zeros(1024, np.int32)}, batch_size=1024)}


def test_a_run_of_large_batches_takes_xla_own(run_dir, known):
    n = nitro(Wide(max_epochs=1, n_val=0), run_dir=run_dir)
    assert dict(n.spec.compile_options) == {}


def test_train_step_compiles_with_the_defaults(known, monkeypatch):
    from jaxnitro._src.compile import cache

    compiled = []
    real = cache.get_or_compile

    def recording(key, lower, **kw):
        prog = real(key, lower, **kw)
        if kw.get("kind") == "train_step":
            compiled.append((kw.get("compile_options"), prog.compiled))
        return prog

    monkeypatch.setattr(cache, "get_or_compile", recording)
    model, params, state = jn.split_model(TinyMLP(16, rngs=nnx.Rngs(0)))
    ts = jn.TrainState.create(model, params, state, optax.adam(1e-2))

    def loss_fn(model, params, state, batch):
        logits, state = jn.apply(model, params, state, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), state

    batch = {"x": np.ones((32, 8), np.float32), "y": np.zeros(32, np.int32)}
    ts, loss, _ = jn.train_step(loss_fn, ts, batch)
    assert np.isfinite(float(loss))
    [(options, program)] = compiled
    assert options == backend_options.CPU and not _fused_by_ynn(program)
    big = {"x": np.ones((1024, 8), np.float32), "y": np.zeros(1024, np.int32)}
    ts, loss, _ = jn.train_step(loss_fn, ts, big)  # another batch shape: its own program
    assert compiled[-1][0] == {} and np.isfinite(float(loss))
    jax.block_until_ready(ts.params)


def _lowered(n: int):
    """A dot of an n x n matrix (2 n^3 FLOPs, and XLA's estimate says so)."""
    x = np.ones((n, n), np.float32)
    return jax.jit(lambda a, b: a @ b).lower(x, x)


def test_one_thread_is_resolved_per_program_by_its_flops():
    one = backend_options.ONE_THREAD
    small, big = _lowered(8), _lowered(512)  # 1,024 and ~2.7e8 FLOPs
    assert backend_options.resolve({one: 1e6}, small) == {"xla_cpu_multi_thread_eigen": False}
    assert backend_options.resolve({one: 1e6}, big) == {}  # Eigen's threads pay off here
    options = {"xla_cpu_experimental_ynn_fusion_type": "", one: 1e6}
    assert backend_options.resolve(options, small) == {
        "xla_cpu_experimental_ynn_fusion_type": "",
        "xla_cpu_multi_thread_eigen": False,
    }
    assert options[one] == 1e6  # (the caller's dict is left as it was)
    given = {"xla_backend_optimization_level": 2}  # a dict of XLA options: as it is
    assert backend_options.resolve(given, small) == given
    assert backend_options.resolve({one: 1.0}, small) == {}  # not under the bound


def test_one_thread_without_a_flop_estimate_changes_nothing(monkeypatch):
    from jaxnitro._src.compile import report

    monkeypatch.setattr(report, "flops", lambda stage: None)  # a backend without a cost model
    assert backend_options.resolve({backend_options.ONE_THREAD: 1e6}, _lowered(8)) == {}


def test_programs_compile_with_the_options_resolved_for_them(run_dir, known, monkeypatch):
    # the compile sees XLA's options only: jaxnitro's own is replaced per program
    seen = []
    real = backend_options.resolve

    def recording(options, lowered):
        out = real(options, lowered)
        seen.append((dict(options), out))
        return out

    monkeypatch.setattr(backend_options, "resolve", recording)
    jn.cache_reset()  # (compiled by an earlier test: compiled again here)
    n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir)
    jn.train(n)
    assert seen and all(backend_options.ONE_THREAD not in out for _, out in seen)
    train = [out for options, out in seen if options == backend_options.CPU]
    assert train and all(out["xla_cpu_multi_thread_eigen"] is False for out in train)  # small


def test_options_xla_would_refuse_are_a_config_error_before_anything_runs(run_dir):
    with pytest.raises(jn.ConfigError, match="No such compile option: 'xla_no_such_flag'"):
        nitro(Tiny(max_epochs=1), run_dir=run_dir / "a", compile_options={"xla_no_such_flag": 1})
    bad = {"xla_backend_optimization_level": "high"}
    with pytest.raises(jn.ConfigError, match="xla_backend_optimization_level.*not a valid"):
        nitro(Tiny(max_epochs=1), run_dir=run_dir / "b", compile_options=bad)
    assert not (run_dir / "a" / "metrics.jsonl").exists()
    own = {backend_options.ONE_THREAD: 1e6, "xla_backend_optimization_level": 2}
    assert (
        dict(
            nitro(
                Tiny(max_epochs=1), run_dir=run_dir / "c", compile_options=own
            ).spec.compile_options
        )
        == own
    )  # jaxnitro's own entry is not XLA's to refuse
