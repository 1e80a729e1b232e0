"""A custom `train_step` with several optimizers: equal to the hand-written loop, fused,
resumed bitwise, scheduled per optimizer, and errors that name what is wrong."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import host_copy, leaves_equal, nitro
from flax import nnx
from helpers.paths import ROOT

import jaxnitro as jn


class TwoPart(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(8, 4, rngs=rngs)
        self.b = nnx.Linear(4, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


def _data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, :4] * 2.0 - x[:, 4:]).astype(np.float32)


def loss_a(p, model, state, x, y):  # part a alone fits the target
    h, _ = jn.apply(model, p, state, x, method="a")
    return jnp.mean((h - y) ** 2)


def loss_b(p, model, state, x, y):  # the whole model, differentiated for part b
    out, _ = jn.apply(model, p, state, x)
    return jnp.mean((out - y) ** 2)


@jn.experiment
class Alternating:
    max_epochs: int = 2
    shuffle: bool = False
    scheduled: bool = False

    def build_model(self, rng):
        return jn.split_model(TwoPart(rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        x, y = _data()
        vx, vy = _data(40, seed=1)
        return {
            "train": jn.DataLoader({"x": x, "y": y}, batch_size=16, shuffle=self.shuffle),
            "val": jn.DataLoader({"x": vx, "y": vy}, batch_size=20),
        }

    def optimizers(self):
        return {"a": optax.adam(1e-2), "b": optax.sgd(5e-2, momentum=0.9)}

    def train_step(self, model, params, opt_state, state, rng, *, x, y):
        la, grads = jn.group_grad(loss_a, params, "a", model, state, x, y)
        params, opt_state = jn.optimizer_step("a", params, opt_state, grads)
        lb, grads = jn.group_grad(loss_b, params, "b", model, state, x, y)
        params, opt_state = jn.optimizer_step("b", params, opt_state, grads)
        return params, opt_state, state, {"loss": lb, "loss_a": la}

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def metrics(self, out, *, y):
        return {"mse": (((out - y) ** 2).mean(-1).sum(), y.shape[0])}


def _hand_loop(params0, model, epochs: int):
    """The same training written by hand with optax on the two sub-trees."""
    x, y = _data()
    tx_a, tx_b = optax.adam(1e-2), optax.sgd(5e-2, momentum=0.9)
    is_a = lambda path: jax.tree_util.keystr(path).startswith("['a']")  # noqa: E731
    mask_a = jax.tree_util.tree_map_with_path(lambda p, _: is_a(p), params0)
    mask_b = jax.tree.map(lambda m: not m, mask_a)
    full_a, full_b = optax.masked(tx_a, mask_a), optax.masked(tx_b, mask_b)
    sa, sb = full_a.init(params0), full_b.init(params0)

    @jax.jit
    def step(p, sa, sb, xb, yb):
        g = jax.grad(loss_a)(p, model, {}, xb, yb)
        g = jax.tree.map(lambda gi, m: gi if m else jnp.zeros_like(gi), g, mask_a)
        u, sa = full_a.update(g, sa, p)
        p = jax.tree.map(lambda pi, ui, m: pi + ui if m else pi, p, u, mask_a)
        g = jax.grad(loss_b)(p, model, {}, xb, yb)
        g = jax.tree.map(lambda gi, m: gi if m else jnp.zeros_like(gi), g, mask_b)
        u, sb = full_b.update(g, sb, p)
        p = jax.tree.map(lambda pi, ui, m: pi + ui if m else pi, p, u, mask_b)
        return p, sa, sb

    p = params0
    for _ in range(epochs):
        for i in range(0, len(x), 16):
            p, sa, sb = step(p, sa, sb, x[i : i + 16], y[i : i + 16])
    return p


@pytest.mark.slow
def test_custom_step_equals_the_hand_written_two_optimizer_loop(run_dir):
    n = nitro(Alternating(), run_dir=run_dir)
    params0 = host_copy(n.params)
    result = jn.train(n)
    assert result.stop_reason == "completed" and n.step == 16
    assert sorted(n.opt_state) == ["a", "b"]  # one optimizer state per group
    want = _hand_loop(jax.tree.map(jnp.asarray, params0), n.spec.model, epochs=2)
    for got, ref in zip(jax.tree.leaves(host_copy(n.params)), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(got, np.asarray(ref), rtol=1e-6, atol=1e-6)
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r.get("context") == "train"]
    assert len(train) == 16 and {"loss", "loss_a"} <= set(train[0])
    assert any("mse" in r for r in lines if r.get("context") == "validate")


@pytest.mark.slow
def test_custom_step_fused_and_resumed_is_bitwise_the_straight_run(tmp_path):
    straight = nitro(Alternating(shuffle=True), run_dir=tmp_path / "a")
    jn.train(straight)
    fused = nitro(Alternating(shuffle=True), run_dir=tmp_path / "b", steps_per_call=4)
    jn.train(fused)
    assert leaves_equal(fused.state_leaves, straight.state_leaves)
    first = nitro(Alternating(shuffle=True, max_epochs=1), run_dir=tmp_path / "c")
    jn.train(first)
    resumed = nitro(Alternating(shuffle=True), run_dir=tmp_path / "c", resume="auto")
    jn.train(resumed)
    assert resumed.step == straight.step
    assert leaves_equal(resumed.state_leaves, straight.state_leaves)  # both optimizer states


@jn.experiment
class Scheduled(Alternating):
    def optimizers(self):  # factories: the rates come from learning_rate and schedules
        return {"a": optax.adam, "b": optax.sgd}

    def learning_rate(self, group):
        return {"a": 1e-2, "b": 5e-2}[group]

    def schedules(self):
        return {"opt.b.learning_rate": jn.schedules.constant(0.0)}


@pytest.mark.slow
def test_schedules_apply_per_optimizer(run_dir):
    n = nitro(Scheduled(max_epochs=1), run_dir=run_dir)
    before = host_copy(n.params)
    jn.train(n)
    after = host_copy(n.params)
    assert not leaves_equal(after["a"], before["a"])
    # optimizer b's rate is scheduled to 0: part b has not moved, bit for bit
    assert leaves_equal(after["b"], before["b"])
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in lines if r.get("context") == "train")
    rates = {k: v for k, v in row.items() if "lr" in k}
    assert len(rates) == 2 and 0.0 in rates.values(), rates


def _variant(**hooks):
    return jn.experiment(type("Variant", (Alternating,), hooks))


def test_a_wrong_train_step_result_is_named(run_dir):
    three = _variant(train_step=lambda self, model, params, opt_state, state, rng, *, x, y: (
        params, opt_state, state))  # fmt: skip
    with pytest.raises(jn.HookError, match=r"must return \(params, opt_state, state, metrics\)"):
        jn.train(nitro(three(), run_dir=run_dir / "1"))

    def drops_a(self, model, params, opt_state, state, rng, *, x, y):
        return params, {"b": opt_state["b"]}, state, {"loss": jnp.float32(0)}

    with pytest.raises(jn.HookError, match=r"opt_state with another structure"):
        jn.train(nitro(_variant(train_step=drops_a)(), run_dir=run_dir / "2"))

    def vector_metric(self, model, params, opt_state, state, rng, *, x, y):
        return params, opt_state, state, {"loss": jnp.zeros(3)}

    with pytest.raises(jn.HookError, match=r"metric 'loss' has shape \(3,\)"):
        jn.train(nitro(_variant(train_step=vector_metric)(), run_dir=run_dir / "3"))

    def bad_group(self, model, params, opt_state, state, rng, *, x, y):
        _, g = jn.group_grad(loss_a, params, "gen", model, state, x, y)
        return params, opt_state, state, {}

    with pytest.raises(jn.HookError, match=r"no parameter group 'gen'; the groups are \['a', "):
        jn.train(nitro(_variant(train_step=bad_group)(), run_dir=run_dir / "4"))


def test_the_helpers_outside_a_train_step_say_where_they_work():
    with pytest.raises(jn.HookError, match=r"inside an experiment's train_step"):
        jn.optimizer_step("a", {}, {}, {})


def test_options_that_assume_one_loss_are_refused(run_dir):
    with pytest.raises(jn.ConfigError, match=r"accum=2 applies to the built-in train step"):
        nitro(Alternating(), run_dir=run_dir, accum=2)
    with pytest.raises(jn.ConfigError, match=r"precision='bf16'"):
        nitro(Alternating(), run_dir=run_dir, precision="bf16")
    with pytest.raises(jn.ConfigError, match=r"jn.lr_find needs one training loss"):
        jn.lr_find(nitro(Alternating(), run_dir=run_dir))


def test_optimizers_and_groups_must_agree(run_dir):
    extra = _variant(optimizers=lambda self: {"a": optax.adam(1e-3), "b": optax.sgd(0.1),
                                              "c": optax.sgd(0.1)})  # fmt: skip
    with pytest.raises(jn.ConfigError, match=r"optimizers\(\) names \['c'\], but no parameter"):
        nitro(extra(), run_dir=run_dir)
    short = _variant(optimizers=lambda self: {"a": optax.adam(1e-3)})
    with pytest.raises(jn.ConfigError, match=r"parameter 'b/bias' is under 'b'"):
        nitro(short(), run_dir=run_dir)

    @jn.experiment
    class NoStep:
        def build_model(self, rng):
            return jn.split_model(TwoPart(rngs=nnx.Rngs(rng)))

        def build_data(self, dist):
            x, y = _data()
            return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=16)}

        def optimizers(self):
            return {"a": optax.adam(1e-3), "b": optax.adam(1e-3)}

        def forward(self, model, params, state, *, x):
            return jn.apply(model, params, state, x)

        def loss(self, out, *, y):
            return jnp.mean((out - y) ** 2)

    with pytest.raises(jn.ConfigError, match=r"has no train_step"):
        nitro(NoStep(), run_dir=run_dir)


@pytest.mark.slow
def test_a_non_finite_metric_stops_or_skips(run_dir):
    def nan_step(self, model, params, opt_state, state, rng, *, x, y):
        la, grads = jn.group_grad(loss_a, params, "a", model, state, x, y)
        params, opt_state = jn.optimizer_step("a", params, opt_state, grads)
        return params, opt_state, state, {"loss_a": la, "d_loss": jnp.float32(jnp.nan)}

    nan = _variant(train_step=nan_step)
    with pytest.raises(jn.NonFiniteLossError, match=r"train metric 'd_loss' is nan at step 1"):
        jn.train(nitro(nan(), run_dir=run_dir / "stop"))
    n = nitro(nan(max_epochs=1), run_dir=run_dir / "skip", on_nonfinite="skip")
    before = host_copy(n.params)
    jn.train(n)
    assert leaves_equal(n.params, before) and n.progress.skipped_steps == 8


@pytest.mark.slow
def test_apply_method_names_a_part_or_says_what_exists():
    model, params, state = jn.split_model(TwoPart(rngs=nnx.Rngs(0)))
    x = jnp.ones((2, 8))
    h, _ = jn.apply(model, params, state, x, method="a")
    assert h.shape == (2, 4)
    out, _ = jn.apply(model, params, state, x, method=lambda m, x: m.b(m.a(x)))
    assert out.shape == (2, 4)
    with pytest.raises(jn.ConfigError, match=r"has no callable 'c'"):
        jn.apply(model, params, state, x, method="c")


@pytest.mark.slow
def test_the_gan_example_covers_all_eight_modes(tmp_path):
    import importlib.util

    path = ROOT / "examples" / "gan.py"
    spec = importlib.util.spec_from_file_location("gan_example", path)
    gan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gan)
    n = nitro(
        gan.RingGAN(max_epochs=30),
        run_dir=tmp_path,
        steps_per_call=20,
        checkpointer=jn.TopKCheckpointer(metric="mmd", mode="min"),
    )
    result = jn.train(n)
    best = result.history.best
    assert best["modes"] == 8, best  # every mode holds >= 2% of the samples
    assert best["mmd"] < 0.02 and best["quality"] > 0.8, best
    assert result.best_checkpoint is not None and sorted(n.opt_state) == [
        "discriminator",
        "generator",
    ]


@pytest.mark.slow
def test_an_equinox_model_with_two_optimizers(run_dir):
    eqx = pytest.importorskip("equinox")

    class Pair(eqx.Module):
        a: eqx.nn.Linear
        b: eqx.nn.Linear

        def __init__(self, key):
            k1, k2 = jax.random.split(key)
            self.a, self.b = eqx.nn.Linear(8, 4, key=k1), eqx.nn.Linear(4, 4, key=k2)

        def __call__(self, x):
            return self.b(jnp.tanh(self.a(x)))

    def eqx_loss_a(p, model, state, x, y):
        h, _ = jn.apply(model, p, state, x, method="a")
        return jnp.mean((h - y) ** 2)

    @jn.experiment
    class EqxAlternating(Alternating):
        def build_model(self, rng):
            return jn.split_model(Pair(rng))

        def train_step(self, model, params, opt_state, state, rng, *, x, y):
            la, grads = jn.group_grad(eqx_loss_a, params, "a", model, state, x, y)
            params, opt_state = jn.optimizer_step("a", params, opt_state, grads)
            lb, grads = jn.group_grad(loss_b, params, "b", model, state, x, y)
            params, opt_state = jn.optimizer_step("b", params, opt_state, grads)
            return params, opt_state, state, {"loss": lb, "loss_a": la}

    n = nitro(EqxAlternating(max_epochs=1), run_dir=run_dir)
    before = host_copy(n.params)
    jn.train(n)
    assert sorted(n.opt_state) == ["a", "b"]
    assert not leaves_equal(n.params.a, before.a) and not leaves_equal(n.params.b, before.b)


def test_an_empty_metrics_dict_or_swapped_trees_are_named(run_dir):
    empty = _variant(train_step=lambda self, model, params, opt_state, state, rng, *, x, y: (
        params, opt_state, state, {}))  # fmt: skip
    with pytest.raises(jn.HookError, match=r"returned no metrics"):
        jn.train(nitro(empty(), run_dir=run_dir / "1"))
    swapped = _variant(train_step=lambda self, model, params, opt_state, state, rng, *, x, y: (
        opt_state, params, state, {"loss": jnp.float32(0)}))  # fmt: skip
    with pytest.raises(jn.HookError, match=r"It has the structure of opt_state: return \(params"):
        jn.train(nitro(swapped(), run_dir=run_dir / "2"))
