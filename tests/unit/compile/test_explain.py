"""Cache-miss explanations: one test per kind of change, on hand-built key parts."""

from __future__ import annotations

import dataclasses

from jaxnitro._src.compile.explain import KeyParts, closest, hook_parts, reasons

BASE = KeyParts(
    kind="train",
    experiment="MnistMLP",
    graph_consts=(("width", 128), ("act", "relu")),
    model=("mlp", 128),
    optimizer=("radam",),
    hooks=(("forward", "f0"), ("loss", "l0")),
    helpers=(("loss/penalty", "p0"), ("loss/global:SCALE", "s0")),
    inputs=(
        ("batch['img']", (32, 784), "float32", False),
        ("batch['label']", (32,), "int32", False),
        ("extras['device']['smoothing']", (), "float32", False),
    ),
    split="train",
    options=(("accum", 1), ("steps_per_call", 1), ("precision", None)),
)


def change(**kw):
    return dataclasses.replace(BASE, **kw)


def test_graph_const_change_names_field_and_values():
    new = change(graph_consts=(("width", 256), ("act", "relu")), model=("mlp", 256))
    got = reasons(BASE, new)
    assert got[0] == "GraphConst `width` changed 128 → 256"
    assert "the model structure changed (layers, widths or static fields)" in got
    assert len(got) == 2


def test_edited_hook():
    assert reasons(BASE, change(hooks=(("forward", "f0"), ("loss", "l1")))) == [
        "hook `loss` was edited"
    ]


def test_edited_helper_is_named_not_the_hook():
    new = change(helpers=(("loss/penalty", "p1"), ("loss/global:SCALE", "s0")))
    assert reasons(BASE, new) == ["helper `penalty` (reached from hook `loss`) was edited"]


def test_edited_hook_and_helper_are_both_named():
    new = change(
        hooks=(("forward", "f0"), ("loss", "l1")),
        helpers=(("loss/penalty", "p1"), ("loss/global:SCALE", "s0")),
    )
    assert reasons(BASE, new) == [
        "hook `loss` was edited",
        "helper `penalty` (reached from hook `loss`) was edited",
    ]


def test_changed_module_level_value():
    new = change(helpers=(("loss/penalty", "p0"), ("loss/global:SCALE", "s1")))
    assert reasons(BASE, new) == ["module-level value `SCALE` (reached from hook `loss`) changed"]


def test_partial_batch_suggests_drop_last():
    new = change(
        inputs=(
            ("batch['img']", (17, 784), "float32", False),
            ("batch['label']", (17,), "int32", False),
            BASE.inputs[2],
        )
    )
    assert reasons(BASE, new) == [
        "batch shape (32, 784) → (17, 784) for `img` (and `label`) on split 'train': "
        "a partial batch? use drop_last=True"
    ]


def test_other_shape_change_has_no_drop_last_hint():
    new = change(inputs=(("batch['img']", (32, 28, 28), "float32", False), *BASE.inputs[1:]))
    got = reasons(BASE, new)
    assert got == ["shape of `img` changed (32, 784) → (32, 28, 28)"]
    bigger = change(inputs=(("batch['img']", (64, 784), "float32", False), *BASE.inputs[1:]))
    assert "drop_last" not in " ".join(reasons(BASE, bigger))


def test_weak_type_names_the_python_scalar():
    new = change(inputs=(*BASE.inputs[:2], ("extras['device']['smoothing']", (), "float32", True)))
    assert reasons(BASE, new) == [
        "`smoothing` arrived as a weakly typed value (a Python float?): pass "
        "jnp.float32(...) or declare it jn.Device[float]"
    ]


def test_dtype_change():
    new = change(inputs=(("batch['img']", (32, 784), "uint8", False), *BASE.inputs[1:]))
    assert reasons(BASE, new) == ["dtype of `img` changed float32 → uint8"]


def test_optimizer_and_option_changes():
    new = change(
        optimizer=("adamw",), options=(("accum", 4), ("steps_per_call", 1), ("precision", "bf16"))
    )
    got = reasons(BASE, new)
    assert "accum 1 → 4" in got and "precision None → 'bf16'" in got
    assert any(r.startswith("the optimizer changed") for r in got)
    assert got.index("accum 1 → 4") < len(got) - 1  # options before the broad optimizer line


def test_nothing_named_differs_means_sharding_or_mesh():
    assert reasons(BASE, BASE) == ["an input sharding or the mesh changed"]


def test_closest_prefers_same_kind_then_fewest_differences():
    eval_same = change(kind="eval")
    train_far = change(graph_consts=(("width", 64), ("act", "gelu")), model=("mlp", 64))
    train_near = change(graph_consts=(("width", 64), ("act", "relu")), model=("mlp", 64))
    new = change(graph_consts=(("width", 256), ("act", "relu")), model=("mlp", 256))
    assert closest(new, [eval_same, train_far, train_near]) is train_near
    assert closest(new, [eval_same]) is eval_same
    assert closest(new, []) is None


SCALE = 2.0


def penalty(x):
    return SCALE * x


class Exp:
    def loss(self, y):
        return penalty(y)


def test_hook_parts_separates_the_hook_from_what_it_reaches():
    hooks, helpers = hook_parts({"loss": Exp().loss})
    assert [name for name, _ in hooks] == ["loss"]
    names = dict(helpers)
    assert "loss/penalty" in names and "loss/global:SCALE" in names
    assert not any(key.endswith("Exp.loss") for key in names)  # the hook is not its own helper


def test_optimizer_and_model_function_changes_are_said_by_name():
    """The sentences themselves (the end-to-end tests check that a reason is given): a param
    group added, a hyperparameter's old and new values, a function the model gains, drops or
    whose code was edited, a model class it gains or drops."""
    from jaxnitro._src.compile import explain as ex

    old = ((("param groups", ("body",)), ("gradient_clip_norm", 1.0)), "optax digest a")
    new = ((("param groups", ("body", "head")), ("gradient_clip_norm", 2.0)), "optax digest b")
    assert ex._optimizer_reasons(old, new) == [
        "param group `head` added",
        "gradient_clip_norm 1.0 → 2.0",
    ]
    assert ex._optimizer_reasons(new, old) == [
        "param group `head` removed",
        "gradient_clip_norm 2.0 → 1.0",
    ]
    assert ex._root_sentence("model-fn:act", ex._MISSING, "d") == (
        "the model now holds function `act`"
    )
    assert ex._root_sentence("model-fn:act", "d", ex._MISSING) == (
        "the model no longer holds function `act`"
    )
    assert ex._root_sentence("model-fn:act", "d1", "d2") == (
        "the model's code changed: function `act` (held by the model) was edited"
    )
    assert ex._root_sentence("model:MLP", ex._MISSING, "d") == "the model now uses class `MLP`"
    assert ex._root_sentence("model:MLP", "d", ex._MISSING) == (
        "the model no longer uses class `MLP`"
    )
