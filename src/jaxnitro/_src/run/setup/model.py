"""Setup, [5]-[6]: Device values, the model and its parameters, the custom-step check, the
optimizer's schedules and grad-norm setting, and the initial `TrainState`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxnitro._src.core.errors import ConfigError, HookError
from jaxnitro._src.core.jsonable import jsonable
from jaxnitro._src.dist import sharding as sharding_mod
from jaxnitro._src.experiment.markers import fields
from jaxnitro._src.optim.schedules import resolve_schedules
from jaxnitro._src.run.settings import Settings
from jaxnitro._src.run.spec import RunSpec
from jaxnitro._src.steps.state import TrainState

if TYPE_CHECKING:
    from collections.abc import Mapping

    import optax
    from jax.sharding import NamedSharding

    from jaxnitro._src.core.types import Hooked, Model, PyTree
    from jaxnitro._src.experiment.hooks import Route
    from jaxnitro._src.optim.groups import Optimizer
    from jaxnitro._src.optim.schedules import Schedules


def build_model(
    exp: Hooked, seed: int, rep: NamedSharding, *, init: dict | None = None
) -> tuple[Any, Any, Any, jax.Array]:
    """(model, params, model state, the run's RNG key). The model state and key are
    replicated on the mesh; the params are placed once, by their shardings, in
    `initial_state` (a replicated copy first would hold every parameter twice).

    `init`: a dict shared by the builds of one experiment with several seeds (a population's
    members): its init program is compiled once, then run with each seed's key."""
    key = jax.random.PRNGKey(seed)
    built, rng = _init_traced(exp, key, init) or _init_eager(exp, key)
    state = built[2] if built[2] is not None else {}
    state = sharding_mod.place(state, jax.tree.map(lambda _: rep, state))
    return built[0], built[1], state, sharding_mod.to_sharding(rng, rep)


#: The most bytes of constants an init program may hold: more means arrays made outside the
#: key (loaded weights), which would be baked into the program and its cache entry.
INIT_CONSTANTS_MAX = 1 << 20
#: How the init program is compiled on a CPU: it runs once, so at LLVM's -O1, not -O2. Its
#: values are the same bit for bit (no pass at either level reorders floating point; at -O0
#: they differ in the last place), and XLA:CPU compiles random initializers about twice as
#: fast: a cold MNIST MLP's init 1.5 s -> 0.85 s (at -O2, longer than its train step's compile).
INIT_COMPILER_OPTIONS = {"xla_backend_optimization_level": 1}


def _init_eager(exp: Hooked, key: jax.Array) -> tuple[tuple, jax.Array]:
    init_key, rng = jax.random.split(key)
    built = exp.build_model(init_key)
    if not (isinstance(built, tuple) and len(built) == 3):
        raise HookError(
            f"{type(exp).__name__}.build_model must return (model, params, state), got "
            f"{type(built).__name__}. Wrap your module: return jn.split_model(module)."
        )
    return built, rng


def _init_traced(
    exp: Hooked, key: jax.Array, init: dict | None = None
) -> tuple[tuple, jax.Array] | None:
    """`build_model` as one program (the key split, every initializer), or None where it
    cannot be one, and the caller runs it eagerly.

    Run eagerly, each operation of an initializer is a program of its own: compiled on a
    cold start and loaded from the persistent cache one by one on a warm one (about 0.15 s
    of CPU for the quick start's two layers). Traced, they are one program, loaded once, with
    the same values bit for bit. Not traced: a `build_model` that does host work on values or
    fails under tracing (it then runs eagerly, so its own error is the one raised), whose
    params or state hold anything but arrays it computed, or that bakes in more than
    `INIT_CONSTANTS_MAX` bytes of arrays (weights it loaded: they stay out of the program).
    With `init`, a program compiled by an earlier call is run again with this key."""
    if init and "program" in init:
        module, program = init["program"]
        (params, state), rng = program(key)
        return (module, params, state), rng
    model: list = []

    def arrays(key: jax.Array) -> tuple[tuple, jax.Array]:
        init_key, rng = jax.random.split(key)
        built = exp.build_model(init_key)
        if not (isinstance(built, tuple) and len(built) == 3):
            raise _Untraceable
        trees = (built[1], built[2])
        if not all(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(trees)):
            raise _Untraceable
        model.append(built[0])
        return trees, rng

    try:
        traced = jax.jit(arrays).trace(key)
    except Exception:  # noqa: BLE001 - the eager call raises the user's error, if any
        return None
    consts = sum(getattr(c, "nbytes", 0) for c in traced.jaxpr.consts)
    leaked = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(model[0]))
    if consts > INIT_CONSTANTS_MAX or leaked:
        return None
    program = traced.lower().compile(
        INIT_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    )
    if init is not None:
        init["program"] = (model[0], program)
    (params, state), rng = program(key)
    return (model[0], params, state), rng


class _Untraceable(Exception):
    """build_model's result cannot come out of one program."""


def check_custom_step(s: Settings, routes: Mapping[str, Route]) -> bool:
    """A custom `train_step` is selected; the options that assume one loss are refused."""
    if "train_step" not in routes:
        return False
    refused = {
        "accum": (s.accum > 1, f"accum={s.accum}", "accumulate inside train_step (a lax.scan "
                  "over micro-batches) or raise the batch size"),
        "precision": (s.precision != "f32", f"precision={s.precision!r}", "cast the params "
                      "and inputs to bfloat16 inside train_step"),
        "log_grad_norm": (s.log_grad_norm is True, "log_grad_norm=True", "return the norm "
                          "you want among train_step's metrics (optax.tree.norm(grads))"),
    }  # fmt: skip
    for bad, what, fix in refused.values():
        if bad:
            raise ConfigError(
                f"{what} applies to the built-in train step (one loss, one gradient); this "
                f"experiment defines its own train_step. Drop the option, and {fix}."
            )
    return True


def grad_norm_setting(value: Any, optimizer: Optimizer) -> bool:
    """The gradient norm per step costs a pass over the gradients (~15% of a small MLP's step
    on CPU): logged when clipping computes it anyway, or when asked for."""
    if value not in (None, True, False):
        raise ConfigError(
            f"log_grad_norm={value!r}; use True, False or None (the default: on when "
            f"gradient_clip_norm is set)."
        )
    return optimizer.clip > 0 if value is None else value


def schedules_of(
    s: Settings, exp: Hooked, optimizer: Optimizer, spe: int | None
) -> tuple[Schedules, int]:
    """(resolved schedules, total steps): resolved against the run's optimizer steps."""
    total = (spe or 0) * s.max_epochs
    if s.schedules and not spe:
        raise ConfigError(
            "schedules need the number of steps per epoch, but the 'train' split has no len(); "
            "use a jn.DataLoader or give it __len__."
        )
    markers = {f.name: f.marker for f in fields(exp)}
    resolved = resolve_schedules(
        s.schedules, opt=optimizer, device_fields=markers, total_steps=max(total, 1)
    )
    return resolved, total


def initial_state(
    model: Model,
    params: PyTree,
    state: PyTree,
    tx: optax.GradientTransformation,
    rng: jax.Array,
    rep: NamedSharding,
    shardings: PyTree = None,
    *,
    members: int | None = None,
) -> TrainState:
    """Every leaf lives on the mesh as the train step returns it (parameters by their
    shardings, optimizer state after its parameter, the rest replicated), so the program's
    input avals (and key) are the same at step 1 and step N. With `members`, the trees
    carry a leading member axis (replicated) and each member gets its optimizer state."""
    if members is not None:
        opt_state = jax.jit(jax.vmap(tx.init), out_shardings=rep)(params)
        step = sharding_mod.to_sharding(np.zeros((members,), np.int32), rep)
        return TrainState(params, state, opt_state, step, rng, model=model, tx=tx)
    if shardings is None:
        shardings = jax.tree.map(lambda _: rep, params)
    params = sharding_mod.place(params, shardings)
    opt_sh = sharding_mod.opt_state_shardings(tx, params, shardings, rep)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
    step = sharding_mod.to_sharding(np.zeros((), np.int32), rep)
    return TrainState(params, state, opt_state, step, rng, model=model, tx=tx)


def params_line(spec: RunSpec) -> dict:
    """The `params` log line: what this run is."""
    exp = spec.experiment
    return {
        "experiment": spec.cls.__name__,
        "seed": spec.seed,
        "max_epochs": spec.max_epochs,
        "n_devices": spec.n_devices,
        "backend": jax.default_backend(),
        "run_id": spec.run_id,
        "config": {f.name: jsonable(getattr(exp, f.name)) for f in fields(exp)},
        "markers": {f.name: f.marker for f in fields(exp)},
    }
