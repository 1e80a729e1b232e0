"""benchmarks/host.py's Keras row: Keras `fit` does the same work per step as jaxnitro's run
(`benchmarks/keras_ref.py`), and the table shows it beside the hand loop's."""

from __future__ import annotations

import importlib.util
import sys

import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers.paths import ROOT

BENCH = ROOT / "benchmarks"


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (host.py imports keras_ref and run by these names)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def keras_ref(monkeypatch):
    monkeypatch.setenv("KERAS_BACKEND", "jax")  # (restored after: the env keys programs)
    pytest.importorskip("keras")
    monkeypatch.syspath_prepend(str(BENCH))
    return load("keras_ref")


@pytest.mark.slow
def test_the_keras_optimizer_is_optax_radam(keras_ref):
    import keras

    w0 = np.array([1.0, -2.0, 3.0], np.float32)
    weights = keras.Variable(w0)
    ours = keras_ref.RAdam(1e-2)
    ours.build([weights])
    tx = optax.radam(1e-2)
    params = jnp.asarray(w0)
    state = tx.init(params)
    for i in range(10):  # the first steps unrectified, then rectified (rho_t >= 5 from step 6)
        grad = np.array([0.1 * (i + 1), -0.3, 0.05 * i * i], np.float32)
        ours.apply([grad], [weights])
        updates, state = tx.update(jnp.asarray(grad), state, params)
        params = optax.apply_updates(params, updates)
    np.testing.assert_allclose(np.asarray(weights.value), np.asarray(params), atol=1e-5)
    assert not np.allclose(np.asarray(weights.value), w0)


def test_the_host_table_has_the_keras_row(keras_ref):
    host = load("host")
    assert host.keras_ref is not None
    items = {
        "dispatch wrapper": (1.0, 0.8),
        "feed.prepare": (2.0, 1.5),
        "compiled call (the floor)": (50.0, 30.0),
    }
    row = {
        "batch": 32,
        "hand_steps_per_s": 3000.0,
        "jaxnitro_steps_per_s": 3300.0,
        "ratio": 1.1,
        "ratios": [1.1],
        "added_us_per_step": -30.0,
        "cpu_ratio": 1.05,
        "cpu_ratios": [1.05],
        "added_cpu_us_per_step": -10.0,
        "added_thread_us_per_step": -40.0,
        "bare_steps_per_s": 3400.0,
        "bare_ratio": 0.97,
        "over_bare_us_per_step": 9.0,
        "keras_steps_per_s": 2500.0,
        "keras_ratio": 1.32,
        "keras_ratios": [1.32],
        "keras_cpu_ratio": 1.2,
        "items_us_per_step": items,
    }
    text = host.table([row], 1)
    assert "Keras 3 `fit`" in text
    assert "| 32 | 2,500 | 1.32× (1.32) | 1.20× |" in text
    # each item as wall / the training thread's CPU, and their sum less the call's
    assert "| dispatch wrapper | 1.0 / 0.8 |" in text
    assert "| host work (all but the call) | 3.0 / 2.3 |" in text
    assert "| -10.0 | -40.0 |" in text
    assert "| 32 | 3,400 | 0.970× | +9.0 |" in text  # the run against its own bare loop
    no_keras = host.table([{**row, "keras_ratio": None}], 1)
    assert "Keras" not in no_keras
