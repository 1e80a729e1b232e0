"""The feed's units where the batches are on the device already: the rows of several calls
per unit (one ask of the wait clock for them), split into calls as one unit each would be,
the arrays in place before the epoch's clock starts, and a stop between two calls of a unit."""

from __future__ import annotations

import types

import numpy as np
import pytest
from conftest import Tiny, leaves_equal, nitro

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


def _call_rows(call) -> np.ndarray:
    """The rows a call's program gathers: sent as they are, or picked from a unit's block."""
    rows = np.asarray(call.batch["rows"])
    return rows[int(call.batch["index"])] if "index" in call.batch else rows


def _two_blocks_a_unit(monkeypatch, spc: int, accum: int) -> None:
    """Units of two `ROWS_CALLS` blocks of rows (batch 32), not the default's many."""
    monkeypatch.setattr(feed, "ROWS_BYTES", 2 * 4 * feed.ROWS_CALLS * spc * accum * 32)


def test_gathered_rows_come_several_calls_to_a_unit(run_dir, monkeypatch):
    _two_blocks_a_unit(monkeypatch, spc=2, accum=1)
    calls = feed.ROWS_CALLS * 2
    batches = 2 * calls + 8  # a full unit of calls and a short one
    n = nitro(Tiny(n_train=32 * batches), run_dir=run_dir, steps_per_call=2)
    assert n.spec.resident is not None and feed.rows_calls(n.spec) == calls
    units = list(feed.train_units(n.spec, n.spec.splits["train"], 0, 0))
    size = 2 * calls  # batches: steps_per_call × the calls of a unit
    assert [u.size for u in units] == [size, batches - size]
    prepare = feed.train_prepare(n.spec, 0, n.device.hyper_base)
    calls = [c for u in units for c in prepare(u)[0]]
    assert [c.steps for c in calls] == [2] * (batches // 2)
    rows = [int(_call_rows(c)[0, 0]) for c in calls]  # each call's first row, in order
    order = n.spec.splits["train"].iter_rows(0, batches)
    want = next(order)[0]["rows"][::2, 0]
    assert rows == [int(r) for r in want]


@pytest.mark.parametrize(("spc", "accum"), [(1, 1), (1, 2), (3, 1), (2, 2)])
def test_a_units_rows_go_as_blocks_and_each_call_reads_its_own(run_dir, monkeypatch, spc, accum):
    # On one CPU device a numpy input per call costs ~2% of a small step: the unit's rows
    # are sent once, as blocks of ROWS_CALLS calls, and each call picks its own by an index
    # made once a process. A full unit of two blocks, a short last one of one block and a
    # short one, and a tail of single steps in it.
    _two_blocks_a_unit(monkeypatch, spc, accum)
    batches = (feed.ROWS_CALLS * spc * 3 + 7 * spc + spc - 1) * accum
    n = nitro(Tiny(n_train=32 * batches), run_dir=run_dir, steps_per_call=spc, accum=accum)
    assert n.spec.direct_feed and n.spec.resident is not None
    loader = n.spec.splits["train"]
    units = list(feed.train_units(n.spec, loader, 0, 0))
    blocks = feed.train_prepare(n.spec, 0, n.device.hyper_base)
    per_unit = [blocks(u)[0] for u in units]
    calls = [c for unit in per_unit for c in unit]
    with pytest.MonkeyPatch.context() as mp:  # the same units, each call sent its own rows
        mp.setattr(feed, "RowBlocks", lambda spc: None)
        sent = feed.train_prepare(n.spec, 0, n.device.hyper_base)
        want = [c for u in units for c in sent(u)[0]]
    assert [c.steps for c in calls] == [c.steps for c in want]
    assert all("index" in c.batch for c in calls)
    for got, ref in zip(calls, want, strict=True):
        assert "index" not in ref.batch and type(ref.batch["rows"]) is np.ndarray
        np.testing.assert_array_equal(_call_rows(got), ref.batch["rows"])
        assert got.batch["data"] is ref.batch["data"]
    # a block per ROWS_CALLS calls of a size, the same length in every unit: no program of
    # its own for the short last unit; the indices are device scalars, made once and reused
    assert [len(unit) for unit in per_unit] == [2 * feed.ROWS_CALLS, feed.ROWS_CALLS + 7 + spc - 1]
    shapes = {(c.steps, c.batch["rows"].shape) for c in calls}
    assert len(shapes) == len({c.steps for c in calls})
    blocks_of = [[c.batch["rows"] for c in unit if c.steps == spc] for unit in per_unit]
    assert [len({id(b) for b in unit}) for unit in blocks_of] == [2, 2]
    assert all(
        unit[i] is unit[i // feed.ROWS_CALLS * feed.ROWS_CALLS]
        for unit in blocks_of
        for i in range(len(unit))
    )
    assert len({id(c.batch["rows"]) for c in calls if c.steps != spc}) == (spc > 1)
    index = {int(c.batch["index"]): c.batch["index"] for c in calls}
    assert all(c.batch["index"] is index[int(c.batch["index"])] for c in calls)
    assert not any(i.committed for i in index.values())


def test_an_epoch_of_small_batches_goes_as_one_unit_of_blocks(run_dir):
    # a put while calls are in flight waits behind them on a CPU: the blocks of an epoch of
    # small batches all go before its first call
    n = nitro(Tiny(n_train=32 * 300), run_dir=run_dir)
    assert feed.rows_calls(n.spec) == feed.ROWS_CALLS * 64
    units = list(feed.train_units(n.spec, n.spec.splits["train"], 0, 0))
    assert [u.size for u in units] == [300]
    calls = feed.train_prepare(n.spec, 0, n.device.hyper_base)(units[0])[0]
    assert len({id(c.batch["rows"]) for c in calls}) == 5  # ceil(300 / 64)
    big = nitro(Tiny(n_train=32 * 320), run_dir=run_dir / "big", steps_per_call=4, accum=8)
    assert feed.rows_calls(big.spec) == feed.ROWS_CALLS * 4  # at most ROWS_BYTES of rows


def test_training_on_row_blocks_is_bitwise_training_on_sent_rows(run_dir, monkeypatch):
    n_train = 32 * (feed.ROWS_CALLS + 5)  # two blocks a pass, the second short
    blocks = nitro(Tiny(n_train=n_train), run_dir=run_dir / "blocks", steps_per_call=2)
    jn.train(blocks)
    monkeypatch.setattr(feed, "RowBlocks", lambda spc: None)
    sent = nitro(Tiny(n_train=n_train), run_dir=run_dir / "sent", steps_per_call=2)
    jn.train(sent)
    assert blocks.step == sent.step == 2 * (feed.ROWS_CALLS + 5)
    assert leaves_equal(blocks.train_state.params, sent.train_state.params)
    assert blocks.progress.history[-1] == sent.progress.history[-1]


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
