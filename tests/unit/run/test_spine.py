"""The spine's modules on a hand-built RunSpec, without a whole `jn.Nitro`.

Each piece along setup → compile → step → loop is built from the small setup functions and
exercised directly: the hyperparameter layout, the feed, the program builders and their keys,
and one epoch of the loop driven through a minimal set of parts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import Tiny, make_data

import jaxnitro as jn
from jaxnitro._src.checkpoint.runlock import RunLock
from jaxnitro._src.compile import cache, explain
from jaxnitro._src.data import feed
from jaxnitro._src.data.batches import batch_sharding
from jaxnitro._src.dist.devices import make_mesh, replicated
from jaxnitro._src.experiment import hooks
from jaxnitro._src.observe.display import Display
from jaxnitro._src.observe.loggers import NullLogger
from jaxnitro._src.optim import groups as optim
from jaxnitro._src.optim import hyper
from jaxnitro._src.optim.hyper import HyperLayout
from jaxnitro._src.optim.schedules import Schedules, resolve_schedules
from jaxnitro._src.programs.builders import (
    eval_metric_shapes,
    eval_program,
    train_layout,
    train_program,
)
from jaxnitro._src.programs.keys import ProgramSet
from jaxnitro._src.run import setup as setup_mod
from jaxnitro._src.run.progress import Progress
from jaxnitro._src.run.services import NoCheckpointer, Services
from jaxnitro._src.run.spec import DeviceValues, RunSpec
from jaxnitro._src.steps.leaf_layout import Unmerged
from jaxnitro._src.train.carry import StateCarry


@jn.experiment
class TwoGroups(Tiny):
    def param_group(self, path, leaf):
        return "head" if path.startswith("out") else "body"

    def learning_rate(self, group):
        return {"head": 1e-2, "body": 1e-3}[group]


def make_spec(exp=None, *, accum=1, steps_per_call=1, schedules=None, n=64, batch=16, tmp=None):
    """A RunSpec from the setup functions, for a tiny model on one CPU device."""
    exp = exp if exp is not None else Tiny()
    mesh = make_mesh(1)
    rep = replicated(mesh)
    routes = hooks.check_hooks(type(exp))
    x, y = make_data(n + 20)
    splits = {
        "train": jn.DataLoader(
            {"x": x[:n], "y": y[:n]}, batch_size=batch, shuffle=True, drop_last=True, seed=0
        ),
        "val": jn.DataLoader({"x": x[n:], "y": y[n:]}, batch_size=8),  # 20 rows: ragged
    }
    model, params, mstate, rng = setup_mod.build_model(exp, 0, rep)
    opt = optim.build(exp, params, scheduled=set(schedules or {}))
    spe = setup_mod.steps_per_epoch(splits, accum)
    fields_ = {f.name: f.marker for f in jn.fields(exp)}
    resolved = resolve_schedules(
        schedules or {}, opt=opt, device_fields=fields_, total_steps=spe * 2
    )
    values = {"smoothing": setup_mod.device_array("smoothing", 0.0, rep)}
    layout = HyperLayout.build(opt, values, resolved)
    spec = RunSpec(
        experiment=exp,
        cls=type(exp),
        routes=routes,
        splits=splits,
        split_specs=setup_mod.check_splits(splits, routes, 1),
        dist=None,
        model=model,
        mesh=mesh,
        replicated=rep,
        batch_sharding=batch_sharding(mesh),
        direct_feed=True,
        optimizer=opt,
        hyper=layout,
        schedules=resolved,
        steps_per_epoch=spe,
        total_steps=spe * 2,
        seed=0,
        run_dir=tmp,
        run_id="test",
        max_epochs=2,
        accum=accum,
        steps_per_call=steps_per_call,
    )
    ts = setup_mod.initial_state(model, params, mstate, opt.tx, rng, rep)
    return spec, ts, DeviceValues(values, layout.base(opt, values))


# ---------------------------------------------------------------- the hyperparameter layout
def test_layout_packs_unpacks_and_writes_each_group_by_name():
    spec, ts, device = make_spec(TwoGroups())
    layout = spec.hyper
    assert layout.slots == (
        ("opt", "opt.body.learning_rate"),
        ("opt", "opt.head.learning_rate"),
        ("device", "smoothing"),
    )
    vec = layout.pack(0, spec.schedules, device.hyper_base)
    np.testing.assert_allclose(vec, [1e-3, 1e-2, 0.0], rtol=1e-6)
    unpacked = layout.unpack(jnp.asarray(vec))
    assert unpacked["device"]["smoothing"].dtype == jnp.float32
    written = layout.write(ts.opt_state, {"opt.head.learning_rate": 0.5})
    now = hyper.read(spec.optimizer, written)
    assert float(now["opt.head.learning_rate"]) == 0.5
    assert float(now["opt.body.learning_rate"]) == pytest.approx(1e-3)  # untouched


def test_a_schedule_wins_over_the_base_value_and_the_clip_is_named():
    @jn.experiment
    class Clipped(Tiny):
        def gradient_clip_norm(self):
            return 1.0

    table = {"opt.learning_rate": jn.schedules.linear(1.0, 0.0)}
    spec, ts, device = make_spec(Clipped(), schedules=table)
    first = spec.hyper.pack(0, spec.schedules, device.hyper_base)
    last = spec.hyper.pack(spec.total_steps - 1, spec.schedules, device.hyper_base)
    assert first[0] == pytest.approx(1e-2) and last[0] == pytest.approx(0.0, abs=1e-9)
    assert set(ts.opt_state) == {"clip", "update"}  # optax.named_chain: state by name


def test_a_schedule_on_a_non_scalar_device_field_is_refused():
    opt = optim.build(Tiny(), {"w": jnp.ones((2, 2))})
    sched = Schedules({"device.mask": lambda t: 1.0}, 4, {})
    with pytest.raises(jn.ConfigError, match="only scalar float Device fields"):
        HyperLayout.build(opt, {"mask": jnp.ones((3,), jnp.float32)}, sched)


# ---------------------------------------------------------------- the feed
def test_the_feed_stacks_steps_and_micro_batches_with_their_hyperparameters():
    spec, _, device = make_spec(accum=2, steps_per_call=2)
    loader = spec.splits["train"]
    units = list(feed.train_units(spec, loader, 0, 0))
    assert [u.size for u in units] == [4]  # 64 rows / 16 = 4 batches = one unit of 2×2
    prepare = feed.train_prepare(spec, 0, device.hyper_base)
    (batch, hv, steps), *_ = prepare(units[0])[0]
    assert steps == 2 and batch["x"].shape == (2, 2, 16, 8)
    assert np.asarray(hv).shape == (2, len(spec.hyper.slots))


def test_a_tail_that_does_not_fill_a_call_runs_as_single_steps():
    spec, _, device = make_spec(steps_per_call=3)  # 4 steps per epoch: 3 + a tail of 1
    units = list(feed.train_units(spec, spec.splits["train"], 0, 0))
    prepare = feed.train_prepare(spec, 0, device.hyper_base)
    shapes = [[(c.batch["x"].shape, c.steps) for c in prepare(u)[0]] for u in units]
    assert shapes == [[((3, 16, 8), 3)], [((16, 8), 1)]]


# ---------------------------------------------------------------- the program builders
@pytest.mark.slow
def test_train_and_eval_programs_from_a_spec_and_their_keys():
    spec, ts, device = make_spec()
    ps = ProgramSet()
    unit = feed.first_unit(spec, spec.splits["train"])
    (batch, hv, steps), *_ = feed.train_prepare(spec, 0, device.hyper_base)(unit)[0]
    prog = train_program(spec, ps, ts, batch, device.extras, hv, steps)
    assert isinstance(prog.key, explain.ProgramKey) and prog.key.option("accum") == 1
    leaves, treedef = jax.tree.flatten(ts)
    carry = StateCarry(leaves, 0)  # the leaves as the program takes them (`train_layout`)
    out = carry.run(prog, train_layout(prog), steps, batch, device.extras, hv)
    new = jax.tree.unflatten(treedef, carry.leaves())
    assert int(new.step) == 1 and np.isfinite(float(out["loss"]))
    # The same spec and shapes: a hit, not a second compile.
    again = train_program(spec, ProgramSet(), new, batch, device.extras, hv, steps)
    assert again is prog

    shapes = eval_metric_shapes(spec, new, "val", device.extras)
    totals = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    dev, _ = feed.eval_prepare(spec, "val", 8)(spec.split_specs["val"].first)
    ragged = eval_program(spec, ps, new, "val", dev, device.extras, totals, 4)
    got = ragged(new.params, new.state, dev, device.extras, totals)
    assert int(got["acc"][1]) == 4  # padding rows never reach the totals
    assert ragged.key.option("rows") == 4 and ragged.key.split == "val"


@pytest.mark.slow
def test_an_option_in_the_key_is_explained_by_name():
    spec, ts, device = make_spec()
    other = spec.replace(precision="bf16")
    ps = ProgramSet()
    unit = feed.first_unit(spec, spec.splits["train"])
    (batch, hv, steps), *_ = feed.train_prepare(spec, 0, device.hyper_base)(unit)[0]
    train_program(spec, ps, ts, batch, device.extras, hv, steps)
    prog = train_program(other, ps, ts, batch, device.extras, hv, steps)
    assert "precision 'f32' → 'bf16'" in prog.reasons


# ---------------------------------------------------------------- one epoch of the loop
class Parts:
    """The parts the loop reads, assembled by hand (what `jn.Nitro` holds after setup)."""

    def __init__(self, spec, ts, device, tmp):
        self.spec, self.device, self.programs = spec, device, ProgramSet()
        self.services = Services(
            logger=NullLogger(),
            checkpointer=NoCheckpointer(),
            display=Display(False),
            lock=RunLock(tmp),
            run_dir=tmp,
            params_line={},
        )
        self.progress = Progress()
        self.state_leaves, self._def = jax.tree.flatten(ts)

    train_state = property(lambda self: jax.tree.unflatten(self._def, self.state_leaves))
    step = property(lambda self: self.progress.step)
    epoch = property(lambda self: self.progress.epoch)
    max_epochs = property(lambda self: self.spec.max_epochs)
    display = property(lambda self: self.services.display)
    logger = property(lambda self: self.services.logger)
    checkpointer = property(lambda self: self.services.checkpointer)

    def take(self, *, leaves=None, progress=None, state=None):
        if isinstance(leaves, Unmerged):  # handed over mid-epoch: merged where read
            leaves = leaves.leaves()
        self.state_leaves = leaves if leaves is not None else self.state_leaves
        self.progress = progress if progress is not None else self.progress


@pytest.mark.slow
def test_one_epoch_of_the_loop_advances_state_and_progress(tmp_path):
    from jaxnitro._src.train.epoch import run_epoch

    spec, ts, device = make_spec(tmp=tmp_path)
    parts = Parts(spec, ts, device, tmp_path)
    before = jax.tree.map(np.asarray, ts.params)
    done = run_epoch(parts, 0)
    assert len(done.losses) == 4 and all(np.isfinite(done.losses)) and done.seconds > 0
    assert parts.progress == Progress(epoch=1, batch_in_epoch=0, step=4)
    after = parts.train_state
    assert int(after.step) == 4
    pairs = zip(jax.tree.leaves(before), jax.tree.leaves(after.params), strict=True)
    assert not all(np.array_equal(a, b) for a, b in pairs)


def test_a_stop_request_ends_the_epoch_mid_way_and_keeps_the_position(tmp_path):
    from jaxnitro._src.train.epoch import run_epoch

    spec, ts, device = make_spec(tmp=tmp_path)
    parts = Parts(spec, ts, device, tmp_path)
    parts.services.control.request()
    run_epoch(parts, 0)
    assert parts.progress.epoch == 0 and parts.progress.batch_in_epoch == 1  # resumable here
    assert int(parts.train_state.step) == 1 and parts.step == 1
    assert cache.cache_stats()["entries"] >= 1
