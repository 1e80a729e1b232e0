"""`jn.train_step`'s program keeps the leaves a step does not change: the RNG always, and the
step counter where the traced step never reads its key (the host counts the steps then)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from conftest import leaves_equal
from flax import linen, nnx

import jaxnitro as jn
from jaxnitro._src.steps import leaf_layout
from jaxnitro._src.steps import state as state_mod

X = np.random.default_rng(0).normal(size=(16, 2)).astype(np.float32)
BATCH = {"x": X, "y": X**2}


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.l1 = nnx.Linear(2, 8, rngs=rngs)
        self.l2 = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.gelu(self.l1(x)))


class DropoutMLP(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool = False):
        x = linen.Dense(8)(x)
        x = linen.Dropout(0.5, deterministic=not train)(x)
        return linen.Dense(2)(x)


def mse(model, params, state, batch):
    pred, state = jn.apply(model, params, state, batch["x"])
    return jnp.mean((pred - batch["y"]) ** 2), state


def _state(model=None, tx=None):
    model, params, state = model or jn.split_model(MLP(nnx.Rngs(0)))
    return jn.TrainState.create(model, params, state, tx or optax.adam(1e-2))


def _layout(ts) -> leaf_layout.Layout:
    return ts.__dict__["_unread"][4].layout


def test_a_step_that_never_reads_its_key_keeps_the_counter_and_the_host_counts():
    ts = _state()
    for _ in range(3):
        ts, _, _ = jn.train_step(mse, ts, BATCH)
    layout = _layout(ts)
    assert layout.uncounted == 1 and len(layout.fixed_at) == 2  # the step and the RNG
    steps = ts.__dict__["_unread"][2]
    assert steps == 3  # three steps the device's counter has not seen
    assert int(ts.step) == 3
    for _ in range(2):  # after a read, the count goes on from the state read
        ts, _, _ = jn.train_step(mse, ts, BATCH)
    assert int(ts.step) == 5


def test_a_host_counted_run_trains_as_one_counted_on_the_device():
    fast = _state()
    read = _state()
    for _ in range(6):
        fast, _, _ = jn.train_step(mse, fast, BATCH)
        read, _, _ = jn.train_step(mse, read, BATCH)
        assert int(read.step) > 0  # a read each step: an ordinary state each call
    assert int(fast.step) == int(read.step) == 6
    assert leaves_equal(fast.params, read.params)
    assert leaves_equal(fast.opt_state, read.opt_state)


def test_the_kept_leaves_are_not_donated_and_the_changed_ones_are():
    ts = _state()
    ts, _, _ = jn.train_step(mse, ts, BATCH)
    step, rng = ts.step, ts.rng
    param = jax.tree.leaves(ts.params)[0]
    new, _, _ = jn.train_step(mse, ts, BATCH)
    assert param.is_deleted()
    assert not step.is_deleted() and not rng.is_deleted()
    assert int(new.step) == 2 and np.array_equal(new.rng, rng)


def test_a_step_that_reads_its_key_counts_on_the_device_with_a_key_per_step():
    x = jnp.ones((4, 2))
    # a zero rate: the parameters stay, so only the dropout mask moves the loss
    ts = _state(jn.split_model(DropoutMLP(), jax.random.PRNGKey(0), x), optax.sgd(0.0))
    batch = {"x": np.ones((16, 2), np.float32), "y": np.zeros((16, 2), np.float32)}
    losses = []
    for _ in range(3):
        ts, loss, _ = jn.train_step(mse, ts, batch)
        losses.append(float(loss))
    layout = _layout(ts)
    assert layout.uncounted == 0 and len(layout.fixed_at) == 1  # the RNG alone is kept
    assert layout.idle_at == ()  # and taken: the dropout draws from it
    assert ts.__dict__["_unread"][2] == 0
    assert int(ts.step) == 3
    assert len(set(losses)) == 3  # each step its own dropout mask


def test_a_subclass_state_is_counted_on_the_device():
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass(frozen=True)
    class Mine(jn.TrainState):
        pass

    base = _state()
    ts = Mine(**{f.name: getattr(base, f.name) for f in dataclasses.fields(jn.TrainState)})
    for _ in range(2):
        ts, _, _ = jn.train_step(mse, ts, BATCH)
    assert type(ts) is Mine and int(ts.step) == 2


def test_reads_inputs_follows_what_the_outputs_depend_on():
    def f(a, b, c):
        dead = jax.random.fold_in(b, c)  # computed, never used
        del dead
        return a * 2

    closed = jax.make_jaxpr(f)(1.0, jax.random.PRNGKey(0), 3)
    assert leaf_layout.reads_inputs(closed, [0])
    assert not leaf_layout.reads_inputs(closed, [1, 2])

    def g(a, b, c):
        return a + jax.random.uniform(jax.random.fold_in(b, c))

    assert leaf_layout.reads_inputs(jax.make_jaxpr(g)(1.0, jax.random.PRNGKey(0), 3), [1])

    def h(a, b, c):
        jax.debug.print("{}", c)  # an effect reads c
        return a

    assert leaf_layout.reads_inputs(jax.make_jaxpr(h)(1.0, jax.random.PRNGKey(0), 3), [2])


def test_a_program_is_called_as_it_was_built(monkeypatch):
    # The layout is kept beside the compiled program: a second state on the same
    # code (a cache hit) calls it the same way.
    first = _state()
    first, _, _ = jn.train_step(mse, first, BATCH)
    state_mod._reset_fast()  # the fast path's table only: the program stays cached
    second = _state()
    second, _, _ = jn.train_step(mse, second, BATCH)
    assert _layout(second) == _layout(first)
    assert leaves_equal(first.params, second.params)


def test_kept_leaves_no_trace_reads_are_not_even_taken():
    # Without dropout nothing reads the RNG, and the host counts the steps: the program takes
    # neither (each input costs a CPU call ~0.2 us), and the state still has both, right.
    from jaxnitro._src.compile import cache

    jn.cache_reset()
    ts = _state()
    for _ in range(3):
        ts, _, _ = jn.train_step(mse, ts, BATCH)
    layout = _layout(ts)
    assert layout.idle_at == layout.fixed_at and len(layout.idle_at) == 2
    unread = ts.__dict__["_unread"]
    assert unread[5] == [] and len(unread[1]) == 2  # taken none; kept both
    [compiled] = [p.compiled for p in cache._entries.values() if p.kind == "train_step"]
    changed = len(jax.tree.leaves(unread[0]))
    assert compiled.in_tree.num_leaves == changed + len(BATCH)  # and the batch: no more
    rng = _state().rng
    assert int(ts.step) == 3 and np.array_equal(ts.rng, rng)
    reference = _state()
    for _ in range(3):  # an ordinary state each call: the same program, the same numbers
        reference, _, _ = jn.train_step(mse, reference, BATCH)
        assert int(reference.step) > 0
    assert leaves_equal(ts.params, reference.params)


def test_a_program_without_its_idle_leaves_is_the_program_with_them(monkeypatch):
    # the idle leaves dropped from the traced program, not traced again: the same numbers
    def kept_all(traced, layout, *args):
        return traced, layout  # as traced: the counter on the device, every kept leaf taken

    ts = _state()
    for _ in range(4):
        ts, loss, _ = jn.train_step(mse, ts, BATCH)
    assert _layout(ts).idle_at != ()
    monkeypatch.setattr(leaf_layout, "_slimmed", kept_all)
    jn.cache_reset()
    other = _state()
    for _ in range(4):
        other, other_loss, _ = jn.train_step(mse, other, BATCH)
    assert _layout(other).idle_at == () and _layout(other).uncounted == 0
    jn.cache_reset()  # (the program that takes them is this test's only)
    assert float(loss) == float(other_loss)
    assert leaves_equal(ts.params, other.params) and leaves_equal(ts.opt_state, other.opt_state)
    assert int(ts.step) == int(other.step) == 4


def test_a_jaxpr_that_cannot_be_rebuilt_leaves_the_program_as_traced(monkeypatch):
    monkeypatch.setattr(leaf_layout, "_dropped", lambda *args: None)
    jn.cache_reset()
    ts = _state()
    for _ in range(2):
        ts, loss, _ = jn.train_step(mse, ts, BATCH)
    jn.cache_reset()  # (this test's program only)
    layout = _layout(ts)  # as traced: the counter counted on the device, the RNG taken
    assert layout.idle_at == () and layout.uncounted == 0 and len(layout.fixed_at) == 1
    assert np.isfinite(float(loss)) and int(ts.step) == 2


def test_a_step_is_traced_once_whether_or_not_it_reads_its_key():
    # The counter's place (host or device) is found in the one trace, with or without dropout
    calls = []

    def counted(model, params, state, batch):
        calls.append(1)
        return mse(model, params, state, batch)

    x = jnp.ones((4, 2))
    for model, host in (
        (None, True),
        (jn.split_model(DropoutMLP(), jax.random.PRNGKey(0), x), False),
    ):
        jn.cache_reset()
        calls.clear()
        ts, loss, _ = jn.train_step(counted, _state(model), BATCH)
        assert calls == [1] and np.isfinite(float(loss))
        assert _layout(ts).uncounted == int(host)
