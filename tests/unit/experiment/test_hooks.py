"""Tests for experiment.hooks: hook discovery, signature checks and keyword routing."""

import dataclasses

import pytest

import jaxnitro as jn
from jaxnitro._src.experiment.hooks import Route, check_batch, check_hooks, device_fields


class Base:
    """All required hooks, with batch fields `img` and `label`."""

    def build_model(self, rng):
        return None

    def build_data(self, dist):
        return {}

    def forward(self, model, params, state, *, img):
        return img

    def loss(self, logits, *, label):
        return logits


def make(**methods):
    return type("Exp", (Base,), methods)


# ---------------------------------------------------------------- required hooks


def test_complete_experiment_passes():
    routes = check_hooks(Base)
    assert set(routes) == {"forward", "loss"}


@pytest.mark.parametrize(
    "hook, signature",
    [
        ("build_model", "build_model(self, rng)"),
        ("build_data", "build_data(self, dist)"),
        ("forward", "forward(self, model, params, state, *, <batch fields>)"),
        ("loss", "loss(self, outputs, *, <batch fields>)"),
    ],
)
def test_missing_required_hook_is_listed_with_signature(hook, signature):
    ns = {k: v for k, v in vars(Base).items() if not k.startswith("__")}
    del ns[hook]
    cls = type("NoHook", (), ns)
    with pytest.raises(jn.HookError) as ei:
        check_hooks(cls)
    msg = str(ei.value)
    assert signature in msg
    assert "NoHook" in msg
    for other in {"build_model", "build_data", "forward", "loss"} - {hook}:
        assert f"{other}(self" not in msg  # only the missing one is listed


def test_several_missing_hooks_are_all_listed():
    class OnlyModel:
        def build_model(self, rng):
            return None

    with pytest.raises(jn.HookError) as ei:
        check_hooks(OnlyModel)
    msg = str(ei.value)
    assert "build_data(self, dist)" in msg and "forward(self" in msg and "loss(self" in msg


def test_misspelled_required_hook_gets_did_you_mean():
    ns = {k: v for k, v in vars(Base).items() if not k.startswith("__")}
    ns["forwrd"] = ns.pop("forward")
    with pytest.raises(jn.HookError) as ei:
        check_hooks(type("Typo", (), ns))
    msg = str(ei.value)
    assert "forward(self, model, params, state" in msg
    assert "Did you mean 'forwrd'" in msg


@pytest.mark.parametrize(
    "typo, hook",
    [
        ("metric", "metrics"),
        ("train_metric", "train_metrics"),
        ("optimiser", "optimizer"),
        ("schedule", "schedules"),
        ("learning_rates", "learning_rate"),
    ],
)
def test_misspelled_optional_hook_gets_did_you_mean(typo, hook):
    cls = make(**{typo: lambda self, logits, *, label: {}})
    with pytest.raises(jn.HookError) as ei:
        check_hooks(cls)
    msg = str(ei.value)
    assert f"Exp.{typo}" in msg
    assert f"Did you mean {hook!r}" in msg
    assert "'_'" in msg  # the fix for a genuine helper


def test_helpers_are_not_taken_for_typos():
    cls = make(_metric=lambda self: 0, compute_stats=lambda self: 0, encode=lambda self: 0)
    assert set(check_hooks(cls)) == {"forward", "loss"}


# ---------------------------------------------------------------- signatures


@pytest.mark.parametrize(
    "forward",
    [
        lambda self, model, params, *, img: img,  # too few
        lambda self, model, params, state, img: img,  # batch field given positionally
        lambda self, model, *, img: img,
    ],
)
def test_forward_with_wrong_positional_params(forward):
    with pytest.raises(jn.HookError) as ei:
        check_hooks(make(forward=forward))
    msg = str(ei.value)
    assert "Exp.forward" in msg
    assert "forward(self, model, params, state, *, <batch fields>)" in msg
    assert "'*'" in msg


def test_loss_with_wrong_positional_params():
    with pytest.raises(jn.HookError, match=r"loss\(self, outputs"):
        check_hooks(make(loss=lambda self, *, label: 0))
    with pytest.raises(jn.HookError, match=r"Exp\.loss"):
        check_hooks(make(loss=lambda self, logits, label: 0))


def test_metrics_signature_is_checked():
    with pytest.raises(jn.HookError, match=r"metrics\(self, outputs"):
        check_hooks(make(metrics=lambda self, *, label: {}))


def test_varargs_forward_is_accepted():
    routes = check_hooks(make(forward=lambda self, *args, img: img))
    assert routes["forward"].required == ("img",)


# ---------------------------------------------------------------- routes


def test_keyword_only_params_route_required_and_optional_fields():
    def loss(self, logits, *, label, weight=None, mask=None):
        return 0

    r = check_hooks(make(loss=loss))["loss"]
    assert r.required == ("label",)
    assert r.optional == ("weight", "mask")
    assert not r.takes_all
    batch = {"img": 1, "label": 2, "weight": 3, "extra": 4}
    assert r.select(batch) == {"label": 2, "weight": 3}


def test_var_keyword_takes_all():
    def metrics(self, logits, **batch):
        return {}

    r = check_hooks(make(metrics=metrics))["metrics"]
    assert r.takes_all and r.required == () and r.optional == ()
    batch = {"img": 1, "label": 2, "extra": 3}
    assert r.select(batch) == batch


def test_var_keyword_with_named_fields():
    def loss(self, logits, *, label, **rest):
        return 0

    r = check_hooks(make(loss=loss))["loss"]
    assert r.takes_all and r.required == ("label",)


def test_positional_params_with_defaults_past_the_count_are_fields():
    def loss(self, logits, label=None):
        return 0

    r = check_hooks(make(loss=loss))["loss"]
    assert r.optional == ("label",)


def test_routes_only_for_traced_hooks_that_exist():
    def train_metrics(self, logits, *, label):
        return {}

    routes = check_hooks(make(train_metrics=train_metrics))
    assert set(routes) == {"forward", "loss", "train_metrics"}
    assert routes["forward"].required == ("img",)


def test_routes_work_on_a_jn_experiment():
    @jn.experiment
    class E(Base):
        width: jn.GraphConst[int] = 4

    routes = check_hooks(E)
    assert routes["forward"].required == ("img",)
    assert routes["loss"].required == ("label",)


# ---------------------------------------------------------------- check_batch


def test_check_batch_accepts_a_complete_batch():
    routes = check_hooks(Base)
    check_batch(routes, {"img", "label", "extra"}, "train")


def test_check_batch_names_hook_field_batch_fields_and_did_you_mean():
    routes = check_hooks(Base)
    with pytest.raises(jn.RoutingError) as ei:
        check_batch(routes, {"img", "labels"}, "val")
    msg = str(ei.value)
    assert "loss()" in msg
    assert "'label'" in msg
    assert "['img', 'labels']" in msg
    assert "'val'" in msg
    assert "Did you mean 'labels'" in msg


def test_routing_error_message_is_not_quoted_like_a_key_error():
    routes = check_hooks(Base)
    with pytest.raises(jn.RoutingError) as ei:
        check_batch(routes, {"img"}, "train")
    assert str(ei.value).startswith("loss()")
    assert isinstance(ei.value, KeyError)


def test_check_batch_optional_fields_may_be_absent():
    def loss(self, logits, *, label, weight=None):
        return 0

    check_batch(check_hooks(make(loss=loss)), {"img", "label"}, "train")


def test_check_batch_restricted_to_some_hooks():
    routes = check_hooks(Base)
    check_batch(routes, {"img"}, "test", hooks={"forward"})  # loss not run on this split
    with pytest.raises(jn.RoutingError, match=r"forward\(\)"):
        check_batch(routes, {"label"}, "test", hooks={"forward"})


# ---------------------------------------------------------------- device_fields


def test_device_fields_are_only_those_some_hook_names():
    routes = check_hooks(Base)
    assert device_fields(routes, {"img", "label", "filename_id"}) == ("img", "label")


def test_device_fields_include_present_optional_fields():
    def loss(self, logits, *, label, weight=None, mask=None):
        return 0

    routes = check_hooks(make(loss=loss))
    assert device_fields(routes, {"img", "label", "weight", "junk"}) == ("img", "label", "weight")


def test_device_fields_take_all_with_var_keyword():
    def metrics(self, logits, **batch):
        return {}

    routes = check_hooks(make(metrics=metrics))
    assert device_fields(routes, {"img", "label", "junk"}) == ("img", "junk", "label")
    # restricted to hooks that do not take all, junk stays on the host
    assert device_fields(routes, {"img", "label", "junk"}, hooks={"forward", "loss"}) == (
        "img",
        "label",
    )


def test_route_is_a_frozen_value():
    r = Route("loss", ("label",), (), False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.hook = "x"
