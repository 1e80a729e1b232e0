"""Weight averaging: an exponential moving average (EMA) of the parameters, in the train step.

`Nitro(ema=0.999)` keeps `TrainState.ema = {"decay", "params"[, "state"]}`: one f32 copy of
the parameters placed like them (FSDP shards stay shards), donated with them, updated after
each optimizer step inside the train program (no extra dispatch, no host copy) and written in
every checkpoint. The decay is a traced scalar in that tree, so changing it compiles nothing;
the ramp, the cadence and whether model state is averaged are part of the program's key.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Protocol

import jax
import jax.numpy as jnp

from jaxnitro._src.core.errors import ConfigError

if TYPE_CHECKING:
    from pathlib import Path

    from jaxnitro._src.core.types import Batch, PyTree
    from jaxnitro._src.steps.state import TrainState
    from jaxnitro._src.steps.step import StepFn

WEIGHTS = ("ema", "raw")


@dataclasses.dataclass(frozen=True)
class Ema:
    """The averaging settings of a run (`Nitro(ema=..., ema_warmup=..., ...)`).

    Attributes:
        decay: the weight of the old average per update (0 < decay < 1).
        warmup: ramp the decay as `min(decay, (1 + t) / (10 + t))`, t the optimizer steps
            taken before the update, so early averages are not dominated by the initial weights.
        every: update every `every` optimizer steps, with the decay compounded (`decay**every`).
        state: average the model state (BatchNorm statistics) too; else it is copied.
        eval: validate with the EMA weights (True), the raw ones (False), or both ("both":
            `val_*` for the EMA weights, `val_raw_*` for the raw ones).
    """

    decay: float
    warmup: bool = True
    every: int = 1
    state: bool = False
    eval: bool | str = True

    def key(self) -> tuple:
        """What changes the train program (the decay is traced)."""
        return ("warmup" if self.warmup else "flat", self.every, self.state)

    def options(self) -> dict[str, Any]:
        """The `jn.Nitro` keywords that give these settings."""
        return {
            "ema": self.decay,
            "ema_warmup": self.warmup,
            "ema_every": self.every,
            "ema_state": self.state,
            "ema_eval": self.eval,
        }

    @property
    def validates(self) -> str:
        """The weights validation ranks by: "ema" unless `ema_eval=False`."""
        return "raw" if self.eval is False else "ema"


def setting(decay: Any, warmup: Any, every: Any, state: PyTree, eval_: Any) -> Ema | None:
    """Validate `Nitro(ema=..., ema_warmup=..., ema_every=..., ema_state=..., ema_eval=...)`."""
    if decay is None:
        given = {
            "ema_warmup": (warmup, True),
            "ema_every": (every, 1),
            "ema_state": (state, False),
            "ema_eval": (eval_, True),
        }
        for name, (value, default) in given.items():
            if value is not None and value != default:
                raise ConfigError(
                    f"{name}={value!r} without ema; {name} tunes weight averaging, which is "
                    f"off. Turn it on, e.g. Nitro(ema=0.999, {name}={value!r}), or drop {name}."
                )
        return None
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay < 1:
        raise ConfigError(
            f"ema={decay!r}; the decay is a number strictly between 0 and 1 (the weight of the "
            f"old average per step), e.g. ema=0.999 (about the last 1,000 steps), or None (off)."
        )
    for name, value in (("ema_warmup", warmup), ("ema_state", state)):
        if value is not None and not isinstance(value, bool):
            raise ConfigError(f"{name}={value!r}; use True or False.")
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ConfigError(
            f"ema_every={every!r}; pass a whole number of optimizer steps >= 1 between "
            f"updates, e.g. ema_every=10 (the decay is compounded to match)."
        )
    if eval_ not in (None, True, False, "both"):
        raise ConfigError(
            f"ema_eval={eval_!r}; use True (validate with the EMA weights), False (the raw "
            f"weights) or 'both' (val_* for the EMA weights, val_raw_* for the raw ones)."
        )
    return Ema(
        decay=float(decay),
        warmup=True if warmup is None else warmup,
        every=1 if every is None else every,
        state=bool(state),
        eval=True if eval_ is None else eval_,
    )


def weights_setting(value: Any) -> str | None:
    """`weights=` of predict, evaluate, export_model and `Nitro(checkpoint=...)`."""
    if value not in (None, *WEIGHTS):
        raise ConfigError(
            f"weights={value!r}; use 'ema' (the averaged weights), 'raw' (the trained weights) "
            f"or None (what validation used)."
        )
    return value


def f32(x: Any) -> Any:
    return x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x


def init(ema: Ema, params: PyTree, state: PyTree, step: Any) -> dict:
    """A fresh average: f32 copies of the params (and the model state when it is averaged),
    on the same devices and shardings, and the decay (one per member: the step's shape)."""
    trees = {"params": params, **({"state": state} if ema.state else {})}
    shardings = jax.tree.map(lambda x: x.sharding, trees)
    copied = jax.jit(lambda t: jax.tree.map(f32, t), out_shardings=shardings)(trees)
    decay = jax.device_put(jnp.full(step.shape, ema.decay, jnp.float32), step.sharding)
    return {"decay": decay, **copied}


def averaging(one: Any, ema: Ema) -> StepFn:
    """Wrap one optimizer step `(ts, batch, extras, hyper) -> (ts, out)` so it updates the
    average from the step's new params: built-in and custom steps alike. A skipped step
    (`on_nonfinite="skip"`) leaves the average as it was."""

    def step(
        ts: TrainState, batch: Batch, extras: dict[str, Any], hyper: Any
    ) -> tuple[TrainState, Any]:
        new, out = one(ts, batch, extras, hyper)
        avg = ts.ema
        decay = avg["decay"]
        if ema.warmup:
            t = ts.step.astype(jnp.float32)
            decay = jnp.minimum(decay, (1 + t) / (10 + t))
        if ema.every > 1:
            decay = decay**ema.every
        keep = None
        if ema.every > 1:
            keep = (new.step % ema.every) != 0
        if "skipped" in out:
            skipped = out["skipped"] > 0
            keep = skipped if keep is None else keep | skipped
        updated = dict(avg)
        updated["params"] = _moved(avg["params"], new.params, decay, keep)
        if ema.state:
            updated["state"] = _moved(avg["state"], new.state, decay, keep)
        return new.replace(ema=updated), out

    return step


def _moved(avg: Any, current: Any, decay: Any, keep: Any) -> PyTree:
    def one(a: Any, x: Any) -> jax.Array:
        if not jnp.issubdtype(a.dtype, jnp.floating):  # counters and the like: copied
            nxt = x.astype(a.dtype)
        else:
            nxt = decay * a + (1 - decay) * x.astype(jnp.float32)
        return nxt if keep is None else jnp.where(keep, a, nxt)

    return jax.tree.map(one, avg, current)


class _WeightsSpec(Protocol):
    @property
    def ema(self) -> Ema | None: ...
    @property
    def weights_loaded(self) -> str | None: ...
    @property
    def weights_path(self) -> Path | None: ...


class _Steps(Protocol):
    @property
    def step(self) -> int: ...


class WeightsSource(Protocol):
    """What `which` and `pick` read of a run (a `jn.Nitro` is one): the averaging and the
    weights a checkpoint loaded (`spec`), the optimizer steps taken (`progress.step`) and the
    weights themselves (`train_state`)."""

    @property
    def spec(self) -> _WeightsSpec: ...
    @property
    def progress(self) -> _Steps: ...
    @property
    def train_state(self) -> TrainState: ...


def which(n: WeightsSource, weights: str | None) -> str:
    """The weights `weights=` names on this handle, "ema" or "raw" (None: those validation
    uses; on a handle that loaded a checkpoint and has not trained, those it loaded)."""
    weights = weights_setting(weights)
    if weights is not None:
        return weights
    if n.spec.ema is not None:
        return n.spec.ema.validates
    loaded = n.spec.weights_loaded
    return loaded if loaded is not None and n.progress.step == 0 else "raw"


def pick(n: WeightsSource, weights: str | None) -> tuple[Any, Any]:
    """(params, model state) of the run for `weights` ("ema", "raw", or None: what
    validation used), cast back to the params' dtypes for the eval and predict programs."""
    named = which(n, weights)
    ema = n.spec.ema
    ts = n.train_state
    if n.spec.weights_loaded == "ema" and n.progress.step == 0:
        # checkpoint=..., weights="ema" loaded the average as the model's weights; the raw
        # ones stayed on disk, and untrained since, the params are the average
        if weights_setting(weights) != "raw":
            return ts.params, ts.state
        raise ConfigError(
            f"weights='raw', but this handle loaded the weight average of checkpoint "
            f"{n.spec.weights_path} (weights='ema', or its default): its raw weights were not "
            f"loaded. Load them: jn.Nitro(exp, checkpoint={str(n.spec.weights_path)!r}, "
            f"weights='raw')."
        )
    if named == "raw":
        return ts.params, ts.state
    if ema is None or ts.ema is None:
        raise ConfigError(
            "weights='ema', but this run keeps no average of its weights; train with "
            "jn.Nitro(exp, ema=0.999), or pass weights='raw' (or leave it out)."
        )
    return as_model(ts.ema, ts.params, ts.state)


def as_model(avg: dict, params: PyTree, state: PyTree) -> tuple[Any, Any]:
    """The average as (params, model state) in the dtypes of the model's own trees."""
    p = jax.tree.map(lambda a, x: a.astype(x.dtype), avg["params"], params)
    s = state
    if "state" in avg:
        s = jax.tree.map(lambda a, x: a.astype(x.dtype), avg["state"], state)
    return p, s
