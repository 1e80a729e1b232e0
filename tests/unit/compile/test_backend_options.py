"""The XLA options a program is compiled with by default (`compile/backend_options.py`): on a
CPU, YNNPACK fusion off where the jaxlib knows the option; a run's `compile_options` replace
them; `jn.train_step` takes them too."""

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


def test_the_cpu_defaults_are_known_here_and_other_backends_get_none(known):
    assert backend_options.defaults("cpu") == backend_options.CPU
    assert backend_options.defaults("gpu") == {} and backend_options.defaults("tpu") == {}
    assert backend_options.defaults("cpu") is not backend_options.CPU  # a copy to keep


def test_an_option_this_jaxlib_does_not_know_is_left_out(monkeypatch):
    monkeypatch.setattr(backend_options, "CPU", {"xla_cpu_not_an_option_here": ""})
    backend_options.cpu_known.cache_clear()
    try:
        assert not backend_options.cpu_known() and backend_options.defaults("cpu") == {}
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
    assert _fused_by_ynn(own.programs.train[("train", 1)].compiled)
    given = nitro(
        Tiny(max_epochs=1, n_val=0),
        run_dir=run_dir / "c",
        compile_options={"xla_backend_optimization_level": 2},
    )
    assert dict(given.spec.compile_options) == {"xla_backend_optimization_level": 2}


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
    jax.block_until_ready(ts.params)
