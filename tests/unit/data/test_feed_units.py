"""The feed's units where the batches are on the device already: the rows of several calls
per unit (one ask of the wait clock for them), split into calls as one unit each would be,
the arrays in place before the epoch's clock starts, and a stop between two calls of a unit."""

from __future__ import annotations

import types

import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.data import feed
from jaxnitro._src.train import epoch as epoch_mod


def _one_unit_each(batches: int, accum: int, spc: int) -> list[tuple[int, int, tuple]]:
    """The calls of `batches` batches fed one unit (spc × accum batches) at a time."""
    size, calls = spc * accum, []
    for start in range(0, batches, size):
        k = min(size, batches - start)
        calls += [(start + o, s, lead) for o, s, lead in feed.call_splits(k // accum, accum, spc)]
    return calls


@pytest.mark.parametrize("spc", [1, 2, 3, 4])
@pytest.mark.parametrize("accum", [1, 2, 3])
def test_a_unit_of_several_calls_splits_as_one_unit_each(spc, accum):
    for steps in range(0, 3 * spc + 2):  # full calls, and each length of tail
        batches = steps * accum
        assert feed.call_splits(steps, accum, spc) == _one_unit_each(batches, accum, spc), steps


def test_gathered_rows_come_several_calls_to_a_unit(run_dir):
    n = nitro(Tiny(n_train=32 * 40), run_dir=run_dir, steps_per_call=2)
    assert n.spec.resident is not None
    units = list(feed.train_units(n.spec, n.spec.splits["train"], 0, 0))
    size = 2 * feed.ROWS_CALLS  # batches: steps_per_call × the calls of a unit
    assert [u.size for u in units] == [size, 40 - size]
    prepare = feed.train_prepare(n.spec, 0, n.device.hyper_base)
    calls = [c for u in units for c in prepare(u)[0]]
    assert [c.steps for c in calls] == [2] * 20
    rows = [int(c.batch["rows"][0, 0]) for c in calls]  # each call's first row, in order
    order = n.spec.splits["train"].iter_rows(0, 40)
    want = next(order)[0]["rows"][::2, 0]
    assert rows == [int(r) for r in want]


class _Copying:
    """A device array whose copy is still under way until it is waited for."""

    def __init__(self):
        self.waited = False

    def is_ready(self) -> bool:
        return self.waited

    def block_until_ready(self):
        self.waited = True
        return self


def test_the_arrays_put_at_setup_are_in_place_before_the_epochs_clock():
    arrays = {"x": _Copying(), "y": _Copying()}
    spec = types.SimpleNamespace(resident=arrays, device_batches=None)
    assert feed.stage_train(spec, loader=None, start=0) == 1  # the clock restarts after
    assert all(a.waited for a in arrays.values())
    assert feed.stage_train(spec, loader=None, start=0) == 0  # in place: nothing to wait for


def test_a_stop_between_two_calls_of_one_unit_dispatches_no_more(run_dir, monkeypatch):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    assert n.spec.resident is not None  # 8 batches: one unit
    real = epoch_mod._dispatch

    def dispatch(ep, fn, leaves, last, call, extras, pending):
        flight = real(ep, fn, leaves, last, call, extras, pending)
        if flight.step == 3:  # as a signal handler asks, between two calls
            n.services.control.request()
        return flight

    monkeypatch.setattr(epoch_mod, "_dispatch", dispatch)
    jn.train(n)
    assert n.step == 3 and n.progress.batch_in_epoch == 3


def test_constant_hyperparameters_go_to_the_device_once(run_dir):
    # Sent with every call as numpy they cost ~2.5% of a small step on a CPU: one
    # uncommitted device array serves every call, keyed as the numpy it stands for.
    import jax
    import numpy as np

    from jaxnitro._src.compile import cache

    n = nitro(Tiny(n_train=32 * 4), run_dir=run_dir)
    assert n.spec.direct_feed
    hyper = feed.HyperFeed(n.spec, n.device.hyper_base)
    first = hyper.at(0, 1)
    assert isinstance(first, jax.Array) and not first.committed
    assert hyper.at(7, 1) is first
    assert cache._aval(first) == cache._aval(np.asarray(first))
    scheduled = nitro(
        Tiny(n_train=32 * 4),
        run_dir=run_dir / "s",
        schedules={"opt.learning_rate": jn.schedules.linear(1.0, 0.0)},
    )
    sched = feed.HyperFeed(scheduled.spec, scheduled.device.hyper_base)
    a, b = sched.at(0, 1), sched.at(1, 1)
    assert type(a) is np.ndarray and float(a[0]) != float(b[0])
    assert cache._aval(a) == cache._aval(first)  # one program serves both
