"""EarlyStopping: argument checks, the improvement/patience rules, and state across a resume."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro._src.core.errors import ConfigError, MetricsError
from jaxnitro._src.run.early_stop import EarlyStopConfig, EarlyStopping, EarlyStopState


def _run(es: EarlyStopping, values, metric: str | None = None) -> list[bool]:
    metric = metric or es.metric
    return [es.update(e, {metric: v}) for e, v in enumerate(values, start=1)]


# -- arguments --------------------------------------------------------------------------
def test_defaults():
    es = EarlyStopping()
    assert (es.metric, es.mode, es.patience, es.min_delta) == ("val_loss", "min", 5, 1e-4)
    assert es.best is None and es.best_epoch is None and es.bad_epochs == 0
    assert es.stopped_epoch is None and not es.should_stop


@pytest.mark.parametrize(
    ("mode", "suggest"),
    [("maximum", "max"), ("mni", "min"), ("MAX", "max"), ("lower", "min"), ("higher", "max")],
)
def test_bad_mode_is_a_config_error_with_did_you_mean(mode, suggest):
    with pytest.raises(ConfigError, match=r"mode=.*invalid.*'min'.*'max'") as ei:
        EarlyStopping(mode=mode)
    assert f"Did you mean {suggest!r}?" in str(ei.value)


def test_bad_mode_without_a_close_match_still_lists_the_valid_ones():
    with pytest.raises(ConfigError, match=r"valid modes are 'min'.*'max'"):
        EarlyStopping(mode=3)


@pytest.mark.parametrize("patience", [0, -1, 2.5, True, "3", None])
def test_bad_patience(patience):
    with pytest.raises(ConfigError, match=r"patience must be an int >= 1"):
        EarlyStopping(patience=patience)


@pytest.mark.parametrize("min_delta", [-0.1, math.nan, math.inf, "0.1", None, True])
def test_bad_min_delta(min_delta):
    with pytest.raises(ConfigError, match=r"min_delta=.*finite number >= 0"):
        EarlyStopping(min_delta=min_delta)


@pytest.mark.parametrize("metric", ["", None, 3])
def test_bad_metric_name(metric):
    with pytest.raises(ConfigError, match=r"metric=.*e\.g\. metric='val_loss'"):
        EarlyStopping(metric=metric)


def test_integer_min_delta_is_accepted_as_float():
    assert EarlyStopping(min_delta=0).min_delta == 0.0


# -- the rules ---------------------------------------------------------------------------
def test_first_value_is_the_best_and_improvement_resets_the_count():
    es = EarlyStopping(patience=3, min_delta=0.0)
    assert _run(es, [1.0, 1.2, 0.9]) == [False, False, False]
    assert es.best == 0.9 and es.best_epoch == 3 and es.bad_epochs == 0


def test_patience_counts_consecutive_epochs_without_improvement():
    es = EarlyStopping(patience=3, min_delta=0.0)
    assert _run(es, [1.0, 1.1, 1.2, 1.3]) == [False, False, False, True]
    assert es.bad_epochs == 3 and es.stopped_epoch == 4 and es.best_epoch == 1 and es.should_stop


def test_patience_one_stops_at_the_first_bad_epoch():
    es = EarlyStopping(patience=1, min_delta=0.0)
    assert _run(es, [1.0, 0.5, 0.5]) == [False, False, True]
    assert es.stopped_epoch == 3


def test_improvement_must_exceed_min_delta_mode_min():
    es = EarlyStopping(patience=2, min_delta=0.1)
    # 0.95 and 0.9 are within min_delta of 1.0 (0.9 is exactly at the margin: not exceeding it).
    assert _run(es, [1.0, 0.95]) == [False, False]
    assert es.best == 1.0 and es.bad_epochs == 1
    assert es.update(3, {"val_loss": 0.85}) is False  # beats 1.0 - 0.1: improvement
    assert es.best == 0.85 and es.best_epoch == 3 and es.bad_epochs == 0
    assert es.update(4, {"val_loss": 0.76}) is False  # 0.09 better: not enough
    assert es.update(5, {"val_loss": 0.8}) is True


def test_exactly_min_delta_is_not_an_improvement():
    es = EarlyStopping(patience=5, min_delta=0.25)
    _run(es, [1.0, 0.75])  # exactly 0.25 better (exact in binary floating point)
    assert es.best == 1.0 and es.bad_epochs == 1


def test_mode_max():
    es = EarlyStopping(metric="acc", mode="max", patience=2, min_delta=0.01)
    assert _run(es, [0.5, 0.7, 0.705, 0.69]) == [False, False, False, True]
    assert es.best == 0.7 and es.best_epoch == 2 and es.stopped_epoch == 4


def test_min_delta_zero_any_strict_improvement_counts_but_ties_do_not():
    es = EarlyStopping(patience=2, min_delta=0.0)
    assert _run(es, [1.0, 1.0, 0.999999]) == [False, False, False]
    assert es.best_epoch == 3


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, None])
def test_non_finite_values_count_as_bad_epochs(bad):
    es = EarlyStopping(patience=2)
    assert _run(es, [1.0, bad, bad]) == [False, False, True]
    assert es.best == 1.0
    es2 = EarlyStopping(patience=2)
    assert _run(es2, [bad, 1.0]) == [False, False]  # a non-finite first value is no best
    assert es2.best == 1.0 and es2.best_epoch == 2 and es2.bad_epochs == 0


def test_numpy_and_jax_scalars_are_accepted():
    import jax.numpy as jnp

    es = EarlyStopping(patience=2)
    es.update(1, {"val_loss": np.float32(1.0)})
    es.update(2, {"val_loss": jnp.asarray(0.5)})
    es.update(3, {"val_loss": np.asarray([0.25])})
    assert es.best == 0.25 and isinstance(es.best, float)


def test_other_metrics_are_ignored():
    es = EarlyStopping(metric="acc", mode="max", patience=1)
    assert es.update(1, {"acc": 0.5, "val_loss": 9.0}) is False
    assert es.update(2, {"acc": 0.6, "val_loss": 99.0}) is False


def test_stop_keeps_returning_true_and_stopped_epoch_is_the_first():
    es = EarlyStopping(patience=1, min_delta=0)
    _run(es, [1.0, 2.0, 3.0])
    assert es.stopped_epoch == 2 and es.bad_epochs == 2


def test_epochs_need_not_start_at_one_or_be_contiguous():
    es = EarlyStopping(patience=2, min_delta=0)
    assert es.update(0, {"val_loss": 1.0}) is False
    assert es.update(5, {"val_loss": 2.0}) is False
    assert es.update(9, {"val_loss": 3.0}) is True and es.stopped_epoch == 9


# -- misuse ------------------------------------------------------------------------------
def test_missing_metric_names_it_and_the_ones_given():
    es = EarlyStopping(metric="accuracy", mode="max")
    with pytest.raises(
        ConfigError,
        match=r"monitors 'accuracy'.*\['acc', 'val_loss'\].*"
        r"Did you mean 'acc'\?",
    ):
        es.update(1, {"acc": 0.5, "val_loss": 1.0})
    assert es.last_epoch is None  # a refused update changes nothing


def test_check_metric_for_setup():
    es = EarlyStopping(metric="val_los")
    es2 = EarlyStopping(metric="acc")
    es2.check_metric(["acc", "val_loss"])
    with pytest.raises(
        ConfigError,
        match=r"never produces.*\['acc', 'val_loss'\].*"
        r"Did you mean 'val_loss'\?",
    ):
        es.check_metric(["val_loss", "acc"])


def test_epochs_must_increase():
    es = EarlyStopping()
    es.update(3, {"val_loss": 1.0})
    with pytest.raises(ValueError, match=r"update\(epoch=3\) after epoch 3.*load_state_dict"):
        es.update(3, {"val_loss": 1.0})
    with pytest.raises(ValueError, match=r"after epoch 3"):
        es.update(2, {"val_loss": 1.0})


@pytest.mark.parametrize("epoch", [1.0, "1", True, None])
def test_epoch_must_be_an_int(epoch):
    with pytest.raises(TypeError, match="epoch must be an int"):
        EarlyStopping().update(epoch, {"val_loss": 1.0})


def test_metrics_must_be_a_dict():
    with pytest.raises(TypeError, match="takes a dict name -> value, got list"):
        EarlyStopping().update(1, [1.0])


def test_array_valued_metric_is_refused():
    es = EarlyStopping(metric="confusion")
    with pytest.raises(MetricsError, match=r"'confusion'.*shape \(2, 2\).*scalar"):
        es.update(1, {"confusion": np.zeros((2, 2))})
    with pytest.raises(MetricsError, match=r"'confusion'.*'high'.*not a number"):
        es.update(1, {"confusion": "high"})


# -- persistence -------------------------------------------------------------------------
def test_state_dict_is_json_safe_and_round_trips():
    es = EarlyStopping(metric="acc", mode="max", patience=3, min_delta=0.0)
    _run(es, [0.5, 0.7, 0.6])
    state = json.loads(json.dumps(es.state_dict(), allow_nan=False))
    es2 = EarlyStopping(metric="acc", mode="max", patience=3, min_delta=0.0)
    es2.load_state_dict(state)
    assert (es2.best, es2.best_epoch, es2.bad_epochs, es2.stopped_epoch, es2.last_epoch) == (
        0.7,
        2,
        1,
        None,
        3,
    )
    assert es2.state_dict() == es.state_dict()


def test_fresh_state_dict_is_json_safe():
    json.dumps(EarlyStopping().state_dict(), allow_nan=False)  # best None, not inf


def test_resume_continues_exactly_like_an_uninterrupted_run():
    values = [1.0, 0.8, 0.85, 0.9, 0.79, 0.81, 0.82, 0.83, 0.84]
    straight = EarlyStopping(patience=3, min_delta=0.005)
    want = _run(straight, values)
    for cut in range(1, len(values)):
        first = EarlyStopping(patience=3, min_delta=0.005)
        got = [first.update(e, {"val_loss": v}) for e, v in enumerate(values[:cut], start=1)]
        saved = json.dumps(first.state_dict())
        second = EarlyStopping(patience=3, min_delta=0.005)
        second.load_state_dict(json.loads(saved))
        got += [
            second.update(e, {"val_loss": v}) for e, v in enumerate(values[cut:], start=cut + 1)
        ]
        assert got == want, cut
        assert second.state_dict() == straight.state_dict()
    assert straight.stopped_epoch == 8


def test_load_state_refuses_another_metric_or_mode():
    state = EarlyStopping(metric="acc", mode="max").state_dict()
    with pytest.raises(ConfigError, match=r"monitored 'acc' \(mode 'max'\).*monitors 'val_loss'"):
        EarlyStopping().load_state_dict(state)
    with pytest.raises(ConfigError, match=r"mode 'min'"):
        EarlyStopping(metric="acc", mode="min").load_state_dict(state)


def test_load_state_may_change_patience():
    es = EarlyStopping(patience=2, min_delta=0)
    _run(es, [1.0, 2.0])
    later = EarlyStopping(patience=5, min_delta=0)
    later.load_state_dict(es.state_dict())
    assert later.patience == 5 and later.bad_epochs == 1
    assert later.update(3, {"val_loss": 2.0}) is False


def test_load_state_refuses_junk():
    with pytest.raises(TypeError, match="state_dict"):
        EarlyStopping().load_state_dict([1, 2])
    with pytest.raises(ValueError, match=r"lacks \['best'"):
        EarlyStopping().load_state_dict({"metric": "val_loss", "mode": "min"})


def test_reset_and_repr():
    es = EarlyStopping(patience=1, min_delta=0)
    _run(es, [1.0, 2.0])
    assert "bad_epochs=1" in repr(es)
    es.reset()
    assert es.best is None and es.bad_epochs == 0 and es.stopped_epoch is None
    assert es.update(1, {"val_loss": 5.0}) is False


# -- the pure step: (state, epoch, metrics) -> (new state, stop) -------------------------------
def test_the_rule_and_the_state_are_frozen_and_update_is_pure():
    rule = EarlyStopConfig(metric="acc", mode="max", patience=2, min_delta=0)
    start = EarlyStopState()
    after, stop = rule.update(start, 1, {"acc": 0.5})
    assert start == EarlyStopState()  # the state given is left as it was
    assert (after.best, after.best_epoch, after.bad_epochs, after.last_epoch) == (0.5, 1, 0, 1)
    assert stop is False
    assert rule.update(start, 1, {"acc": 0.5}) == (after, False)  # same inputs, same result
    with pytest.raises(dataclasses.FrozenInstanceError):
        after.bad_epochs = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        rule.patience = 3  # type: ignore[misc]


def test_the_pure_step_agrees_with_early_stopping_epoch_by_epoch():
    values = [1.0, 0.8, 0.85, 0.9, 0.79, 0.81, 0.82, 0.83, 0.84]
    es = EarlyStopping(patience=3, min_delta=0.005)
    state = EarlyStopState()
    for epoch, v in enumerate(values, start=1):
        state, stop = es.config.update(state, epoch, {"val_loss": v})
        assert stop == es.update(epoch, {"val_loss": v}) and state == es.state
    assert es.config.to_json(state) == es.state_dict() and state.stopped_epoch == 8


def test_the_rule_validates_like_early_stopping():
    with pytest.raises(ConfigError, match=r"patience"):
        EarlyStopConfig(patience=0)
    with pytest.raises(ConfigError, match=r"Did you mean 'max'"):
        EarlyStopConfig(mode="MAX")
    assert isinstance(EarlyStopConfig(min_delta=1).min_delta, float)


def test_members_stop_one_by_one_and_the_run_when_all_have():
    rule = EarlyStopConfig(patience=1, min_delta=0)
    states = (EarlyStopState(), EarlyStopState())
    states, stop = rule.update_members(states, 1, {"val_loss/0": 1.0, "val_loss/1": 1.0})
    states, stop = rule.update_members(states, 2, {"val_loss/0": 0.5, "val_loss/1": 2.0})
    assert [s.stopped_epoch for s in states] == [None, 2] and stop is False
    assert rule.active(states).tolist() == [True, False]
    frozen = states[1]
    states, stop = rule.update_members(states, 3, {"val_loss/0": 0.7, "val_loss/1": 0.1})
    assert states[1] == frozen  # a stopped member is left as it is
    assert stop is True and rule.advance(states, 4, {"val_loss/0": 0, "val_loss/1": 0})[1]


def test_a_run_starts_fresh_or_from_the_saved_json():
    rule = EarlyStopConfig(metric="acc", mode="max")
    assert rule.start(None, members=None) == EarlyStopState()
    assert rule.start(None, members=3) == (EarlyStopState(),) * 3
    state = EarlyStopState(best=0.9, best_epoch=2, bad_epochs=1, last_epoch=3)
    saved = json.loads(json.dumps(rule.to_json(state)))
    assert rule.start(saved, members=None) == state
    # the JSON a checkpoint holds is the one EarlyStopping.state_dict() has always written
    es = EarlyStopping(metric="acc", mode="max")
    es.load_state_dict(saved)
    assert es.state_dict() == saved
    both = json.loads(json.dumps(rule.to_json((state, EarlyStopState()))))
    assert rule.start(both, members=2) == (state, EarlyStopState())
    with pytest.raises(ConfigError, match=r"not written by a population of 3"):
        rule.start(both, members=3)


def test_check_metric_names_the_fix_and_the_missing_val_split():
    es = jn.EarlyStopping(metric="acc")
    with pytest.raises(jn.ConfigError) as e:
        es.check_metric(["train_loss"], has_val=False)
    msg = str(e.value)
    assert "never produces; it produces ['train_loss']" in msg
    assert "Pass EarlyStopping(metric=...)" in msg
    assert msg.endswith("Add a 'val' split for validation metrics.")
