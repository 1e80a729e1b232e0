"""A differential fuzz test of compile discipline: random edits, each followed by an entry point.

One experiment reads every kind of thing a user edits: a helper module (edited on disk and
reloaded), a dict global of that module (mutated in place), a method patched onto the class, a
frozen GraphConst config whose class's method is edited, a class-level `functools.partial`,
a closure cell, an environment variable, JAX's matmul precision and x64 flags, a Device field,
and a docstring. Each step makes one random edit and calls `jn.predict` on a live handle
(a closed key: the fast path, no trace), `jn.validate` or `jn.train_step` (a loss function
cell re-run, or the same loss function object called again after the edit), and checks:

- the result against the current code run eagerly (no silent stale program);
- the programs compiled: one when the program's inputs (the edited state) were never seen for
  that entry point, none when they were (no needless recompile).

The state is a small tuple of values, so a walk returns to seen states often. Failures name
the seed, the step and the edits that led there. `JAXNITRO_FUZZ_EDITS` (default 200) and
`JAXNITRO_FUZZ_SEED` (default 0) run it longer or elsewhere.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import random
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import Tiny, make_data
from flax import nnx

import jaxnitro as jn

EDITS = int(os.environ.get("JAXNITRO_FUZZ_EDITS", "200"))
fuzz_helpers = None  # the helper module, bound as `import fuzz_helpers_...` would
SEED = int(os.environ.get("JAXNITRO_FUZZ_SEED", "0"))

HELPER = """
import jax.numpy as jnp

GAIN = {gain}
TABLE = {{"b": {table}}}


def act(x):
    # {comment}
    return jnp.tanh(x) * GAIN
"""

# What each edit sets, and the values it draws from (the first is the start).
CHOICES = {
    "reload": (1.0, 2.0),  # GAIN in the helper module, edited on disk and reloaded
    "table": (1.0, 3.0),  # helpers.TABLE["b"], mutated in place
    "method": (0.0, 0.5),  # self.bias(), a method re-defined on the class
    "config": (1.0, -1.0),  # a method of the frozen GraphConst config's class, edited
    "partial": (0.0, 0.25),  # a class-level functools.partial's argument
    "closure": (1.0, 1.5),  # a closure cell of a helper the class holds, set in place
    "env": ("1", "2"),  # os.environ read while tracing
    "precision": (None, "highest"),  # jax_default_matmul_precision
    "x64": (False, True),  # jax_enable_x64
}
# Edits that never change a program: a Device value, a docstring, a comment in the module.
NEUTRAL = {"device": (0.0, 0.5), "docstring": (0, 1), "comment": (0, 1)}


@dataclasses.dataclass(frozen=True)
class FuzzCfg:
    width: int = 4

    def sign(self):
        return 1.0


def _shift(x, k):
    return x + k


def _closure(v):
    def post(x):
        return x * v

    return post


def _method(value: float, doc: int = 0):
    namespace: dict = {}
    doc_line = f'"""doc {doc}"""' if doc else ""
    exec(  # a cell re-run: a new function object with the new constant
        textwrap.dedent(
            f"""
            def bias(self):
                {doc_line}
                return {value!r}
            """
        ),
        namespace,
    )
    return namespace["bias"]


def _sign(value: float):
    namespace: dict = {}
    exec(f"def sign(self):\n    return {value!r}\n", namespace)
    return namespace["sign"]


class World:
    """The edited world: the helper module, the experiment class and the flags, with the
    state that says what the current code computes."""

    def __init__(self, tmp_path, tag: str):
        self.tmp_path, self.name = tmp_path, f"fuzz_helpers_{tag}"
        self.state = {k: v[0] for k, v in CHOICES.items()}
        self.neutral = {k: v[0] for k, v in NEUTRAL.items()}
        self.flags = {
            "jax_default_matmul_precision": jax.config.jax_default_matmul_precision,
            "jax_enable_x64": jax.config.jax_enable_x64,
        }
        self._write()
        if str(tmp_path) not in sys.path:
            sys.path.insert(0, str(tmp_path))
        importlib.invalidate_caches()
        sys.modules.pop(self.name, None)
        self.helpers = importlib.import_module(self.name)
        self.cls = self._experiment()
        os.environ["JN_FUZZ_ENV"] = self.state["env"]

    def _write(self) -> None:
        (self.tmp_path / f"{self.name}.py").write_text(
            HELPER.format(
                gain=self.state["reload"],
                table=self.state["table"],
                comment=f"comment {self.neutral['comment']}",
            )
        )

    def _experiment(self) -> type:
        global fuzz_helpers
        fuzz_helpers = self.helpers  # a module global, as `import helpers` binds it

        @jn.experiment
        class Fuzz(Tiny):
            cfg: jn.GraphConst[FuzzCfg] = FuzzCfg()
            dgain: jn.Device[float] = 0.0
            n_train: int = 64
            n_val: int = 32
            val_batch: int = 16
            bias = _method(self.state["method"])
            shift = functools.partial(_shift, k=self.state["partial"])
            post = staticmethod(_closure(self.state["closure"]))

            def build_model(self, rng):
                return jn.split_model(nnx.Linear(8, 4, rngs=nnx.Rngs(rng)))

            def forward(self, model, params, state, *, x):
                out, state = jn.apply(model, params, state, x)
                out = fuzz_helpers.act(out) * fuzz_helpers.TABLE["b"] + self.bias()
                out = self.post(self.shift(out)) * self.cfg.sign()
                out = out * float(os.environ.get("JN_FUZZ_ENV", "1")) + self.dgain
                out = out + jnp.zeros(4, dtype=float)  # float64 under x64: a new program
                return out, state

        self.forward_code = Fuzz.forward.__code__
        return Fuzz

    # -- edits ------------------------------------------------------------------------------
    def edit(self, kind: str, value) -> None:
        if kind in NEUTRAL:
            self.neutral[kind] = value
        else:
            self.state[kind] = value
        if kind in ("reload", "comment"):
            self._write()
            os.utime(self.tmp_path / f"{self.name}.py", (0, 1e9 + random.random()))
            importlib.invalidate_caches()
            sys.dont_write_bytecode = True
            try:
                # a reload re-runs the module: its TABLE starts from the file's value
                self.helpers = importlib.reload(self.helpers)
            finally:
                sys.dont_write_bytecode = False
        elif kind == "table":
            self.helpers.TABLE["b"] = value
        elif kind == "method":
            self.cls.bias = _method(value, self.neutral["docstring"])
        elif kind == "docstring":
            self.cls.bias = _method(self.state["method"], value)
        elif kind == "config":
            FuzzCfg.sign = _sign(value)
        elif kind == "partial":
            self.cls.shift = functools.partial(_shift, k=value)
        elif kind == "closure":
            self.cls.post.__closure__[0].cell_contents = value
        elif kind == "env":
            os.environ["JN_FUZZ_ENV"] = value
        elif kind == "precision":
            jax.config.update("jax_default_matmul_precision", value)
        elif kind == "x64":
            jax.config.update("jax_enable_x64", value)

    def restore(self) -> None:
        for name, value in self.flags.items():
            jax.config.update(name, value)
        FuzzCfg.sign = _sign(1.0)
        os.environ.pop("JN_FUZZ_ENV", None)
        sys.modules.pop(self.name, None)

    def program_state(self) -> tuple:
        """What the programs are a function of (the neutral edits are not)."""
        return tuple(sorted(self.state.items()))


def _eager_forward(world: World, exp, params, x) -> np.ndarray:
    """The current code's `forward`, run eagerly on the host: every value it reads is read
    from where the code reads it now (the module, the class, the config, the environment);
    the layer and the activation in numpy, so an oracle call compiles nothing."""
    cls, mod = world.cls, world.helpers
    out = np.asarray(x, np.float64) @ np.asarray(params["kernel"], np.float64)
    out = out + np.asarray(params["bias"], np.float64)
    out = np.tanh(out) * mod.GAIN * mod.TABLE["b"] + cls.bias(exp)
    out = np.asarray(cls.post(cls.shift(out)), np.float64) * exp.cfg.sign()
    return out * float(os.environ.get("JN_FUZZ_ENV", "1")) + float(exp.dgain)


def _eager_loss(logits: np.ndarray, y: np.ndarray) -> float:
    """Mean softmax cross-entropy (Tiny's loss with smoothing 0; the train_step loss)."""
    z = logits - logits.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    return float(-logp[np.arange(len(y)), y].mean())


def _close(got, want, what: str) -> None:
    np.testing.assert_allclose(
        np.asarray(got, np.float64),
        np.asarray(want, np.float64),
        rtol=2e-4,
        atol=2e-4,
        err_msg=what,
    )


def _loss_fn(world: World):
    """A loss function cell, run again before each jn.train_step call."""
    fuzz_forward = world.cls.forward
    exp = world.cls(n_val=0)

    def loss_fn(model, params, model_state, batch):
        out, new_state = fuzz_forward(exp, model, params, model_state, x=batch["x"])
        labels = jax.nn.one_hot(batch["y"], 4)
        return optax.softmax_cross_entropy(out, labels).mean(), new_state

    return loss_fn, exp


def _same_loss_fn(world: World):
    """One loss function object for the whole run: it reads the experiment class (patched
    by the edits) through its closure, so only its content says what it computes now."""
    cls = world.cls
    exp = cls(n_val=0)

    def loss_fn(model, params, model_state, batch):
        out, new_state = cls.forward(exp, model, params, model_state, x=batch["x"])
        labels = jax.nn.one_hot(batch["y"], 4)
        return optax.softmax_cross_entropy(out, labels).mean(), new_state

    return loss_fn, exp


def run_fuzz(tmp_path, edits: int, seed: int) -> dict:
    rng = random.Random(seed)
    world = World(tmp_path, f"s{seed}")
    x, y = make_data(16, seed=1)
    log: list[str] = []
    seen: dict[str, set] = {"predict": set(), "eval": set(), "train_step": set()}
    counts = {"predict": 0, "validate": 0, "train_step": 0, "same_loss_fn": 0, "compiles": 0}
    try:
        jn.cache_reset()
        n = jn.Nitro(world.cls(), run_dir=tmp_path / "run", progress="off")
        ts = None
        same = _same_loss_fn(world)
        kinds = list(CHOICES) + list(NEUTRAL)
        for step in range(edits):
            kind = rng.choice(kinds)
            values = (CHOICES | NEUTRAL)[kind]
            value = rng.choice(values)
            if kind == "device":
                jn.set_device(n, dgain=value)
            else:
                world.edit(kind, value)
            entry = rng.choices(
                ["predict", "validate", "train_step", "same_loss_fn"], weights=(6, 2, 1, 1)
            )[0]
            log.append(f"{step}: {kind}={value!r} then {entry}")
            where = f"seed {seed}, edits so far:\n  " + "\n  ".join(log[-8:])
            before = jn.cache_stats()["misses"]
            program = world.program_state()
            if entry == "predict":
                got = jn.predict(n, {"x": x})
                want = _eager_forward(world, n.experiment, n.params, x)
                _close(got, want, f"stale predict; {where}")
                slot = "predict"
            elif entry == "validate":
                got = jn.validate(n)["val_loss"]
                vx, vy = make_data(n.experiment.n_train + n.experiment.n_val)
                vx, vy = vx[n.experiment.n_train :], vy[n.experiment.n_train :]
                out = _eager_forward(world, n.experiment, n.params, vx)  # (equal batches)
                _close(got, _eager_loss(out, vy), f"stale validate; {where}")
                slot = "eval"
            else:
                if ts is None or not isinstance(ts, jn.TrainState):
                    model, params, state = jn.split_model(nnx.Linear(8, 4, rngs=nnx.Rngs(0)))
                    ts = jn.TrainState.create(model, params, state, optax.sgd(0.1))
                fn, exp = _loss_fn(world) if entry == "train_step" else same
                want = _eager_loss(_eager_forward(world, exp, ts.params, x), y)
                ts, loss, _ = jn.train_step(fn, ts, {"x": x, "y": y})
                _close(loss, want, f"stale train_step; {where}")
                slot = "train_step"
            counts[entry] += 1
            if edits > 200 and step % 100 == 99:  # a long run says how far it got
                print(f"fuzz seed {seed}: {step + 1} edits, {counts}", flush=True)
            compiled = jn.cache_stats()["misses"] - before
            expected = int(program not in seen[slot])
            seen[slot].add(program)
            counts["compiles"] += compiled
            assert compiled == expected, (
                f"{'needless recompile' if compiled > expected else 'no compile'}: {compiled} "
                f"program(s) compiled, {expected} expected; {where}"
            )
    finally:
        world.restore()
    return {"edits": edits, "seed": seed, **counts}


@pytest.mark.slow  # 200 edits: ~26 CPU seconds, over the fast tier's budget
def test_random_edits_never_reach_a_stale_program_nor_recompile_needlessly(tmp_path):
    summary = run_fuzz(tmp_path, EDITS, SEED)
    print(summary)
    assert summary["edits"] == EDITS


if __name__ == "__main__":  # pragma: no cover - the long run: python test_compile_fuzz.py
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        print(run_fuzz(Path(d), EDITS, SEED))
