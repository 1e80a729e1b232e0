"""The learning-rate range test: one program, the handle untouched, a sensible suggestion."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
from conftest import Tiny, host_copy, leaves_equal, nitro

import jaxnitro as jn


@pytest.mark.slow
def test_lr_find_leaves_the_handle_untouched_and_compiles_nothing_new(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    jn.train(n)
    before = host_copy(n.state_leaves)
    step, progress = n.step, n.progress
    misses = jn.cache_stats()["misses"]
    found = jn.lr_find(n, min_lr=1e-5, max_lr=1000.0, steps=60)
    assert jn.cache_stats()["misses"] == misses  # the run's own train program
    assert leaves_equal(n.state_leaves, before)  # params, optimizer state, step, rng
    assert n.step == step and n.progress == progress
    rates = np.asarray(found.rates)
    np.testing.assert_allclose(rates[1:] / rates[:-1], (1000.0 / 1e-5) ** (1 / 59), rtol=1e-5)
    assert found.stopped_early and len(rates) < 60  # rates in the hundreds diverge
    assert found.suggestion is not None and 1e-3 < found.suggestion < rates[-1]
    assert found.suggestion < rates[int(np.argmin(found.smoothed))] * 1.0001  # before the minimum
    assert found.plot is not None and found.plot.name == "lr_find.png"
    jn.train(n)  # training still works from where it was (max_epochs already reached: warns)


def test_lr_find_says_what_is_wrong(run_dir):
    n = nitro(Tiny(max_epochs=1), run_dir=run_dir)
    with pytest.raises(jn.ConfigError, match=r"0 < min_lr < max_lr"):
        jn.lr_find(n, min_lr=1.0, max_lr=0.1)
    with pytest.raises(jn.ConfigError, match=r"at least 10 steps"):
        jn.lr_find(n, steps=3)
    fused = nitro(Tiny(max_epochs=1), run_dir=run_dir / "f", steps_per_call=2)
    with pytest.raises(jn.ConfigError, match=r"steps_per_call=1"):
        jn.lr_find(fused)


def test_lr_find_documents_every_result_field_and_its_example_uses_its_classs_fields():
    names = [f.name for f in dataclasses.fields(jn.LRFindResult)]
    for doc in (jn.lr_find.__doc__, jn.LRFindResult.__doc__):
        assert all(f"`{name}`" in doc or f"{name}:" in doc for name in names), doc
    # every keyword the example passes to its experiment is a field the example declares
    example = jn.lr_find.__doc__.split("Example:")[1]
    declared = set(re.findall(r"^\s*(?:\.\.\.|>>>)\s+(\w+): \w+ =", example, re.M))
    passed = set(re.findall(r"Tuned\((\w+)=", example))
    assert passed and passed <= declared
