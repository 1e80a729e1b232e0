"""Tests for experiment.markers: @experiment, the markers, presets and the compile view."""

import dataclasses

import numpy as np
import pytest

import jaxnitro as jn
from jaxnitro._src.experiment.markers import DRIVER_FIELDS, CompileView


@jn.experiment
class Exp:
    """An experiment touching every marker."""

    width: jn.GraphConst[int] = 128  # hidden width of the MLP
    smoothing: jn.Device[float] = 0.05
    """Label smoothing, traced."""
    max_epochs: int = 5
    name: jn.Host[str] = "run"
    depth: jn.GraphConst[int] = 2
    activation: jn.GraphConst[str] = "relu"
    lr: jn.Device[float] = 1e-3
    verbose: jn.GraphConst[bool] = False

    @classmethod
    def presets(cls):
        return {"small": {"width": 32, "depth": 1}, "large": {"width": 512, "depth": 4}}

    @property
    def double_width(self):
        return 2 * self.width

    @property
    def epochs_prop(self):
        return self.max_epochs

    def scaled(self, x):
        return x * self.smoothing + self.width

    def uses_host(self):
        return self.max_epochs + 1

    @staticmethod
    def static_helper(x):
        return x + 1

    def forward(self, x):
        return self.scaled(x)


def by_name(cls):
    return {f.name: f for f in jn.fields(cls)}


# ---------------------------------------------------------------- the dataclass


def test_experiment_is_frozen_keyword_only_dataclass():
    e = Exp(width=64)
    assert dataclasses.is_dataclass(e)
    assert e.width == 64 and e.smoothing == 0.05 and e.max_epochs == 5
    with pytest.raises(dataclasses.FrozenInstanceError):
        e.width = 3
    with pytest.raises(TypeError):
        Exp(64)  # keyword-only


def test_equal_configs_compare_and_hash_equal():
    assert Exp(width=64) == Exp(width=64)
    assert Exp(width=64) != Exp(width=65)
    assert hash(Exp(width=64)) == hash(Exp(width=64))


def test_required_field_without_default():
    @jn.experiment
    class NeedsWidth:
        width: jn.GraphConst[int]

    with pytest.raises(TypeError, match="width"):
        NeedsWidth()
    assert NeedsWidth(width=3).width == 3
    assert by_name(NeedsWidth)["width"].default is dataclasses.MISSING


def test_markers_are_reported_by_fields():
    info = by_name(Exp)
    assert info["width"].marker == "GraphConst"
    assert info["smoothing"].marker == "Device"
    assert info["max_epochs"].marker == "Host"
    assert info["name"].marker == "Host"
    assert info["width"].type is int
    assert info["smoothing"].type is float
    assert info["name"].type is str
    assert info["width"].default == 128
    assert info["smoothing"].default == 0.05
    assert [f.name for f in jn.fields(Exp)][:4] == ["width", "smoothing", "max_epochs", "name"]


def test_fields_accepts_an_instance_and_refuses_a_plain_class():
    assert jn.fields(Exp(width=3)) == jn.fields(Exp)

    class Plain:
        pass

    with pytest.raises(jn.ConfigError, match="@jn.experiment"):
        jn.fields(Plain)


def test_field_docs_from_trailing_comment_and_attribute_docstring():
    info = by_name(Exp)
    assert info["width"].doc == "hidden width of the MLP"
    assert info["smoothing"].doc == "Label smoothing, traced."
    assert info["max_epochs"].doc is None


def test_field_docs_in_a_locally_defined_class():
    @jn.experiment
    class Local:
        a: jn.GraphConst[int] = 1  # the a field
        b: float = 0.5
        """Docstring of b
        spanning two lines."""

    info = by_name(Local)
    assert info["a"].doc == "the a field"
    assert info["b"].doc == "Docstring of b\nspanning two lines."


def test_hash_inside_a_string_default_is_not_a_comment():
    @jn.experiment
    class Hashes:
        tag: str = "a#b"
        url: str = "x#y"  # where it lives
        n: int = 1

    info = by_name(Hashes)
    assert info["tag"].doc is None
    assert info["url"].doc == "where it lives"
    assert info["n"].doc is None


def test_bare_marker_needs_a_type():
    with pytest.raises(jn.ConfigError, match=r"GraphConst\[float\]"):

        @jn.experiment
        class Bare:
            x: jn.GraphConst = 1


def test_string_annotations_are_resolved():
    @jn.experiment
    class Strs:
        width: "jn.GraphConst[int]" = 3.0
        smoothing: "jn.Device[float]" = 1

    info = by_name(Strs)
    assert (info["width"].marker, info["smoothing"].marker) == ("GraphConst", "Device")
    e = Strs()
    assert e.width == 3 and type(e.width) is int
    assert type(e.smoothing) is float


# ---------------------------------------------------------------- typed conversion


def test_graphconst_int_given_integral_float_is_converted():
    e = Exp(width=3.0)
    assert e.width == 3 and type(e.width) is int


def test_int_given_non_integral_float_is_an_error():
    with pytest.raises(jn.ConfigError, match="'width'") as ei:
        Exp(width=3.5)
    assert "int" in str(ei.value)
    with pytest.raises(jn.ConfigError, match="'max_epochs'"):
        Exp(max_epochs=2.5)


def test_int_accepts_numpy_integer_scalar():
    e = Exp(width=np.int64(7))
    assert e.width == 7 and type(e.width) is int


def test_float_given_int_becomes_float():
    e = Exp(smoothing=1)
    assert e.smoothing == 1.0 and type(e.smoothing) is float
    assert type(Exp(lr=np.float32(0.5)).lr) is float


def test_bool_given_to_int_or_float_is_an_error():
    with pytest.raises(jn.ConfigError, match="'width'.*bool"):
        Exp(width=True)
    with pytest.raises(jn.ConfigError, match="'smoothing'.*bool"):
        Exp(smoothing=False)


def test_bool_given_int_is_an_error():
    with pytest.raises(jn.ConfigError, match="'verbose'"):
        Exp(verbose=1)
    assert Exp(verbose=True).verbose is True


def test_str_field_checks_its_type():
    with pytest.raises(jn.ConfigError, match="'activation'.*str"):
        Exp(activation=3)
    with pytest.raises(jn.ConfigError, match="'name'.*str"):
        Exp(name=1.0)
    assert Exp(activation="gelu").activation == "gelu"


def test_graphconst_of_other_type_is_checked():
    @jn.experiment
    class T:
        dims: jn.GraphConst[tuple] = (1, 2)

    assert T(dims=[3, 4]).dims == (3, 4)  # a list becomes a tuple
    with pytest.raises(jn.ConfigError, match="'dims'"):
        T(dims="ab")


def test_device_float_accepts_an_array():
    arr = np.float32([0.1, 0.2])
    e = Exp(smoothing=arr)
    assert e.smoothing is arr


# ---------------------------------------------------------------- definition-time refusals


@pytest.mark.parametrize("field", sorted(DRIVER_FIELDS))
def test_driver_fields_cannot_be_graphconst(field):
    ns = {"__annotations__": {field: jn.GraphConst[int]}, field: 1}
    with pytest.raises(jn.ConfigError, match=field) as ei:
        jn.experiment(type("Bad", (), ns))
    assert "GraphConst" in str(ei.value)


def test_driver_fields_as_host_or_device_are_fine():
    @jn.experiment
    class Ok:
        seed: int = 0
        max_epochs: jn.Host[int] = 3

    assert Ok().max_epochs == 3


def test_driver_field_refused_in_class_body_syntax():
    with pytest.raises(jn.ConfigError, match="max_epochs"):

        @jn.experiment
        class Bad:
            max_epochs: jn.GraphConst[int] = 5


def test_unhashable_graphconst_list_is_refused_naming_the_field():
    @jn.experiment
    class L:
        layers: jn.GraphConst[list] = dataclasses.field(default_factory=lambda: [1, 2])

    with pytest.raises(jn.ConfigError, match="'layers'") as ei:
        L()
    assert "tuple" in str(ei.value)  # the fix


def test_unhashable_graphconst_without_type_check():
    from typing import Any

    @jn.experiment
    class A:
        cfg: jn.GraphConst[Any] = None

    with pytest.raises(jn.ConfigError, match="'cfg'"):
        A(cfg={"a": 1})
    assert A(cfg=(1, "x")).cfg == (1, "x")


def test_identity_hashed_graphconst_is_refused_naming_the_field():
    class Opaque:  # hashes and compares by identity
        pass

    @jn.experiment
    class B:
        thing: jn.GraphConst[Opaque] = None

    with pytest.raises(jn.ConfigError, match="'thing'") as ei:
        B(thing=Opaque())
    assert "identity" in str(ei.value)


def test_content_hashed_graphconst_is_accepted():
    @dataclasses.dataclass(frozen=True)
    class Arch:
        width: int
        depth: int

    @jn.experiment
    class C:
        arch: jn.GraphConst[Arch] = Arch(1, 2)

    assert C(arch=Arch(3, 4)).arch == Arch(3, 4)


def test_identity_hashed_host_field_is_fine():
    class Opaque:
        pass

    @jn.experiment
    class D:
        logger: object = None

    o = Opaque()
    assert D(logger=o).logger is o


# ---------------------------------------------------------------- presets and replace


def test_from_preset_applies_the_preset():
    e = Exp.from_preset("small")
    assert (e.width, e.depth) == (32, 1)
    assert e.smoothing == 0.05  # untouched fields keep their defaults


def test_from_preset_overrides_win():
    e = Exp.from_preset("small", width=64, smoothing=0.2)
    assert (e.width, e.depth, e.smoothing) == (64, 1, 0.2)


def test_from_preset_validates_values():
    with pytest.raises(jn.ConfigError, match="'width'"):
        Exp.from_preset("small", width=1.5)


def test_unknown_preset_is_an_error_with_did_you_mean():
    with pytest.raises(jn.ConfigError, match="smal") as ei:
        Exp.from_preset("smal")
    msg = str(ei.value)
    assert "Did you mean 'small'" in msg
    assert "large" in msg  # lists the presets


def test_unknown_override_key_is_an_error_with_did_you_mean():
    with pytest.raises(jn.ConfigError, match="'widht'") as ei:
        Exp.from_preset("small", widht=3)
    assert "Did you mean 'width'" in str(ei.value)


def test_preset_table_with_unknown_key_is_an_error():
    @jn.experiment
    class P:
        width: jn.GraphConst[int] = 1

        @classmethod
        def presets(cls):
            return {"big": {"depth": 4}}

    with pytest.raises(jn.ConfigError, match="'depth'"):
        P.from_preset("big")


def test_no_presets_by_default():
    @jn.experiment
    class NoP:
        width: int = 1

    assert NoP.presets() == {}
    with pytest.raises(jn.ConfigError, match="'x'"):
        NoP.from_preset("x")


def test_dataclasses_replace_works_and_revalidates():
    e = Exp()
    r = dataclasses.replace(e, width=256.0, smoothing=1)
    assert r.width == 256 and type(r.width) is int
    assert type(r.smoothing) is float
    assert e.width == 128  # the original is untouched
    with pytest.raises(jn.ConfigError, match="'width'"):
        dataclasses.replace(e, width=2.5)


def test_replace_helper_refuses_unknown_fields():
    from jaxnitro._src.experiment.markers import replace

    assert replace(Exp(), depth=3).depth == 3
    with pytest.raises(jn.ConfigError, match="'dpeth'.*Did you mean 'depth'"):
        replace(Exp(), dpeth=3)


def test_user_post_init_runs_after_conversion():
    seen = {}

    @jn.experiment
    class U:
        width: jn.GraphConst[int] = 1

        def __post_init__(self):
            seen["width"] = self.width

    U(width=4.0)
    assert seen["width"] == 4 and type(seen["width"]) is int


def test_inherited_fields():
    @jn.experiment
    class Child(Exp):
        extra: jn.Device[float] = 1.0

    info = by_name(Child)
    assert info["width"].marker == "GraphConst" and info["extra"].marker == "Device"
    c = Child(width=2.0, extra=3)
    assert type(c.width) is int and type(c.extra) is float


# ---------------------------------------------------------------- compile view


def view(exp=None, hook="forward", **device):
    exp = exp if exp is not None else Exp()
    device = device or {"smoothing": 0.25, "lr": 0.01}
    return CompileView(exp, device, hook)


def test_view_returns_graphconst_values():
    v = view(Exp(width=64))
    assert v.width == 64
    assert v.activation == "relu"


def test_view_returns_device_values_from_the_dict():
    v = view(Exp(smoothing=0.05), smoothing="TRACER", lr=0.5)
    assert v.smoothing == "TRACER"  # not the experiment's 0.05
    assert v.lr == 0.5


def test_view_refuses_host_fields_naming_field_hook_and_fixes():
    v = view(hook="loss")
    with pytest.raises(jn.HostFieldError) as ei:
        _ = v.max_epochs
    msg = str(ei.value)
    assert "'max_epochs'" in msg
    assert "loss()" in msg
    assert "jn.GraphConst[int]" in msg and "jn.Device[int]" in msg
    with pytest.raises(jn.HostFieldError, match="'name'") as ei:
        _ = v.name
    assert "jn.GraphConst[str]" in str(ei.value) and "jn.Device[str]" in str(ei.value)


def test_host_field_error_is_an_attribute_error():
    v = view()
    with pytest.raises(AttributeError):
        _ = v.max_epochs


def test_view_binds_methods_to_the_view():
    v = view(Exp(width=10), smoothing=2.0, lr=0.0)
    assert v.scaled(3.0) == 3.0 * 2.0 + 10  # the Device value from the dict, not 0.05
    assert v.forward(1.0) == 12.0  # a hook calling a helper through self


def test_helper_reading_host_field_via_self_raises():
    v = view(hook="forward")
    with pytest.raises(jn.HostFieldError, match="'max_epochs'") as ei:
        v.uses_host()
    assert "forward()" in str(ei.value)


def test_view_binds_properties():
    v = view(Exp(width=10))
    assert v.double_width == 20
    with pytest.raises(jn.HostFieldError, match="'max_epochs'"):
        _ = v.epochs_prop


def test_view_static_and_class_methods():
    v = view()
    assert v.static_helper(1) == 2
    assert v.presets() == Exp.presets()


def test_view_is_read_only():
    v = view()
    with pytest.raises(AttributeError):
        v.width = 3


def test_view_names_the_hook_it_was_made_for():
    with pytest.raises(jn.HostFieldError, match=r"metrics\(\)"):
        _ = view(hook="metrics").max_epochs
    with pytest.raises(jn.HostFieldError, match=r"train_metrics\(\)"):
        view(hook="train_metrics").uses_host()


def test_view_is_an_instance_of_the_experiment_and_super_works():
    @jn.experiment
    class Parent:
        width: jn.GraphConst[int] = 3
        max_epochs: int = 1

        def helper(self):
            return self.width

    @jn.experiment
    class Kid(Parent):
        def helper(self):
            return super().helper() + 100

    v = CompileView(Kid(width=5), {}, "loss")
    assert isinstance(v, Kid) and isinstance(v, Parent)
    assert v.helper() == 105
    with pytest.raises(jn.HostFieldError, match="'max_epochs'"):
        _ = v.max_epochs


def test_view_without_hook_still_names_the_field():
    v = CompileView(Exp(), {"smoothing": 0.0, "lr": 0.0})
    with pytest.raises(jn.HostFieldError, match="'max_epochs'"):
        _ = v.max_epochs


def test_unknown_attribute_on_view_raises_attribute_error():
    v = view()
    with pytest.raises(AttributeError):
        _ = v.does_not_exist
