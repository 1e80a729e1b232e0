"""A dict's version (`dict_version`): one read telling a hot guard that nothing in a dict
changed, and the guards built on it (`remembered.check_of`, `context.unchanged`), which must
see every edit they saw without it, including a change made and undone."""

from __future__ import annotations

import os

import pytest

from jaxnitro._src.compile import context, dict_version
from jaxnitro._src.compile.remembered import check_of, remembered

HAS_TAGS = dict_version.tag({}) is not None


@pytest.fixture(params=["versions", "lookups"])
def mode(request, monkeypatch):
    if request.param == "versions" and not HAS_TAGS:
        pytest.skip("this interpreter's dicts have no version that can be read")
    if request.param == "lookups":
        monkeypatch.setattr(dict_version, "_works", [False])
        assert dict_version.tag({}) is None
    return request.param


@pytest.mark.skipif(not HAS_TAGS, reason="no readable dict version here")
def test_every_kind_of_change_moves_the_version_and_reading_does_not():
    d: dict = {"a": 1}
    version = dict_version.tag(d)
    assert version is not None
    seen = {version.value}
    for change in (
        lambda: d.__setitem__("b", 2),
        lambda: d.__setitem__("b", 3),
        lambda: d.pop("b"),
        lambda: d.update(c=1),
        lambda: d.__delitem__("c"),
        lambda: d.setdefault("e", 0),
        lambda: d.clear(),
    ):
        before = version.value
        assert version.value == before and d.get("zz") is None and version.value == before
        change()
        assert version.value not in seen  # never a number seen before
        seen.add(version.value)

    class Net:
        scale = 1.0

    version = dict_version.tag(Net.__dict__)  # a class namespace: its dict
    assert version is not None
    before = version.value
    Net.scale = 2.0
    assert version.value != before
    before = version.value
    del Net.scale
    assert version.value != before
    environ = dict_version.tag(os.environ._data)
    assert environ is not None


def test_only_plain_dicts_and_class_namespaces_have_one():
    class Sub(dict):
        pass

    assert dict_version.underlying(Sub()) is None  # its methods may change it unseen
    assert dict_version.underlying([]) is None
    assert dict_version.tag(Sub()) is None
    assert dict_version.underlying(type("C", (), {}).__dict__) is not None


def _module(source: str) -> dict:
    ns: dict = {"__name__": "jn_test_dict_version_module"}
    exec(compile(source, "<jn test module>", "exec"), ns)  # noqa: S102
    return ns


def test_a_check_sees_a_global_rebound_after_unrelated_changes(mode):
    ns = _module("import math\nK = 2.0\ndef f(x):\n    return x * K + math.pi\n")
    f = ns["f"]
    remembered(f)
    check = check_of([f])
    assert check is not None and check()
    ns["unrelated"] = 1  # the module's dict changed, nothing f reads did
    assert check() and check()
    value = ns["K"]
    ns["K"] = 3.0
    assert not check()
    ns["K"] = value  # set back: holds again
    assert check()
    del ns["K"]
    assert not check()  # (a lookup that raises goes to the plain checks)
    ns["K"] = value
    assert check()


def test_a_check_sees_a_class_namespace_grow_or_a_method_replaced(mode):
    class Net:
        scale = 2.0

        def __call__(self, x):
            return x * self.scale

    remembered(Net)
    check = check_of([Net])
    assert check is not None and check()
    Net.scale = 3.0
    assert not check()
    Net.scale = 2.0
    remembered(Net)
    check = check_of([Net])
    assert check is not None and check()
    Net.extra = 1  # read whole: a new name changes its digest
    assert not check()
    del Net.extra
    assert check()
    call = Net.__call__
    Net.__call__ = lambda self, x: x
    assert not check()
    Net.__call__ = call
    assert check()


def test_the_environment_check_sees_a_variable_set_changed_and_removed(mode, monkeypatch):
    monkeypatch.delenv("JN_TEST_DICT_VERSION", raising=False)
    same = context.unchanged(context.jax_flags(), context.environment())
    assert same()
    monkeypatch.setenv("JN_TEST_DICT_VERSION", "1")
    assert not same() and not same()
    monkeypatch.delenv("JN_TEST_DICT_VERSION")
    assert same() and same()  # set and removed: the same environment
    home = os.environ.get("HOME")
    monkeypatch.setenv("HOME", "/elsewhere")
    assert not same()
    if home is None:
        monkeypatch.delenv("HOME")
    else:
        monkeypatch.setenv("HOME", home)  # the same value, a new object
    assert same()


def test_a_rename_alone_keeps_the_check_and_moves_the_digest(mode):
    # What a trace runs is the function's code, defaults and what its globals hold; the names
    # it goes by change its digest (the keyed path sees them), not the program.
    ns = _module("K = 2.0\ndef f(x):\n    return x * K\ndef g(x):\n    return x + K\n")
    f = ns["f"]
    digest = remembered(f)
    check = check_of([f])
    assert check is not None
    f.__qualname__ = "renamed"
    f.__module__ = "elsewhere"
    assert check() and remembered(f) != digest
    remembered(f)
    check = check_of([f])
    assert check is not None and check()
    f.__code__ = ns["g"].__code__  # what autoreload does to an edited function
    assert not check()
