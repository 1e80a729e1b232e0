"""The memory plan: estimates from XLA, the fit check, and the suggested changes."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import Tiny, nitro

import jaxnitro as jn
from jaxnitro._src.compile import memory
from jaxnitro._src.core.errors import MemoryPlanError

TX = optax.adam(1e-3)
BATCH = 256


def init_state():
    key1, key2 = jax.random.split(jax.random.key(0))
    params = {
        "w1": jax.random.normal(key1, (8, 256)) * 0.1,
        "b1": jnp.zeros(256),
        "w2": jax.random.normal(key2, (256, 4)) * 0.1,
        "b2": jnp.zeros(4),
    }
    return params, TX.init(params)


def train_step(state, x, y):
    params, opt_state = state

    def loss(params):
        h = jax.nn.relu(x @ params["w1"] + params["b1"])
        logits = h @ params["w2"] + params["b2"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    value, grads = jax.value_and_grad(loss)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), value


def compile_step(batch_size):
    state = jax.eval_shape(init_state)
    x = jax.ShapeDtypeStruct((batch_size, 8), jnp.float32)
    y = jax.ShapeDtypeStruct((batch_size,), jnp.int32)
    return jax.jit(train_step, donate_argnums=0).lower(state, x, y).compile()


def batch_bytes(batch_size):
    return batch_size * (8 * 4 + 4)


def make_plan(compiled, batch_size=BATCH, *, capacity, source="memory_budget", staging=0):
    params, opt_state = jax.eval_shape(init_state)
    return memory.plan(
        {"train": compiled},
        params=params,
        opt_state=opt_state,
        model_state={},
        batch_bytes=batch_bytes(batch_size),
        batches_in_flight=2,
        checkpoint_staging_bytes=staging,
        capacity=capacity,
        capacity_source=source,
    )


@pytest.fixture(scope="module")
def compiled():
    return compile_step(BATCH)


@pytest.mark.slow
def test_estimate_is_xla_memory_analysis(compiled):
    m = compiled.memory_analysis()
    expected = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
        + m.generated_code_size_in_bytes
    )
    p = make_plan(compiled, capacity=1 << 40)
    (program,) = p.programs
    assert m.alias_size_in_bytes > 0  # the donated state is not counted twice
    assert program.estimate == expected > 0
    assert p.total == expected + 2 * batch_bytes(BATCH)
    assert p.params_bytes == (8 * 256 + 256 + 256 * 4 + 4) * 4
    assert p.opt_state_bytes > 2 * p.params_bytes  # adam: mu, nu and the count
    assert p.fits


def test_the_largest_program_sets_the_total_not_the_sum(compiled):
    small = compile_step(8)
    p = memory.plan(
        {"eval": small, "train": compiled},
        params={},
        opt_state={},
        model_state={},
        batch_bytes=0,
        batches_in_flight=0,
        checkpoint_staging_bytes=0,
        capacity=1 << 40,
        capacity_source="x",
    )
    train, evaluation = p.largest, p.programs[0]
    assert train.name == "train" and evaluation.name == "eval"
    assert p.total == train.estimate > evaluation.estimate > 0  # max, not sum
    assert "'eval'" in p.table()


def test_checkpoint_staging_counts_only_against_host_ram(compiled):
    device = make_plan(compiled, capacity=1 << 40, source="bytes_limit of cuda:0", staging=10**6)
    host = make_plan(compiled, capacity=1 << 40, source="available host RAM", staging=10**6)
    assert host.total == device.total + 10**6
    assert "not counted" in device.table() and "not counted" not in host.table()


def test_check_passes_when_it_fits(compiled):
    memory.check(make_plan(compiled, capacity=1 << 40), batch_size=BATCH, n_devices=1)


def test_check_fails_with_the_table_when_nothing_fits(compiled):
    p = make_plan(compiled, capacity=1024)
    with pytest.raises(MemoryPlanError) as info:
        memory.check(p, batch_size=BATCH, n_devices=1)
    message = str(info.value)
    assert isinstance(info.value, MemoryError)
    for row in (
        "params",
        "optimizer state",
        "temporaries",
        "batches in flight",
        "total",
        "capacity (memory_budget)",
        "1.0 KiB",
    ):
        assert row in message, row
    # params and optimizer state alone exceed 1 KiB: no batch size can help, and it says so
    assert "a smaller batch alone will not do" in message
    assert "FSDP" in message and "remat=" in message and "bf16" in message


def test_suggested_batch_size_fits_when_compiled(compiled):
    full = make_plan(compiled, capacity=1 << 40)
    per_batch = full.largest.temporaries + batch_bytes(BATCH) * 3
    capacity = full.total - per_batch // 2  # room for about half the batch

    p = make_plan(compiled, capacity=capacity)
    with pytest.raises(MemoryPlanError) as info:
        memory.check(p, batch_size=BATCH, n_devices=4)
    message = str(info.value)
    suggested = int(re.search(r"batch_size=(\d+) \(from 256\)", message).group(1))
    assert 1 <= suggested < BATCH
    accum, micro = map(int, re.search(r"accum=(\d+) with batch_size=(\d+)", message).groups())
    assert accum * micro == BATCH and micro <= suggested
    assert "over the 4 devices" in message

    # the linear model errs on the safe side: the suggested batch really fits
    assert make_plan(compile_step(suggested), suggested, capacity=capacity).fits


def test_device_capacity_on_cpu_is_host_ram():
    capacity, source = memory.device_capacity(jax.devices("cpu")[0])
    assert capacity > 0 and "host RAM" in source


def test_memory_budget_wins():
    assert memory.device_capacity(memory_budget=123) == (123, "memory_budget")


@pytest.mark.slow
def test_memory_plan_refuses_before_step_one(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir, memory_budget=2048)
    with pytest.raises(jn.MemoryPlanError) as e:
        jn.train(n)
    msg = str(e.value)
    assert "params" in msg and "optimizer state" in msg and "temporaries" in msg
    assert n.step == 0 and n.checkpointer.latest() is None
    plan = jn.memory_plan(nitro(Tiny(), run_dir=run_dir / "b"))
    assert plan.fits and plan.total > plan.params_bytes > 0
