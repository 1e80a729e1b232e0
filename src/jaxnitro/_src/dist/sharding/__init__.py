"""Where a run's arrays live: the mesh, and how parameters and optimizer state are split.

`sharding="dp"` (the default) replicates parameters and splits batches over the `data` axis;
`"fsdp"` also splits every large parameter (and its optimizer state) over `data`;
`jn.Sharding(mesh={"data": 4, "model": 2}, rules=[...])` adds a model axis and user rules.
Multi-process runs (`jax.distributed`) will plug in here too.
"""

from jaxnitro._src.dist.sharding.placement import (
    check_fsdp,
    describe,
    device_bytes,
    make_mesh,
    opt_state_shardings,
    param_shardings,
    place,
    to_sharding,
)
from jaxnitro._src.dist.sharding.rules import Sharding, param_specs, resolve, spec_for

__all__ = [
    "Sharding",
    "check_fsdp",
    "describe",
    "device_bytes",
    "make_mesh",
    "opt_state_shardings",
    "param_shardings",
    "param_specs",
    "place",
    "resolve",
    "spec_for",
    "to_sharding",
]
