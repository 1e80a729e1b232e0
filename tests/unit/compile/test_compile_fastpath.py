"""The fast path of compile discipline III: a closed key proves a program unchanged.

A key whose fingerprints cover by content everything the trace reads (no gaps) runs the
program a trace already gave it, with no trace; a key with a gap (an object by identity,
`getattr`, an import inside a function, a helper below the depth) is checked against a trace
at every call. No time window: an edit right after a call reaches the next one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, TinyMLP, make_data
from flax import nnx

import jaxnitro as jn
from jaxnitro._src.compile import cache
from jaxnitro._src.compile.fingerprint import fingerprint


@pytest.fixture(autouse=True)
def fresh_cache():
    jn.cache_reset()
    yield


@pytest.fixture
def traces(monkeypatch):
    """How many programs were traced and lowered (a check or a compile)."""
    count = [0]
    real = cache._lower

    def counting(lower):
        count[0] += 1
        return real(lower)

    monkeypatch.setattr(cache, "_lower", counting)
    return count


X, Y = make_data(16)
GAIN = 1.0


def gaps_of(fn) -> list[str]:
    found: list[str] = []
    fingerprint(fn, gaps=found)
    return found


# -- what a fingerprint cannot cover ---------------------------------------------------------


class Opaque:
    scale = 2.0


OPAQUE = Opaque()


def closed(x):
    return x * GAIN


def through_getattr(x):
    return x * getattr(OPAQUE, "scale")  # noqa: B009 (the read under test)


def importing(x):
    import math

    return x * math.pi


def by_identity(x):
    return x * OPAQUE.scale


def level3(x):
    return x * GAIN


def level2(x):
    return level3(x)


def level1(x):
    return level2(x)


def deep(x):
    return level1(x)


def test_a_fingerprint_names_what_it_cannot_cover():
    assert gaps_of(closed) == []
    assert any("getattr" in g for g in gaps_of(through_getattr))
    assert any("import" in g for g in gaps_of(importing))
    assert any("by identity" in g for g in gaps_of(by_identity))
    assert any("level3" in g and "below the depth" in g for g in gaps_of(deep))
    bound = type("Holder", (), {"f": lambda self, x: x * self.k, "k": 1.0})()
    assert any("by identity" in g for g in gaps_of(bound.f))


# -- entry points ---------------------------------------------------------------------------


@jn.experiment
class Scaled(Tiny):
    def forward(self, model, params, state, *, x):
        out, state = jn.apply(model, params, state, x)
        return out * GAIN, state


def eager(n, gain) -> np.ndarray:
    out, _ = jn.apply(n.model, n.params, n.state, jnp.asarray(X))
    return np.asarray(out) * gain


def test_a_predict_loop_on_a_closed_key_traces_nothing_and_sees_each_edit(tmp_path, traces):
    global GAIN
    GAIN = 1.0
    n = jn.Nitro(Scaled(n_val=0), run_dir=tmp_path, progress="off")
    jn.predict(n, {"x": X})
    assert traces[0] == 1  # the compile
    for _ in range(5):
        np.testing.assert_allclose(jn.predict(n, {"x": X}), eager(n, 1.0), rtol=1e-5, atol=1e-5)
    assert traces[0] == 1  # proven by the key: no check
    for gain in (3.0, 0.5, 3.0):  # each right after the last call
        GAIN = gain
        np.testing.assert_allclose(jn.predict(n, {"x": X}), eager(n, gain), rtol=1e-5, atol=1e-5)
    # each edit traced once; back at 3.0 the key dropped as stale is traced again and finds
    # its text compiled: 3 programs in all
    assert traces[0] == 4 and jn.cache_stats()["misses"] == 3
    for _ in range(3):
        jn.predict(n, {"x": X})
    assert traces[0] == 4
    GAIN = 1.0


def test_a_cached_train_start_up_traces_nothing(tmp_path, traces):
    jn.train(jn.Nitro(Tiny(max_epochs=1, n_val=0), run_dir=tmp_path / "a", progress="off"))
    before, misses = traces[0], jn.cache_stats()["misses"]
    jn.train(jn.Nitro(Tiny(max_epochs=1, n_val=0), run_dir=tmp_path / "b", progress="off"))
    assert traces[0] == before and jn.cache_stats()["misses"] == misses


# -- jn.train_step: keyed by content ----------------------------------------------------------

WEIGHT = 1.0
HOLDER = {"w": np.ones((), np.float32)}


def base_loss(model, params, state, batch):
    logits, state = jn.apply(model, params, state, batch["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), state


def regularized(model, params, state, batch):
    loss, state = base_loss(model, params, state, batch)
    return loss + 1e-3 * helper_term(params), state


def helper_term(params):
    return WEIGHT * sum(jnp.sum(p**2) for p in leaves_of(params))


def leaves_of(tree):
    return jax.tree.leaves(tree)


def expected(fn, ts, batch) -> float:
    return float(fn(ts.model, ts.params, ts.state, batch)[0])


def fresh_state():
    model, params, state = jn.split_model(TinyMLP(16, rngs=nnx.Rngs(0)))
    return jn.TrainState.create(model, params, state, optax.sgd(0.0))  # (rate 0: same params)


def scaled_loss(model, params, state, batch):
    loss, state = base_loss(model, params, state, batch)
    return loss * WEIGHT, state


@pytest.mark.slow
def test_train_step_sees_a_module_global_its_same_function_reads():
    """Failed before: the train step was keyed by the function object's identity."""
    global WEIGHT
    WEIGHT = 1.0
    batch = {"x": X, "y": Y}
    ts = fresh_state()
    ts, loss, _ = jn.train_step(scaled_loss, ts, batch)
    assert float(loss) == pytest.approx(expected(scaled_loss, ts, batch), rel=1e-5)
    WEIGHT = 3.0
    ts, loss, _ = jn.train_step(scaled_loss, ts, batch)  # the returned state, fed back
    assert float(loss) == pytest.approx(expected(scaled_loss, ts, batch), rel=1e-5)
    WEIGHT = 1.0


@pytest.mark.slow
def test_train_step_sees_an_edited_helper_of_its_same_function():
    global helper_term
    batch = {"x": X, "y": Y}
    ts = fresh_state()
    ts, first, _ = jn.train_step(regularized, ts, batch)
    original = helper_term

    def helper_term(params):  # the cell that defines the helper, re-run edited
        return 1e4 * sum(jnp.sum(p**2) for p in leaves_of(params))

    try:
        ts, loss, _ = jn.train_step(regularized, ts, batch)
        assert float(loss) == pytest.approx(expected(regularized, ts, batch), rel=1e-5)
        assert float(loss) > float(first) + 1.0
    finally:
        helper_term = original


def in_place_loss(model, params, state, batch):
    loss, state = base_loss(model, params, state, batch)
    return loss * jnp.asarray(globals()["HOLDER"]["w"]), state


@pytest.mark.slow
def test_train_step_with_a_gap_is_checked_by_trace_at_each_call():
    batch = {"x": X, "y": Y}
    ts = fresh_state()
    HOLDER["w"][...] = 1.0
    ts, loss, _ = jn.train_step(in_place_loss, ts, batch)
    HOLDER["w"][...] = 5.0  # in place, through globals(): only the trace sees it
    ts, loss, _ = jn.train_step(in_place_loss, ts, batch)
    assert float(loss) == pytest.approx(expected(in_place_loss, ts, batch), rel=1e-5)
    HOLDER["w"][...] = 1.0


# -- the remembered fingerprint: a later call re-checks only what the first one read ----------

SCALES = np.ones(2, np.float32)
FACTORS = [1.0]


def array_loss(model, params, state, batch):
    loss, state = base_loss(model, params, state, batch)
    return loss * float(SCALES.sum()) * FACTORS[0], state


def run_a_few(fn, ts, batch, n=4):
    for _ in range(n):
        ts, loss, _ = jn.train_step(fn, ts, batch)
    return ts, loss


@pytest.mark.slow
def test_after_several_calls_an_edited_global_of_a_helper_is_seen():
    global WEIGHT
    batch = {"x": X, "y": Y}
    ts, first = run_a_few(regularized, fresh_state(), batch)
    try:
        WEIGHT = 1e4  # read by `helper_term`, which `regularized` calls
        ts, loss, _ = jn.train_step(regularized, ts, batch)
        assert float(loss) == pytest.approx(expected(regularized, ts, batch), rel=1e-5)
        assert float(loss) > float(first) + 1.0
    finally:
        WEIGHT = 1.0


@pytest.mark.slow
def test_after_several_calls_a_redefined_or_patched_helper_runs():
    global leaves_of
    batch = {"x": X, "y": Y}
    ts, first = run_a_few(regularized, fresh_state(), batch)
    original, code = leaves_of, leaves_of.__code__

    def leaves_of(tree):  # re-defined: a new function under the same global name
        return [1e3 * x for x in jax.tree.leaves(tree)]

    try:
        ts, loss, _ = jn.train_step(regularized, ts, batch)
        assert float(loss) == pytest.approx(expected(regularized, ts, batch), rel=1e-5)
        assert float(loss) > float(first) + 1.0
        leaves_of = original
        ts, back = run_a_few(regularized, ts, batch)
        assert float(back) == pytest.approx(float(first), rel=1e-5)
        original.__code__ = (lambda tree: [0.0 * x for x in jax.tree.leaves(tree)]).__code__
        ts, patched, _ = jn.train_step(regularized, ts, batch)  # the same object, new code
        assert float(patched) == pytest.approx(expected(base_loss, ts, batch), rel=1e-5)
    finally:
        leaves_of = original
        original.__code__ = code


@pytest.mark.slow
def test_after_several_calls_a_global_array_or_list_changed_in_place_is_seen():
    batch = {"x": X, "y": Y}
    SCALES[...], FACTORS[0] = 1.0, 1.0
    ts, first = run_a_few(array_loss, fresh_state(), batch)
    try:
        SCALES[...] = 3.0  # in place: the same array object
        ts, loss, _ = jn.train_step(array_loss, ts, batch)
        assert float(loss) == pytest.approx(3.0 * float(first), rel=1e-5)
        ts, _ = run_a_few(array_loss, ts, batch)
        FACTORS[0] = 0.5  # in place: the same list object
        ts, loss, _ = jn.train_step(array_loss, ts, batch)
        assert float(loss) == pytest.approx(1.5 * float(first), rel=1e-5)
    finally:
        SCALES[...], FACTORS[0] = 1.0, 1.0
