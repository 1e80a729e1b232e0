"""`jaxnitro.distributed`, the public module: re-exports `jaxnitro._src.dist.distributed` (its home)
and the layout resolution of `jaxnitro._src.dist.layout`.

`import jaxnitro.distributed` and `from jaxnitro.distributed import ...` work as they always did.
"""

from jaxnitro._src.dist.distributed import ENV_COORDINATOR as ENV_COORDINATOR
from jaxnitro._src.dist.distributed import ENV_LOCAL_DEVICE_IDS as ENV_LOCAL_DEVICE_IDS
from jaxnitro._src.dist.distributed import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from jaxnitro._src.dist.distributed import ENV_PROCESS_ID as ENV_PROCESS_ID
from jaxnitro._src.dist.distributed import (
    DistributedError,
    barrier,
    broadcast,
    check_same,
    initialize,
    is_initialized,
    process_count,
    process_index,
)
from jaxnitro._src.dist.distributed import decided_by_process_zero as decided_by_process_zero
from jaxnitro._src.dist.distributed import gather as gather
from jaxnitro._src.dist.distributed import resolve_args as resolve_args
from jaxnitro._src.dist.distributed import timeout_ms as timeout_ms
from jaxnitro._src.dist.layout import SOURCES as SOURCES
from jaxnitro._src.dist.layout import Layout as Layout
from jaxnitro._src.dist.layout import resolve as resolve_layout  # noqa: F401 - public

__all__ = [
    "DistributedError",
    "barrier",
    "broadcast",
    "check_same",
    "initialize",
    "is_initialized",
    "process_count",
    "process_index",
]
