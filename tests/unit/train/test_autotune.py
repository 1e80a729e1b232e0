"""steps_per_call="auto": measured on copies of the state, bitwise the same training."""

from __future__ import annotations

import json

import pytest
from conftest import Tiny, leaves_equal, nitro

import jaxnitro as jn
from jaxnitro._src.train import autotune


@pytest.mark.slow
@pytest.mark.parametrize("margin, want", [(1e9, 8), (0.0, 1)], ids=["fused", "single"])
def test_auto_picks_by_measurement_and_trains_bitwise_the_same(tmp_path, monkeypatch, margin, want):
    monkeypatch.setattr(autotune, "MARGIN", margin)  # 1e9: fusing always wins; 0: never
    monkeypatch.setattr(autotune, "CALL_OVERHEAD_S", 1e9)  # both are timed, however slow
    auto = nitro(Tiny(), run_dir=tmp_path / "auto", steps_per_call="auto")
    assert auto.spec.steps_per_call == 1 and auto.spec.autotune
    jn.train(auto)
    assert auto.spec.steps_per_call == want and not auto.spec.autotune
    plain = nitro(Tiny(), run_dir=tmp_path / "plain")
    jn.train(plain)
    assert leaves_equal(auto.state_leaves, plain.state_leaves)
    lines = [json.loads(s) for s in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines()]
    (tuned,) = [r for r in lines if "steps_per_call_auto" in r]
    assert tuned["steps_per_call_auto"] == want and tuned["candidate"] == 8
    assert tuned["single_step_s"] > 0 and tuned["fused_step_s"] > 0
    assert len([r for r in lines if r.get("context") == "train"]) == auto.step  # per step


def test_auto_settings(tmp_path):
    with pytest.raises(jn.ConfigError, match=r"steps_per_call='fast'.*'auto'"):
        nitro(Tiny(), run_dir=tmp_path, steps_per_call="fast")
    n = nitro(Tiny(), run_dir=tmp_path / "a", steps_per_call="auto")
    assert autotune.candidate(n.spec) == 8  # the largest divisor of 8 steps per epoch


@pytest.mark.slow
@pytest.mark.no_suite_cache
def test_a_step_too_long_to_gain_is_not_fused_nor_compiled_fused(tmp_path, monkeypatch):
    """Fusing saves at most the call overhead per step: a longer step keeps one step per call
    without compiling the fused program to time it."""
    monkeypatch.setattr(autotune, "CALL_OVERHEAD_S", 0.0)  # every step is "too long"
    n = nitro(Tiny(n_val=0, width=11), run_dir=tmp_path, steps_per_call="auto")  # not cached
    before = jn.cache_stats()["misses"]
    r = jn.train(n)
    assert n.spec.steps_per_call == 1
    assert jn.cache_stats()["misses"] - before == 1  # the single-step train program only
    assert r.programs_compiled == 1  # auto's compiles are counted
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    (tuned,) = [r for r in lines if "steps_per_call_auto" in r]
    assert tuned["steps_per_call_auto"] == 1 and tuned["fused_step_s"] is None
    assert tuned["candidate"] == 8 and tuned["candidate_timed"] is False
    assert tuned["single_step_s"] > 0
    choice = autotune.Choice(1, 8, 0.02, None)
    assert "not dispatch-bound" in choice.line() and "8 per call was not tried" in choice.line()
