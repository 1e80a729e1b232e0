"""The loop's read-back of step outputs: read as they are on a CPU, stacked on the device
elsewhere; both give the same host values for single steps, fused calls and populations."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxnitro._src.train.readback import InFlight, read_back


def _runs():
    """A run's outputs: single steps, a fused call between them; and a population's."""
    single = [
        InFlight(i, i, 1, {"loss": jnp.float32(0.5 + i), "acc": jnp.float32(i / 10)})
        for i in range(3)
    ]
    fused = [InFlight(8, 8, 4, {"loss": jnp.arange(4, dtype=jnp.float32), "acc": jnp.ones(4)})]
    members = [
        InFlight(i, i, 1, {"loss": jnp.array([1.0, 2.0, 3.0]) * i, "acc": jnp.zeros(3)})
        for i in range(2)
    ]
    return single + fused + single, members


def test_host_and_device_read_backs_agree():
    for items in _runs():
        on_host = read_back(items, on_host=True)
        on_device = read_back(items, on_host=False)
        assert len(on_host) == len(on_device) == len(items)
        for a, b in zip(on_host, on_device, strict=True):
            assert a.keys() == b.keys() == {"loss", "acc"}
            for k in a:
                np.testing.assert_array_equal(np.asarray(a[k]), np.asarray(b[k]))
    steps, members = (read_back(items, on_host=True) for items in _runs())
    assert float(steps[1]["loss"]) == 1.5 and list(steps[3]["loss"]) == [0, 1, 2, 3]
    assert list(members[1]["loss"]) == [1.0, 2.0, 3.0]
