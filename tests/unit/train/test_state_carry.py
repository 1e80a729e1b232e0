"""A run's train program keeps the state leaves a step does not change (the RNG, the injected
hyperparameters no step writes) and, where the step never reads its key, the step counter,
which the host counts; the loop hands over the state exact (`train/carry.py`)."""

from __future__ import annotations

import jax
import optax
import pytest
from conftest import Tiny, leaves_equal, nitro
from flax import linen

import jaxnitro as jn
from jaxnitro._src.data import feed
from jaxnitro._src.programs.builders import train_layout
from jaxnitro._src.steps import leaf_layout


def _kept(n) -> tuple[list[str], leaf_layout.Layout]:
    layout = train_layout(n.programs.train[("train", n.spec.steps_per_call)])
    flat = jax.tree_util.tree_flatten_with_path(n.train_state)[0]
    return [jax.tree_util.keystr(flat[i][0]) for i in layout.fixed_at], layout


def test_a_default_run_keeps_the_rng_the_constant_hyperparameters_and_the_counter(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)  # an NNX model, RAdam
    steps = []
    jn.every(1, lambda r: steps.append((r.step, int(n.train_state.step))), nitro=n)
    jn.train(n)
    kept, layout = _kept(n)
    assert layout.uncounted == 1
    assert [k for k in kept if "hyperparams" not in k] == [".step", ".rng"]
    hyper = sorted(k.split("'")[-2] for k in kept if "hyperparams" in k)
    assert hyper == ["b1", "b2", "eps", "eps_root", "threshold"]  # not the rate: written
    # of them the program takes the hyperparameters only: nothing reads the counter or the
    # RNG (no dropout), so they stay on the host's side of the call
    flat = jax.tree_util.tree_flatten_with_path(n.train_state)[0]
    idle = [jax.tree_util.keystr(flat[i][0]) for i in layout.idle_at]
    assert idle == [".step", ".rng"]
    assert int(n.train_state.step) == n.step == 8
    assert steps == [(s, s) for s in range(1, 9)]  # each handover has the counter right


def test_keeping_leaves_trains_bitwise_as_sending_them_all(run_dir, monkeypatch):
    kept = nitro(Tiny(max_epochs=2), run_dir=run_dir / "kept")
    jn.train(kept)
    assert _kept(kept)[1].fixed_at != ()
    real = leaf_layout.lower

    def every_leaf(*args, passed, host_counts, **kw):
        return real(*args, passed=(), host_counts=False, **kw)

    monkeypatch.setattr(leaf_layout, "lower", every_leaf)
    jn.cache_reset()
    sent = nitro(Tiny(max_epochs=2), run_dir=run_dir / "sent")
    jn.train(sent)
    jn.cache_reset()  # (the programs that send every leaf are for this test only)
    assert _kept(sent)[1].fixed_at == ()
    assert leaves_equal(kept.train_state, sent.train_state)
    assert kept.progress.history == sent.progress.history


class DropoutMLP(linen.Module):
    @linen.compact
    def __call__(self, x, train: bool = False):
        x = linen.relu(linen.Dense(16)(x))
        x = linen.Dropout(0.5, deterministic=not train)(x)
        return linen.Dense(4)(x)


@jn.experiment
class LinenDropout(Tiny):
    def build_model(self, rng):
        return jn.split_model(DropoutMLP(), rng, jax.numpy.ones((1, 8)))


def test_a_step_that_reads_its_key_counts_on_the_device(run_dir):
    n = nitro(LinenDropout(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    kept, layout = _kept(n)
    assert layout.uncounted == 0 and ".step" not in kept and ".rng" in kept
    assert layout.idle_at == ()  # the dropout draws from the RNG: taken
    assert int(n.train_state.step) == n.step == 8


@jn.experiment
class ScheduledInside(Tiny):
    """A ready transformation that changes an injected hyperparameter every step."""

    def optimizer(self, group):
        return optax.inject_hyperparams(optax.adam)(
            learning_rate=optax.linear_schedule(1e-2, 1e-3, 8)
        )


def test_an_injected_hyperparameter_the_step_changes_travels(run_dir):
    n = nitro(ScheduledInside(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    kept, _ = _kept(n)
    assert not any("learning_rate" in k for k in kept)
    rate = jax.tree.leaves(n.opt_state, is_leaf=lambda x: hasattr(x, "hyperparams"))
    lr = [float(s.hyperparams["learning_rate"]) for s in rate if hasattr(s, "hyperparams")]
    # the rate of the eighth step (count 7): it moved every step, and came back each time
    assert lr == [pytest.approx(1e-2 + (1e-3 - 1e-2) * 7 / 8, rel=1e-5)]


def test_several_steps_per_call_send_every_leaf(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir, steps_per_call=2)
    jn.train(n)
    assert _kept(n)[1].fixed_at == ()
    assert int(n.train_state.step) == n.step == 8


def test_a_handover_mid_epoch_merges_only_where_it_is_read(run_dir, monkeypatch):
    # Advancing the kept counter at every read-back chunk would be device work waiting
    # behind the calls in flight: the handle gets the leaves unmerged, merged on first read.
    n = nitro(Tiny(n_train=32 * 40, max_epochs=1), run_dir=run_dir)
    jn.train(n)  # compiled; the next epoch is timed
    adds = []
    real = leaf_layout._advanced
    monkeypatch.setattr(leaf_layout, "_advanced", lambda s, by: adds.append(by) or real(s, by))
    monkeypatch.setattr("jaxnitro._src.train.epoch.READBACK_CHUNK", 4)
    handed = []
    real_take = type(n).take

    def take(self, **parts):
        if "leaves" in parts:
            handed.append(parts["leaves"])
        real_take(self, **parts)

    monkeypatch.setattr(type(n), "take", take)
    n.max_epochs = 2
    jn.train(n)
    # the epoch is one unit of calls, read back a chunk of 4 at a time all the same (at most
    # two chunks in flight), each chunk's handover not merged there
    assert feed.rows_calls(n.spec) >= 40
    pending = [h for h in handed if isinstance(h, leaf_layout.Unmerged)]
    assert len(pending) >= 40 // 4 - 2
    assert len(adds) <= 2  # merged where read: the epoch's end (a checkpoint), not per chunk
    assert int(n.train_state.step) == n.step == 80
    # an old handover, read late, has the counter of its own step
    steps = [int(jax.tree.unflatten(n._state_def, h.leaves()).step) for h in pending]
    assert steps == sorted(steps) and 40 < steps[0] < 60 and steps[-1] == 80


def test_unmerged_leaves_merge_once_for_every_reader():
    layout = leaf_layout.Layout(fixed_at=(1,), step_at=1, uncounted=1)
    moving, kept = [jax.numpy.ones(2), jax.numpy.zeros(3)], [jax.numpy.int32(5)]
    lazy = leaf_layout.Unmerged(layout, moving, kept, behind=7)
    moving.append("changed after the handover")  # the loop's lists go on; the handover's not
    import threading

    got = []
    readers = [threading.Thread(target=lambda: got.append(lazy.leaves())) for _ in range(4)]
    for t in readers:
        t.start()
    for t in readers:
        t.join()
    assert all(g is got[0] for g in got) and len(got[0]) == 3
    assert int(got[0][1]) == 12 and int(kept[0]) == 5  # advanced by 7; the kept one as it was
