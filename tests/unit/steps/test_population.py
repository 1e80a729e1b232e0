"""Population training: N members in one compiled program, each equal to its standalone run."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from conftest import Tiny, host_copy, leaves_equal, make_data, nitro
from helpers.paths import ROOT

import jaxnitro as jn


def _max_diff(stacked, i, single) -> float:
    a, b = jax.tree.leaves(host_copy(stacked)), jax.tree.leaves(host_copy(single))
    return max(float(np.abs(x[i] - y).max()) for x, y in zip(a, b, strict=True))


@jn.experiment
class Rated(Tiny):
    lr: float = 1e-2

    def learning_rate(self, group):
        return self.lr


@pytest.mark.no_suite_cache
@pytest.mark.slow  # ~15 CPU seconds: four runs' compiles
def test_members_by_seed_equal_their_standalone_runs_in_one_program(tmp_path):
    jn.cache_reset()
    top = jn.TopKCheckpointer(k=1, metric="acc", mode="max")
    n = nitro(Tiny(dropout=0.2), run_dir=tmp_path / "pop", population=3, checkpointer=top)
    result = jn.train(n)
    assert result.programs_compiled == 2  # one train program, one eval program, all members
    for i in range(3):
        alone = nitro(Tiny(dropout=0.2), run_dir=tmp_path / f"s{i}", seed=42 + i)
        jn.train(alone)
        assert _max_diff(n.params, i, alone.params) < 1e-6, i
        assert _max_diff(n.opt_state, i, alone.opt_state) < 1e-6, i
    lines = [json.loads(s) for s in (tmp_path / "pop" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r.get("context") == "train"]
    assert len(train) == 16 and {"loss/0", "loss/1", "loss/2", "loss"} <= set(train[0])
    val = [r for r in lines if r.get("context") == "validate"][-1]
    assert {"acc/0", "acc/1", "acc/2", "member"} <= set(val)
    ranked = result.members
    assert [m["member"] for m in ranked] == sorted(range(3), key=lambda i: (-val[f"acc/{i}"], i))
    assert ranked[0]["seed"] == 42 + ranked[0]["member"]
    assert val["acc"] == max(val[f"acc/{i}"] for i in range(3))  # the best member's, by name
    assert val["val_loss"] == val[f"val_loss/{val['member']}"]
    # Top-K keeps the epoch of the best member's best accuracy
    rows = [r for r in lines if r.get("context") == "validate"]
    assert result.best_metric == max(r[f"acc/{i}"] for r in rows for i in range(3))


@pytest.mark.slow
def test_members_by_value_differ_only_in_their_values(tmp_path):
    values = [0.0, 0.1, 0.3]
    lrs = [1e-2, 3e-2, 3e-3]
    n = nitro(
        Rated(), run_dir=tmp_path / "pop", population={"smoothing": values, "learning_rate": lrs}
    )
    jn.train(n)
    for i, (v, lr) in enumerate(zip(values, lrs, strict=True)):
        alone = nitro(Rated(smoothing=v, lr=lr), run_dir=tmp_path / f"s{i}")
        jn.train(alone)
        assert _max_diff(n.params, i, alone.params) < 1e-6, i
    np.testing.assert_allclose(jn.device_value(n, "smoothing"), values)


@pytest.mark.slow  # ~15 CPU seconds: four runs' compiles
def test_a_population_fuses_steps_and_resumes_bitwise(tmp_path):
    straight = nitro(Tiny(max_epochs=2), run_dir=tmp_path / "a", population=2)
    jn.train(straight)
    fused = nitro(Tiny(max_epochs=2), run_dir=tmp_path / "b", population=2, steps_per_call=4)
    jn.train(fused)
    assert leaves_equal(fused.state_leaves, straight.state_leaves)
    jn.train(nitro(Tiny(max_epochs=1), run_dir=tmp_path / "c", population=2))
    resumed = nitro(Tiny(max_epochs=2), run_dir=tmp_path / "c", population=2, resume="auto")
    jn.train(resumed)
    assert leaves_equal(resumed.state_leaves, straight.state_leaves)  # all members, one ckpt


@pytest.mark.slow
def test_member_is_a_normal_handle(tmp_path):
    n = nitro(Tiny(max_epochs=1), run_dir=tmp_path / "pop", population=2)
    jn.train(n)
    x, _ = make_data(10, seed=3)
    with pytest.raises(jn.ConfigError, match=r"jn.predict works on one model.*jn.member\(n, i\)"):
        jn.predict(n, {"x": x})
    alone = nitro(Tiny(max_epochs=1), run_dir=tmp_path / "s1", seed=43)
    jn.train(alone)
    one = jn.member(n, 1)
    assert one.spec.population is None and one.step == n.step
    np.testing.assert_allclose(
        jn.predict(one, {"x": x}), jn.predict(alone, {"x": x}), rtol=1e-5, atol=1e-6
    )
    assert jn.validate(one)["acc"] == pytest.approx(jn.validate(alone)["acc"])
    with pytest.raises(jn.ConfigError, match=r"members 0..1"):
        jn.member(n, 2)
    with pytest.raises(jn.ConfigError, match=r"trains one model"):
        jn.member(alone, 0)


def test_population_settings_say_what_is_wrong(tmp_path):
    with pytest.raises(jn.ConfigError, match=r"'width': it is a GraphConst field"):
        nitro(Tiny(), run_dir=tmp_path, population={"width": [8, 16]})
    with pytest.raises(jn.ConfigError, match=r"no such field"):
        nitro(Tiny(), run_dir=tmp_path, population={"smoothin": [0.0, 0.1]})
    with pytest.raises(jn.ConfigError, match=r"different lengths"):
        nitro(
            Tiny(), run_dir=tmp_path, population={"smoothing": [0.0, 0.1], "learning_rate": [1.0]}
        )
    with pytest.raises(jn.ConfigError, match=r"at least 1 member"):
        nitro(Tiny(), run_dir=tmp_path, population=0)
    with pytest.raises(jn.ConfigError, match=r"sharding='dp'"):
        nitro(Tiny(), run_dir=tmp_path, population=2, sharding="fsdp")


@pytest.mark.slow
def test_set_device_on_a_population(tmp_path):
    n = nitro(Tiny(max_epochs=1), run_dir=tmp_path / "a", population=2)
    jn.set_device(n, smoothing=0.2)  # every member
    np.testing.assert_allclose(jn.device_value(n, "smoothing"), [0.2, 0.2])
    varied = nitro(Tiny(max_epochs=1), run_dir=tmp_path / "b", population={"smoothing": [0, 0.1]})
    with pytest.raises(jn.ConfigError, match=r"gives each member its own value"):
        jn.set_device(varied, smoothing=0.2)


@pytest.mark.slow
def test_each_member_stops_early_on_its_own(tmp_path):
    # member 1 (a rate of 0) never improves: it stops after `patience` epochs and is frozen
    es = jn.EarlyStopping(metric="val_loss", patience=2, min_delta=0.0)
    kw = dict(population={"learning_rate": [1e-2, 0.0]}, early_stop=es)
    n = nitro(Rated(max_epochs=5), run_dir=tmp_path / "a", **kw)
    result = jn.train(n)
    assert [m.stopped_epoch for m in n.progress.early_stop] == [None, 3]
    assert result.stop_reason == "completed" and n.epoch == 5  # member 0 trained on
    assert result.members[0]["member"] == 0
    assert [m["stopped_epoch"] for m in sorted(result.members, key=lambda m: m["member"])] == [
        None,
        3,
    ]
    lines = [json.loads(s) for s in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["member_stopped"] for r in lines if "member_stopped" in r] == [1]
    # resumed from epoch 4, the stopped member stays frozen and the run ends bitwise the same
    jn.train(nitro(Rated(max_epochs=4), run_dir=tmp_path / "b", **kw))
    resumed = nitro(Rated(max_epochs=5), run_dir=tmp_path / "b", resume="auto", **kw)
    jn.train(resumed)
    assert leaves_equal(resumed.state_leaves, n.state_leaves)


@pytest.mark.slow
def test_a_population_of_custom_steps(tmp_path):
    from test_custom_step import Alternating

    n = nitro(Alternating(shuffle=True), run_dir=tmp_path / "pop", population=2)
    jn.train(n)
    alone = nitro(Alternating(shuffle=True), run_dir=tmp_path / "s1", seed=43)
    jn.train(alone)
    assert _max_diff(n.params, 1, alone.params) < 1e-6
    assert _max_diff(n.opt_state, 1, alone.opt_state) < 1e-6


@pytest.mark.slow
def test_the_memory_plan_counts_the_members_and_says_how_many_fit(tmp_path):
    # 4 members (each built by its own init program): what is counted, not how many
    one = jn.memory_plan(nitro(Tiny(), run_dir=tmp_path / "a"))
    four = jn.memory_plan(nitro(Tiny(), run_dir=tmp_path / "b", population=4))
    assert four.params_bytes == 4 * one.params_bytes
    assert four.members == 4 and "population: 4 members" in four.table()
    budget = four.total // 2  # room for about half the members
    n = nitro(Tiny(), run_dir=tmp_path / "c", population=4, memory_budget=budget)
    with pytest.raises(jn.MemoryPlanError, match=r"population=[1-2] \(from 4\) should fit"):
        jn.train(n)


@pytest.mark.slow
def test_a_checkpoint_of_another_member_count_says_so(tmp_path):
    jn.train(nitro(Tiny(max_epochs=1), run_dir=tmp_path / "a", population=2))
    with pytest.raises(jn.CheckpointError, match=r"a population of 2 members.*population=2"):
        nitro(Tiny(max_epochs=2), run_dir=tmp_path / "a", population=3, resume="auto")
    with pytest.raises(jn.CheckpointError, match=r"load the weights of .* this run trains one"):
        nitro(Tiny(), run_dir=tmp_path / "b", checkpoint=tmp_path / "a")


@pytest.mark.slow
def test_population_members_report_the_keys_the_user_gave(run_dir):
    n = nitro(
        Tiny(max_epochs=1, n_train=64),
        run_dir=run_dir,
        population={"smoothing": [0.0, 0.1], "learning_rate": [1e-3, 1e-2]},
        checkpointer=jn.TopKCheckpointer(metric="acc", mode="max"),
    )
    members = jn.train(n).members
    assert sorted(m["member"] for m in members) == [0, 1]
    for m in members:
        assert m["learning_rate"] == [1e-3, 1e-2][m["member"]]
        assert not any(k.startswith("opt.") for k in m), m


def test_the_documented_population_example_ranks_by_a_metric_it_does_not_change():
    docs = (ROOT / "docs" / "beyond.md").read_text()
    example = docs.split("## Population training")[1].split("```")[1]
    assert '"smoothing"' in example  # the loss reads smoothing: val_loss cannot rank fairly
    assert 'TopKCheckpointer(metric="acc", mode="max")' in example
    assert "'learning_rate': " in example and "opt.default" not in example
    # The advice the README's bullet gave lives on the page now, after the example.
    advice = docs.split("## Population training")[1].split("```")[2].split("\n\n")[1]
    assert advice.startswith("Rank the members by a metric the population does not change")
    assert "`val_loss`" in advice and "Accuracy compares them fairly" in advice
