"""Setup: from an experiment and the options of `jn.Nitro(...)` to the parts of a run.

The order is fixed and each step is a small function returning a frozen piece: [1] settings →
[2] run dir and services → [3] resume record → [4] data → derive → [5] mesh and Device values
→ model → [6] routing checks on the first batches → optimizer, schedules and hyperparameter
layout → [7] the train split on the device → [8] checkpointer and metric checks → [9] restore.
Setup validates everything it can before anything compiles, and writes none of the run's files
(only a resume may move a corrupted checkpoint aside, under the run lock).

One module per concern: `rundir` (run dir, services, resume record), `data`, `model`,
`resident`, `population`, `metrics`, `restore`, `weights` (`Nitro(checkpoint=...)`), and
`sequence` (`build`, the steps in order). This package re-exports what the handle, the CLI
and `jn.set_device` use.
"""

from jaxnitro._src.run.setup.data import Dist, check_splits, device_array, steps_per_epoch
from jaxnitro._src.run.setup.model import build_model, initial_state, params_line
from jaxnitro._src.run.setup.rundir import logger_of, make_run_dir, read_meta, services
from jaxnitro._src.run.setup.sequence import Built, build
from jaxnitro._src.run.setup.weights import weights_path

__all__ = [
    "Built",
    "Dist",
    "build",
    "build_model",
    "check_splits",
    "device_array",
    "initial_state",
    "logger_of",
    "make_run_dir",
    "params_line",
    "read_meta",
    "services",
    "steps_per_epoch",
    "weights_path",
]
