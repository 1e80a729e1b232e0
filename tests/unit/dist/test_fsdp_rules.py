"""The FSDP rule and its checks, in-process (no devices needed): which arrays `param_specs`
shards by their byte size, when `check_fsdp` warns, and the mesh size `make_mesh` checks.
(Found by the sampled mutation run of dist/: tests/README.md, "Scores".)"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jaxnitro as jn
from jaxnitro._src.dist.sharding.placement import check_fsdp, make_mesh
from jaxnitro._src.dist.sharding.rules import param_specs


def test_fsdp_shards_an_array_by_its_bytes_over_min_shard_bytes_not_its_elements():
    params = {
        "big": np.zeros((16, 16), np.float32),  # 1,024 bytes (256 elements)
        "edge": np.zeros((8, 16), np.float32),  # 512 bytes: not over the minimum
        "small": np.zeros((16,), np.float32),  # 64 bytes
    }
    specs = param_specs(params, jn.Sharding(fsdp=True, min_shard_bytes=512), {"data": 2})
    assert specs == {"big": P("data"), "edge": P(), "small": P()}


def test_check_fsdp_warns_when_whole_arrays_hold_most_bytes_and_not_when_none_does():
    params = {"w": np.zeros((15, 7), np.float32), "b": np.zeros((7,), np.float32)}
    with pytest.warns(UserWarning, match=r"leaves 100% of the parameter bytes .* replicated") as w:
        check_fsdp(params, jn.Sharding(fsdp=True, min_shard_bytes=0), 2)
    assert "b (7,), w (15, 7)" in str(w[0].message)  # each array by its path and shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing over the minimum: nothing to say
        check_fsdp(params, jn.Sharding(fsdp=True, min_shard_bytes=1 << 20), 2)


@pytest.mark.parametrize("n_devices", [2, 8])
def test_a_mesh_and_another_device_count_are_refused_either_way(n_devices):
    with pytest.raises(jn.ConfigError, match=rf"n_devices={n_devices} but .* spans 4 devices"):
        make_mesh(jn.Sharding(mesh={"data": 2, "model": 2}), n_devices)


def test_setup_devices_takes_its_arguments_by_name():
    """As the docs call it (`jn.setup_devices(backend="cpu", n_devices=1, ...)`); the cache
    argument None keeps the one in use."""
    info = jn.setup_devices(backend=None, compilation_cache=None)
    assert info.backend == "cpu" and info.visible >= 1


def test_a_sharding_is_data_parallel_unless_fsdp_is_asked():
    assert jn.Sharding().fsdp is False and jn.Sharding(mesh={"data": 2}).fsdp is False
    params = {"big": np.zeros((16, 16), np.float32)}
    assert param_specs(params, jn.Sharding(min_shard_bytes=0), {"data": 2}) == {"big": P()}
