"""The compile-discipline scenario suite: for each common way users change a run, how many
programs compile, and what the explanation says.

Each test is one scenario: its name, the expected number of new compiles, and the words the
explanation must (and must not) contain. Compiles are counted with `jn.cache_stats()`.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, make_data, nitro

import jaxnitro as jn

# Modules the reload scenarios import (set by those tests): hooks read them as module globals,
# the way `import losses` at the top of a user's file does.
SCALE_MOD = None
LOSSES = None


def misses() -> int:
    return jn.cache_stats()["misses"]


def compiled(n) -> int:
    """Compile every planned program of `n`; returns how many were new."""
    before = misses()
    jn.compile(n)
    return misses() - before


def reasons(n) -> str:
    return " | ".join(r for row in jn.explain(n) for r in row["reasons"])


@pytest.fixture(autouse=True)
def fresh_cache():
    jn.cache_reset()
    yield


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_train_and_val_compile_two_programs(run_dir):
    n = nitro(Tiny(max_epochs=1, val_batch=20), run_dir=run_dir)
    result = jn.train(n)
    assert result.programs_compiled == 2
    stats = jn.cache_stats()
    assert stats["misses"] == stats["entries"] == 2


@pytest.mark.parametrize("change", [{"smoothing": 0.3}, {"max_epochs": 5}, {"shuffle": False}])
def test_device_and_host_changes_compile_nothing(run_dir, change):
    assert compiled(nitro(Tiny(), run_dir=run_dir / "a")) == 2
    assert compiled(nitro(Tiny(**change), run_dir=run_dir / "b")) == 0


def test_a_seed_change_compiles_nothing(run_dir):
    assert compiled(nitro(Tiny(), run_dir=run_dir / "a", seed=1)) == 2
    assert compiled(nitro(Tiny(), run_dir=run_dir / "b", seed=2)) == 0


def test_a_device_value_as_numpy_float32_compiles_nothing(run_dir):
    n = nitro(Tiny(), run_dir=run_dir)
    assert compiled(n) == 2
    jn.set_device(n, smoothing=np.float32(0.2))
    before = misses()
    jn.validate(n)
    jn.set_device(n, smoothing=0.1)  # a Python float: still strongly typed on the device
    jn.validate(n)
    assert misses() == before


@pytest.mark.slow
def test_a_graphconst_change_compiles_each_program_once_and_says_so(run_dir):
    assert compiled(nitro(Tiny(width=16), run_dir=run_dir / "a")) == 2
    n = nitro(Tiny(width=24), run_dir=run_dir / "b")
    assert compiled(n) == 2
    why = reasons(n)
    assert why.count("GraphConst `width` changed 16 → 24") == 2
    # back to a seen value: nothing new
    assert compiled(nitro(Tiny(width=16), run_dir=run_dir / "c")) == 0


@pytest.mark.slow
def test_an_accum_change_is_explained_as_accum_only(run_dir):
    assert compiled(nitro(Tiny(n_val=0), run_dir=run_dir / "a")) == 1
    n = nitro(Tiny(n_val=0), run_dir=run_dir / "b", accum=2)
    assert compiled(n) == 1
    why = reasons(n)
    assert "accum 1 → 2" in why
    assert "shape of" not in why and "dtype of" not in why, why


@pytest.mark.slow
def test_a_steps_per_call_change_is_explained_as_such(run_dir):
    assert compiled(nitro(Tiny(n_val=0), run_dir=run_dir / "a")) == 1
    n = nitro(Tiny(n_val=0), run_dir=run_dir / "b", steps_per_call=4)
    assert compiled(n) == 1
    why = reasons(n)
    assert "steps_per_call 1 → 4" in why and "shape of" not in why, why


@pytest.mark.slow
def test_a_precision_change_is_explained(run_dir):
    assert compiled(nitro(Tiny(n_val=0), run_dir=run_dir / "a")) == 1
    n = nitro(Tiny(n_val=0), run_dir=run_dir / "b", precision="bf16")
    assert compiled(n) == 1
    assert "precision 'f32' → 'bf16'" in reasons(n)


@pytest.mark.slow
def test_an_unchanged_class_redefinition_compiles_nothing(run_dir):
    src = textwrap.dedent("""
        import jaxnitro as jn
        from conftest import Tiny

        @jn.experiment
        class Again(Tiny):
            def loss(self, logits, *, y):
                return Tiny.loss(self, logits, y=y) * 2.0
    """)
    ns1, ns2 = {}, {}
    exec(compile(src, "<cell>", "exec"), ns1)
    assert compiled(nitro(ns1["Again"](), run_dir=run_dir / "a")) == 2
    exec(compile(src, "<cell>", "exec"), ns2)  # the notebook cell re-run as is
    assert compiled(nitro(ns2["Again"](), run_dir=run_dir / "b")) == 0


def _cell(body: str) -> type:
    ns: dict = {}
    src = textwrap.dedent("""
        import jax, optax
        import jaxnitro as jn
        from conftest import Tiny

        @jn.experiment
        class Edited(Tiny):
            def loss(self, logits, *, y):
                return {body}
    """).format(body=body)
    exec(compile(src, "<cell>", "exec"), ns)
    return ns["Edited"]


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_an_edited_hook_recompiles_runs_the_new_code_and_says_which(run_dir):
    first = _cell("optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()")
    n1 = nitro(first(n_val=0), run_dir=run_dir / "a")
    assert compiled(n1) == 1
    second = _cell("optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() * 0 + 7.0")
    n2 = nitro(second(n_val=0, max_epochs=1), run_dir=run_dir / "b")
    result = jn.train(n2)
    assert result.programs_compiled == 1
    assert result.history[-1]["train_loss"] == pytest.approx(7.0)  # the new code ran
    why = reasons(n2)
    assert "hook `loss` was edited" in why
    assert "no longer used" not in why and "is now used" not in why, why


def test_a_live_handle_warns_and_evaluates_with_the_edited_code(run_dir):
    @jn.experiment
    class Live(Tiny):
        def metrics(self, logits, *, y):
            return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}

    n = nitro(Live(max_epochs=1), run_dir=run_dir)
    jn.train(n)

    def metrics(self, logits, *, y):
        return {"acc": (y.shape[0] * 0 + 3, 4)}

    Live.metrics = metrics
    before = misses()
    with pytest.warns(
        UserWarning,
        match=r"`metrics` changed.*the eval program.*programs "
        r"that do not call it are kept",
    ):
        values = jn.validate(n)
    assert values["acc"] == pytest.approx(0.75)
    assert misses() == before + 1
    # the train program never calls metrics: training on needs no new compile
    n2 = nitro(Live(max_epochs=1, n_val=0), run_dir=run_dir / "b")
    assert compiled(n2) == 0


@pytest.mark.slow
def test_a_closure_captured_constant(run_dir):
    def make(scale):
        @jn.experiment
        class Closed(Tiny):
            def loss(self, logits, *, y):
                return Tiny.loss(self, logits, y=y) * scale

        return Closed

    assert compiled(nitro(make(1.0)(n_val=0), run_dir=run_dir / "a")) == 1
    assert compiled(nitro(make(1.0)(n_val=0), run_dir=run_dir / "b")) == 0
    n = nitro(make(2.0)(n_val=0), run_dir=run_dir / "c")
    assert compiled(n) == 1
    assert "closure variable `scale`" in reasons(n)


def _module(tmp_path, name, source):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    if str(tmp_path) not in sys.path:
        sys.path.insert(0, str(tmp_path))
    importlib.invalidate_caches()
    return path


def _reload(path, module, source):
    path.write_text(textwrap.dedent(source))
    importlib.invalidate_caches()
    sys.dont_write_bytecode = True
    try:
        return importlib.reload(module)
    finally:
        sys.dont_write_bytecode = False


@pytest.mark.slow
def test_a_module_constant_edited_and_reloaded(tmp_path, run_dir):
    path = _module(tmp_path, "scen_const", "SCALE = 1.0\n")
    import scen_const

    @jn.experiment
    class UsesConst(Tiny):
        def loss(self, logits, *, y):
            return Tiny.loss(self, logits, y=y) * SCALE_MOD.SCALE

    globals()["SCALE_MOD"] = scen_const
    assert compiled(nitro(UsesConst(n_val=0), run_dir=run_dir / "a")) == 1
    _reload(path, scen_const, "SCALE = 1.0\n")
    assert compiled(nitro(UsesConst(n_val=0), run_dir=run_dir / "b")) == 0
    _reload(path, scen_const, "SCALE = 3.0\n")
    n = nitro(UsesConst(n_val=0), run_dir=run_dir / "c")
    assert compiled(n) == 1
    assert "SCALE" in reasons(n)


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_a_helper_reached_as_module_attr_edited_and_reloaded(tmp_path, run_dir):
    path = _module(
        tmp_path,
        "scen_losses",
        """
        def penalty(z):
            return 0.0 * z.sum()
    """,
    )
    import scen_losses

    @jn.experiment
    class UsesHelper(Tiny):
        def loss(self, logits, *, y):
            return Tiny.loss(self, logits, y=y) + LOSSES.penalty(logits)

    globals()["LOSSES"] = scen_losses
    n1 = nitro(UsesHelper(n_val=0, max_epochs=1), run_dir=run_dir / "a")
    jn.train(n1)
    _reload(
        path,
        scen_losses,
        """
        def penalty(z):
            return 0.0 * z.sum() + 5.0
    """,
    )
    n2 = nitro(UsesHelper(n_val=0, max_epochs=1), run_dir=run_dir / "b")
    result = jn.train(n2)
    assert result.programs_compiled == 1
    assert result.history[-1]["train_loss"] > 5.0  # the new helper ran
    assert "penalty" in reasons(n2)


@pytest.mark.slow
def test_a_set_device_sweep_with_a_same_named_loop_variable_compiles_nothing(run_dir):
    @jn.experiment
    class Tol(Tiny):
        tol: jn.Device[float] = 0.5

        def metrics(self, logits, *, y):
            close = (jnp.abs(logits.max(-1)) < self.tol).sum()
            return {
                "acc": ((logits.argmax(-1) == y).sum(), y.shape[0]),
                "close": (close, y.shape[0]),
            }

    n = nitro(Tol(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    before = misses()
    g = Tol.metrics.__globals__
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "metrics changed" warning either
        for tol in [0.5, 1.0, 2.0]:
            g["tol"] = tol  # the loop variable of a notebook cell: a module-level name
            jn.set_device(n, tol=tol)
            jn.validate(n)
    g.pop("tol", None)
    assert misses() == before


@pytest.mark.slow
def test_a_python_loop_is_flagged_with_lax_scan(run_dir):
    @jn.experiment
    class Unrolled(Tiny):
        def forward(self, model, params, state, *, x):
            out, state = jn.apply(model, params, state, x)
            for _ in range(200):
                out = out + jnp.sin(out) * 1e-3
            return out, state

    with pytest.warns(UserWarning, match="jax.lax.scan"):
        jn.compile(nitro(Unrolled(n_val=0), run_dir=run_dir))


@pytest.mark.slow
def test_a_baked_array_is_flagged(run_dir):
    table = np.random.default_rng(0).normal(size=(1024, 1024)).astype(np.float32)  # 4 MiB

    @jn.experiment
    class Baked(Tiny):
        def loss(self, logits, *, y):
            return Tiny.loss(self, logits, y=y) + jnp.asarray(table)[y].mean() * 1e-9

    with pytest.warns(UserWarning, match="constant"):
        jn.compile(nitro(Baked(n_val=0), run_dir=run_dir))


@pytest.mark.slow
def test_a_ragged_val_split_compiles_at_most_three_programs(run_dir):
    n = nitro(Tiny(max_epochs=2, n_val=100, val_batch=30), run_dir=run_dir)
    assert jn.train(n).programs_compiled <= 3


def test_predict_over_ten_batch_sizes_compiles_a_bounded_number(run_dir):
    n = nitro(Tiny(max_epochs=1, n_val=0), run_dir=run_dir)
    jn.train(n)
    x, _ = make_data(300)
    before = misses()
    for size in (1, 3, 7, 9, 15, 17, 20, 31, 32, 270):
        out = jn.predict(n, {"x": x[:size]})
        assert out.shape == (size, 4)
    assert misses() - before <= int(np.log2(32)) + 1
    ref, _ = jn.apply(n.model, n.params, n.state, jnp.asarray(x[:270]))
    np.testing.assert_allclose(jn.predict(n, {"x": x[:270]}), np.asarray(ref), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_clip_norm_change_is_explained_by_name(run_dir):
    @jn.experiment
    class Clip(Tiny):
        clip: float = 1.0

        def gradient_clip_norm(self):
            return self.clip

    assert compiled(nitro(Clip(n_val=0), run_dir=run_dir / "a")) == 1
    n = nitro(Clip(n_val=0, clip=2.0), run_dir=run_dir / "b")
    compiled(n)
    assert "gradient_clip_norm 1.0 → 2.0" in reasons(n)


@pytest.mark.slow
def test_an_optimizer_change_is_explained_by_name(run_dir):
    @jn.experiment
    class Opt(Tiny):
        rule: str = "radam"

        def optimizer(self, group):
            return getattr(optax, self.rule)

    assert compiled(nitro(Opt(n_val=0), run_dir=run_dir / "a")) == 1
    n = nitro(Opt(n_val=0, rule="adam"), run_dir=run_dir / "b")
    compiled(n)
    assert "optimizer of group 'default' 'radam' → 'adam'" in reasons(n)


@pytest.mark.slow
def test_a_steps_per_call_tail_is_announced_at_setup(run_dir, capsys):
    n = nitro(
        Tiny(max_epochs=1, n_train=37 * 32, n_val=0),
        run_dir=run_dir,
        steps_per_call=4,
        progress="plain",
    )
    jn.train(n)
    out = capsys.readouterr().out
    assert "train (single steps): 37 steps per epoch leave a tail of 1" in out
    assert "avoids it" in out
    notes = jax.tree.leaves(jn.inspect(n, show=False).compile_report)
    assert any("tail of 1" in s for s in notes)


@pytest.mark.slow
def test_programs_that_call_back_into_python_are_not_shared_by_their_text(run_dir):
    """Two runs whose only difference is the function a `jax.pure_callback` (or a
    `jax.debug.print`) calls lower to the same text: the text names the callback by an index
    only. Each run must call its own function, not the first run's."""
    seen: list[float] = []

    @jn.experiment
    class Tapped(Tiny):
        tap: jn.GraphConst[float] = 1.0

        def loss(self, logits, *, y):
            def note(v, tap=self.tap):
                seen.append(tap)
                return v

            held = jax.pure_callback(
                note, jax.ShapeDtypeStruct((), jnp.float32), jax.lax.stop_gradient(logits).sum()
            )
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return ce + 0.0 * held

    for tap in (1.0, 2.0):
        n = nitro(Tapped(tap=tap, n_val=0, max_epochs=1), run_dir=run_dir / str(tap))
        jn.train(n)
        assert set(seen) == {tap}, seen
        seen.clear()


@pytest.mark.slow
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


@pytest.mark.slow
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
