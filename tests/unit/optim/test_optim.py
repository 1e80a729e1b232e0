"""Optimization: param groups, decay, clipping, schedules, accumulation, fused steps, bf16."""

from __future__ import annotations

import collections
import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, host_copy, leaves_equal, make_data, nitro

import jaxnitro as jn
from jaxnitro._src.optim import hyper, schedules
from jaxnitro._src.train import epoch as epoch_mod
from jaxnitro._src.train.epoch import train_program


def allclose(a, b, atol=1e-6):
    la, lb = jax.tree.leaves(host_copy(a)), jax.tree.leaves(host_copy(b))
    return all(np.allclose(x, y, atol=atol, rtol=0) for x, y in zip(la, lb, strict=True))


@jn.experiment
class Opt(Tiny):
    batch: int = 32
    wd: float = 0.0
    clip: float = 0.0
    rule: str = "radam"
    shuffle: bool = False
    n_val: int = 0

    def build_data(self, dist):
        x, y = make_data(256)
        return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=self.batch, drop_last=True)}

    def optimizer(self, group):
        return {"radam": optax.radam, "adam": optax.adam, "sgd": optax.sgd}[self.rule]

    def weight_decay(self, group):
        return self.wd

    def gradient_clip_norm(self):
        return self.clip


def hand_run(exp, tx, *, batch=32, steps=8):
    """The same training with a hand-written optax loop (the reference)."""
    model, params, state = exp.build_model(jax.random.split(jax.random.PRNGKey(42))[0])
    x, y = make_data(256)
    opt_state = tx.init(params)

    def loss(p, xb, yb):
        out, _ = jn.apply(model, p, state, xb)
        return optax.softmax_cross_entropy(out, jax.nn.one_hot(yb, 4)).mean()

    @jax.jit
    def step(p, o, xb, yb):
        g = jax.grad(loss)(p, xb, yb)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    for i in range(steps):
        params, opt_state = step(
            params, opt_state, x[i * batch : (i + 1) * batch], y[i * batch : (i + 1) * batch]
        )
    return params


@pytest.mark.slow
def test_default_is_radam_at_1e3_matching_hand_optax(run_dir):
    @jn.experiment
    class Plain(Tiny):
        shuffle: bool = False
        n_val: int = 0
        learning_rate = None  # not overridden: the default rate

        def build_data(self, dist):
            x, y = make_data(256)
            return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32)}

    n = nitro(Plain(max_epochs=1), run_dir=run_dir)
    assert n.optimizer.groups["default"].rate == 1e-3
    jn.train(n)
    assert allclose(n.params, hand_run(Plain(), optax.radam(1e-3)))


@pytest.mark.slow
def test_weight_decay_equals_optax_adamw_with_the_bias_mask(run_dir):
    n = nitro(Opt(max_epochs=1, rule="adam", wd=0.1), run_dir=run_dir)
    jn.train(n)
    ref = hand_run(
        Opt(),
        optax.adamw(1e-2, weight_decay=0.1, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)),
    )
    assert allclose(n.params, ref)


@pytest.mark.slow
def test_clipping_equals_optax_chain_and_zero_adds_nothing(run_dir):
    n = nitro(Opt(max_epochs=1, rule="sgd", clip=0.05), run_dir=run_dir)
    jn.train(n)
    ref = hand_run(Opt(), optax.chain(optax.clip_by_global_norm(0.05), optax.sgd(1e-2)))
    assert allclose(n.params, ref)
    unclipped = nitro(Opt(max_epochs=1, rule="sgd"), run_dir=run_dir / "b")
    assert not isinstance(unclipped.opt_state, tuple) or not any(
        isinstance(s, optax.ClipByGlobalNormState) for s in unclipped.opt_state
    )
    assert "clip" not in repr(type(unclipped.opt_state)).lower()


@pytest.mark.slow
def test_groups_rates_freezing_and_no_decay(run_dir):
    @jn.experiment
    class Groups(Opt):
        def param_group(self, path, leaf):
            return "head" if path.startswith("out") else "body"

        def learning_rate(self, group):
            return 0.0 if group == "body" else 1e-2

    n = nitro(Groups(max_epochs=1, rule="adam", wd=0.1), run_dir=run_dir)
    before = host_copy(n.params)
    jn.train(n)
    after = host_copy(n.params)
    assert sorted(n.optimizer.groups) == ["body", "head"]
    assert n.optimizer.groups["body"].count == 8 * 16 + 16
    assert np.array_equal(before["hidden"]["kernel"][...], after["hidden"]["kernel"][...])
    assert not np.array_equal(before["out"]["kernel"][...], after["out"]["kernel"][...])

    @jn.experiment
    class AllFrozen(Opt):
        def learning_rate(self, group):
            return 0.0

    with pytest.raises(jn.ConfigError, match="learning rate 0"):
        nitro(AllFrozen(), run_dir=run_dir / "c")


@pytest.mark.slow
def test_decay_toward_initial_weights(run_dir):
    @jn.experiment
    class Anchored(Opt):
        anchor: str = "w0"

        def loss(self, logits, *, y):
            return 0.0 * logits.sum()  # no gradient: only decay moves the weights

        def decay_anchor(self, group):
            return self.anchor

    w0 = nitro(Anchored(max_epochs=1, rule="sgd", wd=0.5), run_dir=run_dir / "a")
    start = host_copy(w0.params)
    jn.train(w0)
    assert allclose(w0.params, start)
    zero = nitro(Anchored(max_epochs=1, rule="sgd", wd=0.5, anchor="zero"), run_dir=run_dir / "b")
    jn.train(zero)
    k0 = start["hidden"]["kernel"][...]
    np.testing.assert_allclose(
        host_copy(zero.params)["hidden"]["kernel"][...], k0 * (1 - 1e-2 * 0.5) ** 8, rtol=1e-5
    )


@pytest.mark.slow
def test_schedules_never_recompile_and_follow_the_factory(run_dir):
    jn.cache_reset()
    sched = schedules.warmup_cosine(warmup=2)
    n = nitro(Opt(max_epochs=2), run_dir=run_dir, schedules={"opt.learning_rate": sched})
    assert n.total_steps == 16
    jn.train(nitro(Opt(max_epochs=1), run_dir=run_dir / "x"))  # the constant-rate program
    misses = jn.cache_stats()["misses"]
    jn.train(n)
    assert jn.cache_stats()["misses"] == misses  # schedule vs constant: the same program
    lr = float(hyper.read(n.optimizer, n.opt_state)["opt.default.learning_rate"])
    f = sched(16)
    assert lr == pytest.approx(1e-2 * float(f(15)), rel=1e-6)
    assert f(0) == 0.0 and float(f(2)) == pytest.approx(1.0)


@pytest.mark.slow
def test_device_schedule_and_replacement_semantics(run_dir):
    @jn.experiment
    class Sched(Opt):
        def schedules(self):
            return {"device.smoothing": schedules.linear(0.0, 0.5)}

    a = nitro(Sched(max_epochs=1), run_dir=run_dir / "a")
    assert "device.smoothing" in a.spec.schedules.fns
    b = nitro(Sched(max_epochs=1), run_dir=run_dir / "b", schedules={})  # replaces, not merges
    assert not b.spec.schedules.fns
    jn.train(a)
    misses = jn.cache_stats()["misses"]
    jn.train(b)
    assert jn.cache_stats()["misses"] == misses
    assert not leaves_equal(a.params, b.params)
    with pytest.raises(jn.ConfigError, match="a schedule drives it"):
        jn.set_device(a, smoothing=0.3)


def test_schedule_key_errors(run_dir):
    with pytest.raises(jn.ConfigError, match="Did you mean 'opt.learning_rate'"):
        nitro(Opt(), run_dir=run_dir, schedules={"opt.learning_rat": 1.0})
    with pytest.raises(jn.ConfigError, match="GraphConst field"):
        nitro(Opt(), run_dir=run_dir, schedules={"device.width": 1.0})
    with pytest.raises(jn.ConfigError, match="Host field"):
        nitro(Opt(), run_dir=run_dir, schedules={"device.max_epochs": 1.0})
    with pytest.raises(jn.ConfigError, match="start with 'opt.' or 'device.'"):
        nitro(Opt(), run_dir=run_dir, schedules={"lr": 1.0})


def test_schedule_past_the_horizon_holds_and_warns(run_dir):
    n = nitro(
        Opt(max_epochs=1),
        run_dir=run_dir,
        schedules={"opt.learning_rate": schedules.linear(1.0, 0.5)},
    )
    n.max_epochs = 2  # train past the horizon the schedule was built for
    with pytest.warns(UserWarning, match="horizon"):
        jn.train(n)
    lr = float(hyper.read(n.optimizer, n.opt_state)["opt.default.learning_rate"])
    assert lr == pytest.approx(0.5e-2, rel=1e-6)


def test_accum_must_divide_the_epoch_and_names_valid_settings(run_dir):
    with pytest.raises(
        jn.ConfigError, match=r"accum=3 does not divide the 8 train batches.*\[1, 2, 4\]"
    ):
        nitro(Opt(), run_dir=run_dir, accum=3)


@pytest.mark.slow
def test_accumulation_equals_the_big_batch_step(run_dir):
    big = nitro(Opt(max_epochs=1), run_dir=run_dir / "big")
    jn.train(big)
    small = nitro(Opt(max_epochs=1, batch=8), run_dir=run_dir / "acc", accum=4)
    jn.train(small)
    assert small.step == big.step == 8  # the optimizer steps once per 4 micro-batches
    assert allclose(small.params, big.params, atol=1e-6)
    lines = [json.loads(s) for s in (run_dir / "acc" / "metrics.jsonl").read_text().splitlines()]
    losses = [ln["loss"] for ln in lines if ln.get("context") == "train"]
    big_losses = [
        json.loads(s)["loss"]
        for s in (run_dir / "big" / "metrics.jsonl").read_text().splitlines()
        if '"train"' in s
    ]
    np.testing.assert_allclose(losses, big_losses, rtol=1e-5)  # the step's loss, not loss / k


@pytest.mark.slow
def test_accumulation_weights_sum_count_losses_by_count(run_dir):
    @jn.experiment
    class Tokens(Opt):
        def build_data(self, dist):
            x, y = make_data(256)
            mask = (np.arange(256) % 7 < np.arange(256) % 5).astype(np.float32)  # unequal counts
            return {"train": jn.DataLoader({"x": x, "y": y, "m": mask}, batch_size=self.batch)}

        def loss(self, logits, *, y, m):
            per = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return (per * m).sum(), m.sum()

    x, y = make_data(256)
    mask = (np.arange(256) % 7 < np.arange(256) % 5).astype(np.float32)
    first32 = {"x": x[:32], "y": y[:32], "m": mask[:32]}  # one step of 4 micro-batches
    n = nitro(
        Tokens(max_epochs=1, batch=8, rule="sgd"),
        run_dir=run_dir,
        accum=4,
        data={"train": jn.DataLoader(first32, batch_size=8)},
    )
    start = host_copy(n.params)
    state = jax.tree.map(jnp.copy, n.state)
    model = n.model

    def total(p):
        out, _ = jn.apply(model, p, state, x[:32])
        per = optax.softmax_cross_entropy_with_integer_labels(out, y[:32])
        return (per * mask[:32]).sum() / mask[:32].sum()

    jn.train(n)
    g = jax.grad(total)(jax.tree.map(jnp.asarray, start))
    expected = jax.tree.map(lambda p, g: p - 1e-2 * g, start, g)
    assert n.step == 1
    assert allclose(n.params, expected, atol=1e-6)


def count_train_calls(monkeypatch) -> collections.Counter:
    """Steps per call -> how many times the driver called a train program of that size."""
    calls: collections.Counter = collections.Counter()

    def counted(*args):
        prog = train_program(*args)
        steps = prog.parts.option("steps_per_call")

        def call(*inputs):
            calls[steps] += 1
            return prog.compiled(*inputs)

        return dataclasses.replace(prog, compiled=call)

    monkeypatch.setattr(epoch_mod, "train_program", counted)
    return calls


@pytest.mark.slow
def test_fused_steps_match_single_steps_and_log_every_step(run_dir, monkeypatch):
    one = nitro(Opt(max_epochs=2), run_dir=run_dir / "one")
    jn.train(one)
    calls = count_train_calls(monkeypatch)
    fused = nitro(Opt(max_epochs=2), run_dir=run_dir / "fused", steps_per_call=4)
    jn.train(fused)
    assert fused.step == one.step == 16
    # The fused program is the one that ran: 4 calls of 4 steps, no single steps.
    assert dict(calls) == {4: 4}
    assert set(fused.programs.train) == {("train", 4)}
    assert allclose(fused.params, one.params, atol=1e-6)
    lines = [json.loads(s) for s in (run_dir / "fused" / "metrics.jsonl").read_text().splitlines()]
    steps = [ln["step"] for ln in lines if ln.get("context") == "train"]
    assert steps == list(range(1, 17))
    # A tail that does not fill a call runs step by step (one more program), with accum too.
    calls.clear()
    tail = nitro(Opt(max_epochs=1, batch=8), run_dir=run_dir / "tail", steps_per_call=3, accum=4)
    jn.train(tail)
    assert tail.step == 8
    assert dict(calls) == {3: 2, 1: 2}  # 3 + 3 fused, then the tail of 2 one by one
    ref = nitro(Opt(max_epochs=1), run_dir=run_dir / "ref2")
    jn.train(ref)
    assert allclose(tail.params, ref.params, atol=1e-6)


@pytest.mark.slow
def test_bf16_keeps_f32_master_weights_and_trains(run_dir):
    n = nitro(Opt(max_epochs=3), run_dir=run_dir, precision="bf16")
    result = jn.train(n)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(n.params))
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(isinstance(ln["loss"], float) for ln in lines if ln.get("context") == "train")
    with pytest.raises(jn.ConfigError, match="Did you mean 'bf16'"):
        nitro(Opt(), run_dir=run_dir / "b", precision="bf61")


@pytest.mark.slow
def test_ready_transform_refuses_decay_and_factory_partial_works(run_dir):
    @jn.experiment
    class Ready(Opt):
        def optimizer(self, group):
            return optax.adam(1e-3)

    with pytest.raises(jn.ConfigError, match="Return the factory"):
        nitro(Ready(wd=0.1), run_dir=run_dir)
    jn.train(nitro(Ready(max_epochs=1), run_dir=run_dir / "ok"))

    @jn.experiment
    class Momentum(Opt):
        def optimizer(self, group):
            return functools.partial(optax.sgd, momentum=0.9)

    n = nitro(Momentum(max_epochs=1), run_dir=run_dir / "m")
    jn.train(n)
    assert allclose(n.params, hand_run(Momentum(), optax.sgd(1e-2, momentum=0.9)))


@pytest.mark.slow
def test_a_factorys_own_weight_decay_is_neutralised(run_dir):
    @jn.experiment
    class AdamW(Opt):
        def optimizer(self, group):
            return optax.adamw  # its default weight_decay=1e-4 must not apply on top

    n = nitro(AdamW(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    assert allclose(n.params, hand_run(AdamW(), optax.adam(1e-2)))


@pytest.mark.slow
def test_rule_hyperparameter_schedule_and_ambiguous_keys(run_dir):
    sched = {"opt.b1": schedules.linear(0.9, 0.5)}
    n = nitro(Opt(max_epochs=1, rule="adam"), run_dir=run_dir, schedules=sched)
    assert "opt.default.b1" in n.optimizer.hyper_paths
    jn.train(n)
    b1 = float(hyper.read(n.optimizer, n.opt_state)["opt.default.b1"])
    assert b1 == pytest.approx(0.9 + (0.5 - 0.9) * 7 / 7, rel=1e-6)
    with pytest.raises(jn.ConfigError, match="another key sets too"):
        nitro(
            Opt(),
            run_dir=run_dir / "b",
            schedules={"opt.learning_rate": 1.0, "opt.default.learning_rate": 0.5},
        )
