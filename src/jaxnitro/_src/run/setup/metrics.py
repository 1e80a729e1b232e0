"""Setup, [8]: the checks on the metrics the run produces (the checkpointer's and early
stopping's monitor among them), before anything is trained."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jaxnitro._src.core.errors import ConfigError, did_you_mean
from jaxnitro._src.run.services import Services
from jaxnitro._src.run.spec import DeviceValues, RunSpec
from jaxnitro._src.steps.state import TrainState

if TYPE_CHECKING:
    from typing import Any


def eval_metric_names(spec: RunSpec, ts: TrainState, device: DeviceValues, split: str) -> list[str]:
    """The metric names validation produces (traced abstractly; nothing compiles)."""
    from jaxnitro._src.programs.builders import eval_metric_shapes

    names = list(eval_metric_shapes(spec, ts, split, device.extras))
    if spec.ema is not None and spec.ema.eval == "both" and split == "val":  # the raw weights'
        names += [f"val_raw_{k.removeprefix('val_')}" for k in names]
    return sorted(names)


def check_metrics(spec: RunSpec, ts: TrainState, device: Any, svc: Services, named: bool) -> None:
    """The checkpointer's and early stopping's metrics are produced by this run."""
    metric = svc.checkpointer.metric
    has_val = "val" in spec.splits
    names = eval_metric_names(spec, ts, device, "val") if has_val else []
    if not has_val and named and metric is not None:
        raise ConfigError(
            f"the checkpointer monitors {metric!r} but the data has no 'val' split, so no "
            f"metric is ever produced. Add a 'val' split, or use the default checkpointer "
            f"(keeps the newest)."
        )
    if has_val and metric not in names:
        if named:
            raise ConfigError(
                f"the checkpointer monitors {metric!r}, which this run never produces; "
                f"validation produces {names}." + did_you_mean(metric, names)
            )
        if names:
            svc.checkpointer.monitor(names[0])
    es = spec.early_stop
    if es is not None:
        es.check_metric(["train_loss", *names], has_val=has_val)
    if spec.reduce_lr_on_plateau is not None:
        spec.reduce_lr_on_plateau.check(spec, ["train_loss", *names], has_val=has_val)
