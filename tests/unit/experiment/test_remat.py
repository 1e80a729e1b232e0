"""Rematerialisation per block: the same training, less stored, named errors."""

from __future__ import annotations

import re

import jax
import numpy as np
import optax
import pytest
from conftest import host_copy, make_data, nitro
from flax import nnx

import jaxnitro as jn
from jaxnitro._src.compile import cache


class Block(nnx.Module):
    def __init__(self, width: int, *, rngs: nnx.Rngs):
        self.a = nnx.Linear(width, width, rngs=rngs)
        self.b = nnx.Linear(width, width, rngs=rngs)

    def __call__(self, x):
        return x + self.b(jax.nn.gelu(self.a(x)))


class Net(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(8, 32, rngs=rngs)
        self.blocks = nnx.List([Block(32, rngs=rngs) for _ in range(3)])
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


@jn.experiment
class Deep:
    max_epochs: int = 1

    def build_model(self, rng):
        return jn.split_model(Net(rngs=nnx.Rngs(rng)))

    def build_data(self, dist):
        x, y = make_data(128)
        return {"train": jn.DataLoader({"x": x, "y": y}, batch_size=32, drop_last=True)}

    def forward(self, model, params, state, *, x):
        return jn.apply(model, params, state, x)

    def loss(self, logits, *, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "dots_saveable"])
def test_remat_trains_to_the_same_parameters(tmp_path, policy):
    plain = nitro(Deep(), run_dir=tmp_path / "plain", checkpointer=False)
    jn.train(plain)
    rem = nitro(
        Deep(), run_dir=tmp_path / policy, checkpointer=False, remat=["Block"], remat_policy=policy
    )
    assert [c.__name__ for c in rem.spec.remat.classes] == ["Block"]
    jn.train(rem)
    for a, b in zip(
        jax.tree.leaves(host_copy(plain.params)),
        jax.tree.leaves(host_copy(rem.params)),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, atol=1e-6)
    train = [p for p in rem.programs.compiled if p.kind == "train"]
    assert train and train[0].key.option("remat") is not None  # part of the key, explained
    assert Block.__call__ is vars(Block)["__call__"]  # the class is restored after tracing
    assert not hasattr(Block.__call__, "__wrapped__")


class _Traced(Exception):
    """Raised by the spy once it has the train program's jaxpr: no XLA compile needed."""


def train_jaxpr(n, monkeypatch) -> str:
    """The jaxpr of the train program `n` would run, traced by jaxnitro's own program path."""
    real = cache.get_or_compile
    seen = []

    def spy(key, lower, *, kind, **kw):
        if kind != "train":
            return real(key, lower, kind=kind, **kw)
        seen.append(str(lower().jaxpr))
        raise _Traced

    with monkeypatch.context() as m:
        m.setattr(cache, "get_or_compile", spy)
        with pytest.raises(_Traced):
            jn.compile(n)
    return seen[0]


REMAT = re.compile(r"\b(?:checkpoint|remat\d*)\[")


@pytest.mark.slow
def test_the_traced_step_is_rematerialised_only_inside_the_blocks(tmp_path, monkeypatch):
    @jn.experiment
    class Traced(Deep):  # a class of its own: its programs are never cache hits
        pass

    rem = nitro(Traced(), run_dir=tmp_path / "r", checkpointer=False, remat=["Block"])
    regions = len(REMAT.findall(train_jaxpr(rem, monkeypatch)))
    assert regions == 3, f"{regions} remat regions in the train program; one per Block"
    plain = nitro(Traced(), run_dir=tmp_path / "p", checkpointer=False)
    regions = len(REMAT.findall(train_jaxpr(plain, monkeypatch)))
    assert regions == 0, f"{regions} remat regions in the train program without remat"


def test_remat_errors_name_the_classes_and_policies(tmp_path):
    with pytest.raises(jn.ConfigError, match=r"does not contain; its module classes are .*'Block'"):
        nitro(Deep(), run_dir=tmp_path / "a", remat=["Blok"])
    with pytest.raises(jn.ConfigError, match=r"remat_policy='dots'.*dots_saveable"):
        nitro(Deep(), run_dir=tmp_path / "b", remat=["Block"], remat_policy="dots")
    with pytest.raises(jn.ConfigError, match=r"as a list, e.g. remat=\['Block'\]"):
        nitro(Deep(), run_dir=tmp_path / "c", remat="Block")
