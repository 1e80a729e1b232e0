"""Shared fixtures: tiny experiments that train in well under a second on a CPU."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxnitro as jn

# The session's compilation cache and the fast tier's budget (helpers/session.py);
# CI (JAXNITRO_FAIL_ON_MISSING_DEV=1) fails a run in which a test skipped for a missing module.
pytest_plugins = ["helpers.session", "helpers.missing_dev"]

jax.config.update("jax_platforms", "cpu")
# The end-of-train curves.png costs ~0.5 s a run; the tests that check it turn it back on.
os.environ.setdefault("JAXNITRO_NO_PLOT", "1")
# One persistent compilation cache per session, for the test process (helpers/session.py; a
# test that counts its compiles is marked `no_suite_cache`) and the child processes tests
# start: the suite compiles the same small programs again and again, and each is compiled
# once. A fresh private (0700) directory, so nothing depends on ~/.cache or an earlier
# session; JAXNITRO_SUITE_CACHE=0 turns it off, and the tests of the cache itself use
# directories of their own.
if not os.environ.get("JAXNITRO_SUITE_CACHE"):  # the session's first process makes it
    os.environ["JAXNITRO_SUITE_CACHE"] = tempfile.mkdtemp(prefix="jaxnitro-suite-xla-")
    atexit.register(shutil.rmtree, os.environ["JAXNITRO_SUITE_CACHE"], ignore_errors=True)
os.environ["JAXNITRO_COMPILATION_CACHE"] = os.environ["JAXNITRO_SUITE_CACHE"]


class TinyMLP(nnx.Module):
    def __init__(self, width: int, *, dropout: float = 0.0, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(8, width, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.out = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(jax.nn.relu(self.hidden(x))))


def make_data(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    w = rng.normal(size=(8, 4)).astype(np.float32)
    y = (x @ w).argmax(-1).astype(np.int32)
    return x, y


@jn.experiment
class Tiny:
    width: jn.GraphConst[int] = 16
    smoothing: jn.Device[float] = 0.0
    dropout: jn.GraphConst[float] = 0.0
    max_epochs: int = 2
    n_train: int = 256
    n_val: int = 100
    val_batch: int = 20
    shuffle: bool = True

    def build_model(self, rng):
        return jn.split_model(TinyMLP(self.width, dropout=self.dropout, rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        x, y = make_data(self.n_train + self.n_val)
        tr, va = slice(0, self.n_train), slice(self.n_train, None)
        splits = {
            "train": jn.DataLoader(
                {"x": x[tr], "y": y[tr]}, batch_size=32, shuffle=self.shuffle, drop_last=True
            )
        }
        if self.n_val:
            splits["val"] = jn.DataLoader({"x": x[va], "y": y[va]}, batch_size=self.val_batch)
        return splits

    def learning_rate(self, group):
        return 1e-2

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        targets = optax.smooth_labels(jax.nn.one_hot(y, 4), self.smoothing)
        return optax.softmax_cross_entropy(logits, targets).mean()

    def metrics(self, logits, *, y):
        return {"acc": ((logits.argmax(-1) == y).sum(), y.shape[0])}


class Recorder:
    """A logger that records which of the six `jn.Logger` methods were called, in order."""

    def __init__(self):
        self.calls: list[str] = []

    def open(self, run_dir, *, resume):
        self.calls.append("open")

    def log_params(self, params):
        self.calls.append("params")

    def log_metrics(self, metrics, *, context, epoch, step):
        self.calls.append(context)

    def log_other(self, values):
        self.calls.append("other")

    def finish(self, status, **info):
        self.calls.append(f"finish {status}")

    def close(self):
        self.calls.append("close")


@pytest.fixture
def run_dir(tmp_path):
    return tmp_path / "run"


def nitro(exp=None, **kw):
    kw.setdefault("progress", False)
    return jn.Nitro(exp if exp is not None else Tiny(), **kw)


def leaves_equal(a, b) -> bool:
    la, lb = jax.tree.leaves(host_copy(a)), jax.tree.leaves(host_copy(b))
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb, strict=True))


def host_copy(tree):
    """A host snapshot of a pytree (typed PRNG keys as their raw key data)."""
    return jax.tree.map(
        lambda x: np.asarray(
            jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        ),
        tree,
    )
