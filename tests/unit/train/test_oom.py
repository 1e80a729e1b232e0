"""Out of memory mid-run: the report replaces XLA's message, the original chained (issue 30).

The step below asks XLA for a 256 TiB temporary, more than any address space holds, so the
allocation fails at once without touching memory; `memory_budget` is set above it so that the
plan, which would refuse it before step 1, lets the run reach the real failure.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import nitro
from flax import nnx
from helpers.slow_step import Lin

import jaxnitro as jn
from jaxnitro._src.train import oom

HUGE = 2**46  # float32 elements: 256 TiB


@jn.experiment
class Greedy:
    max_epochs: int = 1
    rows: int = 16  # 8 per batch

    def build_model(self, rng):
        return jn.split_model(Lin(nnx.Rngs(rng)))

    def build_data(self, dist):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(self.rows, 8)).astype(np.float32)
        y = np.zeros(self.rows, np.int32)
        return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=8)}

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        scale = jax.lax.stop_gradient(logits).sum()
        waste = jnp.cumsum(jnp.sin(jnp.arange(HUGE, dtype=jnp.float32) * scale))[::7].sum()
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return ce + 0.0 * waste


@pytest.mark.slow
def test_an_allocation_failure_mid_run_is_reported_with_the_original_chained(tmp_path):
    # an epoch of 4 steps: step 1 fails, and the report names it, not the last dispatched
    n = nitro(Greedy(rows=32), run_dir=tmp_path, checkpointer=False, memory_budget=2**62)
    with pytest.raises(oom.OutOfMemoryError) as e:
        jn.train(n)
    text = str(e.value)
    assert "out of device memory while training (epoch 1, step 1)" in text
    assert "in program 'train" in text
    assert re.search(r"temporaries [\d.]+ TiB", text), text  # the plan's figure for it
    assert "largest arrays alive:" in text and "parameters:" in text
    assert "float32[8, 4]" in text  # the kernel, with its dtype and shape
    assert "fixes that fit:" in text and 'precision="bf16"' in text
    assert "RESOURCE_EXHAUSTED" in str(e.value.__cause__)  # the original, chained
    assert isinstance(e.value, MemoryError)


def test_other_errors_are_not_taken_for_out_of_memory():
    assert oom.is_oom(RuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 8 bytes."))
    assert not oom.is_oom(ValueError("bad shape"))
    assert not oom.is_oom(jn.MemoryPlanError("the plan does not fit: out of memory"))
