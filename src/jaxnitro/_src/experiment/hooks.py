"""Hook discovery, signature checks and keyword routing of batch fields.

Traced hooks receive only the batch fields they name as keyword-only parameters (a `**batch`
parameter receives them all). Every check here runs at setup, before anything compiles.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping

from jaxnitro._src.core.errors import HookError, RoutingError, did_you_mean

REQUIRED = ("build_model", "build_data", "forward", "loss")
OPTIONAL = (
    "metrics", "train_metrics", "finalize_metrics", "derive", "param_group", "optimizer",
    "learning_rate", "weight_decay", "decay_anchor", "no_decay", "gradient_clip_norm",
    "schedules",
    "presets",
    "export_inputs", "export_preprocess", "export_postprocess",
    "visualize",
    "train_step", "optimizers",
)  # fmt: skip
#: Hooks traced into a compiled program, with how many positional arguments follow `self`.
TRACED = {"forward": 3, "loss": 1, "metrics": 1, "train_metrics": 1, "train_step": 5}
_SIGNATURES = {
    "build_model": "build_model(self, rng)",
    "build_data": "build_data(self, dist)",
    "forward": "forward(self, model, params, state, *, <batch fields>)",
    "loss": "loss(self, outputs, *, <batch fields>)",
    "metrics": "metrics(self, outputs, *, <batch fields>)",
    "train_metrics": "train_metrics(self, outputs, *, <batch fields>)",
    "train_step": "train_step(self, model, params, opt_state, state, rng, *, <batch fields>)",
}


@dataclasses.dataclass(frozen=True)
class Route:
    """The batch fields one traced hook receives."""

    hook: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    takes_all: bool  # has a **batch parameter

    def select(self, batch: Mapping) -> dict:
        if self.takes_all:
            return dict(batch)
        names = self.required + tuple(n for n in self.optional if n in batch)
        return {n: batch[n] for n in names}


def _own_hook(cls, name: str):
    fn = getattr(cls, name, None)
    return fn if callable(fn) else None


def check_hooks(cls) -> dict[str, Route]:
    """Validate the experiment's hooks; return the routes of the traced ones that exist."""
    methods = {n for n in dir(cls) if not n.startswith("_") and callable(getattr(cls, n, None))}
    known = set(REQUIRED) | set(OPTIONAL) | {"from_preset"}
    # A custom `train_step` replaces `loss` in training; validation logs a loss when it exists.
    custom = _own_hook(cls, "train_step") is not None
    missing = [h for h in REQUIRED if _own_hook(cls, h) is None and not (custom and h == "loss")]
    if missing:
        hints = "".join(
            f"\n  - {_SIGNATURES[h]}" + did_you_mean(h, methods - known, cutoff=0.7)
            for h in missing
        )
        raise HookError(f"{cls.__name__} is missing required hook(s):{hints}")
    for name in sorted(methods - known):
        close = did_you_mean(name, known, cutoff=0.8)
        if close:
            raise HookError(
                f"{cls.__name__}.{name} looks like a misspelled hook and would never be called."
                f"{close} Rename it, or prefix it with '_' if it is a helper."
            )
    routes = {}
    for hook, n_pos in TRACED.items():
        fn = _own_hook(cls, hook)
        if fn is not None:
            routes[hook] = _route(cls.__name__, hook, fn, n_pos)
    return routes


def _route(cls_name: str, hook: str, fn, n_pos: int) -> Route:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return Route(hook, (), (), True)
    params = list(sig.parameters.values())[1:]  # drop self
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    has_varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    required_pos = [p for p in positional if p.default is p.empty]
    if (len(positional) < n_pos and not has_varargs) or len(required_pos) > n_pos:
        raise HookError(
            f"{cls_name}.{hook}{sig} has the wrong signature: expected {_SIGNATURES[hook]}. "
            f"Batch fields are keyword-only: put them after a '*'."
        )
    kw = [p for p in params if p.kind == p.KEYWORD_ONLY]
    # Positional-or-keyword parameters past the first n_pos also name batch fields.
    kw += positional[n_pos:]
    return Route(
        hook,
        required=tuple(p.name for p in kw if p.default is p.empty),
        optional=tuple(p.name for p in kw if p.default is not p.empty),
        takes_all=any(p.kind == p.VAR_KEYWORD for p in params),
    )


def check_batch(routes: Mapping[str, Route], batch_fields, split: str, *, hooks=None) -> None:
    """Every field a hook requires must be in the batch; name the hook and what the batch has."""
    have = sorted(batch_fields)
    for hook, route in routes.items():
        if hooks is not None and hook not in hooks:
            continue
        absent = [n for n in route.required if n not in batch_fields]
        if absent:
            hint = "".join(did_you_mean(n, have) for n in absent)
            raise RoutingError(
                f"{hook}() needs batch field(s) {absent} but the {split!r} batches have {have}."
                f"{hint} Rename the keyword parameter or add the field to the data."
            )


def device_fields(routes: Mapping[str, Route], batch_fields, *, hooks=None) -> tuple[str, ...]:
    """The batch fields some traced hook uses: only these are transferred to the device."""
    used: set[str] = set()
    for hook, route in routes.items():
        if hooks is not None and hook not in hooks:
            continue
        if route.takes_all:
            return tuple(sorted(batch_fields))
        used.update(route.required)
        used.update(n for n in route.optional if n in batch_fields)
    return tuple(sorted(n for n in batch_fields if n in used))
