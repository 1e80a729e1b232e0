"""compile/ code the fast tests did not reach or did not check: the depth contract of class
attributes, qualified closure names, the notebook table, a constant's bytes, the private
cache entries, the stats file's trim, the dtype reasons of a miss, and the memory plan's
fallbacks. (Found by the sampled mutation run of compile/: tests/README.md, "Scores".)"""

from __future__ import annotations

import os
import stat
import sys
import types

import pytest

from jaxnitro._src.compile import cache_guard, explain, memory, persistent, report
from jaxnitro._src.compile.fingerprint import describe_reach, fingerprint


def _helper_returning(value):
    def helper(x):
        return x * value

    helper.__qualname__ = "helper"  # the same name as an edited definition would have
    return helper


class Ops:
    table = (_helper_returning(2),)

    @property
    def doubled(self):
        return helper(3)


helper = _helper_returning(2)


def reads_a_class_value(x):
    return Ops.table[0](x)


def reads_a_property(x):
    return Ops.doubled + x


class _Opaque:
    """A value without a content digest (hashed by identity)."""


OPAQUE = _Opaque()


class Mixed:
    table = (_helper_returning(2), OPAQUE)


def reads_a_mixed_class_value(x):
    return Mixed.table[0](x)


@pytest.mark.parametrize(
    "owner,reader",
    [(Ops, reads_a_class_value), (Mixed, reads_a_mixed_class_value)],
    ids=["by-content", "with-an-identity-part"],
)
def test_a_function_inside_a_class_value_is_hashed_one_level_down(monkeypatch, owner, reader):
    before = fingerprint(reader, depth=1)
    edited = (_helper_returning(5), *owner.table[1:])  # the helper's code edited
    monkeypatch.setattr(owner, "table", edited)
    assert fingerprint(reader, depth=1) != before


def test_a_property_getter_is_hashed_one_level_down_its_helpers_below_that(monkeypatch):
    """depth=1: the getter's code is hashed (depth 0); what it calls is below zero, so by
    name only (the documented limit); depth=2 sees the helper's code."""
    shallow, deep = fingerprint(reads_a_property, depth=1), fingerprint(reads_a_property, depth=2)
    monkeypatch.setattr(sys.modules[__name__], "helper", _helper_returning(5))
    assert fingerprint(reads_a_property, depth=1) == shallow
    assert fingerprint(reads_a_property, depth=2) != deep


def _scale(k):
    def inner(x):
        return x * k

    return inner


def _shift(k):
    def other(x):
        return x + k

    return other


SCALE, SHIFT = _scale(2.0), _shift(3.0)


def uses_two_closures_named_alike(x):
    return SCALE(x) + SHIFT(x)


def test_a_closure_name_two_functions_share_is_qualified_with_the_function():
    keys = set(describe_reach(uses_two_closures_named_alike))
    qualified = {"closure:_scale.<locals>.inner.k", "closure:_shift.<locals>.other.k"}
    assert "closure:k" in keys and len(keys & qualified) == 1


def test_the_notebook_table_carries_the_flags_under_it():
    flag = types.SimpleNamespace(message="program 'train' took 40 s to compile")
    record = types.SimpleNamespace(flags=[flag])
    shown = report.CompileReport([record])
    header = ("program",)
    rows = [("train",)]
    table = "<table>x</table>"
    html = shown._repr_html_.__func__  # the method, with its helpers replaced below
    real_rows, real_table = report._table_rows, report.html_table
    try:
        report._table_rows = lambda records: (header, rows)
        report.html_table = lambda h, r, caption: table if (h, r) == (header, rows) else ""
        assert html(shown) == table + "<p>! program 'train' took 40 s to compile</p>"
    finally:
        report._table_rows, report.html_table = real_rows, real_table


@pytest.mark.parametrize("pad", range(4))  # the literal at each offset modulo 4
def test_a_constant_counts_its_stored_bytes_a_splat_none(pad):
    lead = " " * pad + "%c = stablehlo.constant "
    full = lead + 'dense<"0x0000803F00000040"> : tensor<2xf32>'  # 8 bytes stored
    splat = lead + 'dense<"0x01"> : tensor<2xi8>'  # one element's byte for two
    splat4 = lead + 'dense<"0x0000803F"> : tensor<2xf32>'
    listed = lead + "dense<[1.0, 2.0, 3.0]> : tensor<3xf32>"
    zero = lead + "dense<0.0> : tensor<1024x1024xf32>"
    assert report._constant_bytes(full) == 8
    assert report._constant_bytes(listed) == 12
    assert report._constant_bytes("\n".join([splat, splat4, zero])) == 0
    assert report._constant_bytes("\n".join([full, splat, listed, zero])) == 20


def test_making_a_cache_entry_private_never_follows_a_link(tmp_path):
    target = tmp_path / "elsewhere"
    target.write_text("a file of the user's")
    target.chmod(0o644)
    entries = tmp_path / "xla"
    entries.mkdir()
    (entries / "entry").symlink_to(target)
    (entries / "own").write_text("an entry")
    (entries / "own").chmod(0o644)
    fd = os.open(entries, os.O_RDONLY)
    try:
        cache_guard._make_private(fd, "entry")
        cache_guard._make_private(fd, "own")
    finally:
        os.close(fd)
    assert stat.S_IMODE(target.stat().st_mode) == 0o644  # the link's target untouched
    assert stat.S_IMODE((entries / "own").stat().st_mode) == 0o600


def test_the_stats_file_keeps_its_newest_half_when_it_grows_too_long(tmp_path, monkeypatch):
    path = tmp_path / persistent.STATS_FILE
    old = [f'{{"time": {i}, "loaded": 1, "compiled": 0}}' for i in range(300)]
    path.write_text("\n".join(old) + "\n")
    path.chmod(0o600)
    monkeypatch.setattr(persistent, "_STATS_MAX_LINES", 60)  # 200 bytes a line: 12,000
    monkeypatch.setattr(persistent, "_start", {"persistent_hits": 0, "misses": 0})
    monkeypatch.setattr(
        persistent.cache, "cache_stats", lambda: {"persistent_hits": 2, "misses": 3}
    )
    tmp_path.chmod(0o700)
    persistent.record_process(str(tmp_path))
    rows = path.read_text().splitlines()
    assert len(rows) == 30 and rows[-1].endswith('"loaded": 2, "compiled": 1}')
    assert rows[0] == old[-29] and path.read_text().endswith("\n")


def _key(leaves, inputs=()):
    return types.SimpleNamespace(avals=("tree", leaves), inputs=list(inputs))


def test_a_dtype_change_is_said_only_of_arrays_whose_shape_stayed():
    old = _key([((2,), "float32", False, "s"), ((3,), "float32", False, "s")])
    new = _key([((2,), "bfloat16", False, "s"), ((4,), "bfloat16", False, "s")])
    assert explain._state_reasons(old, new) == [
        "dtype of 1 parameter or state array changed float32 → bfloat16"
    ]


def test_a_program_without_a_memory_analysis_counts_its_inputs():
    (got,) = memory._program_memories({"train": object()}, 1234)
    assert got == memory.ProgramMemory("train", 1234, 0, 0, 0, 0, 1234)


def test_the_fsdp_suggestion_on_one_device_names_params_and_optimizer_state():
    plan = types.SimpleNamespace(params_bytes=3 << 20, opt_state_bytes=6 << 20)
    said = memory._fsdp_suggestion(plan, n_devices=1)
    assert f"({memory.format_bytes(9 << 20)} now)" in said


def test_two_model_structures_print_alike_only_when_their_text_is_the_same():
    digest_a, digest_b = "a" * 64, "b" * 64

    def model(text):
        return types.SimpleNamespace(model=text)

    same = (
        "Net(Dense(4), fn=" + digest_a + " at 0x7f01)",
        "Net(Dense(4), fn=" + digest_b + " at 0x7e22)",
    )
    assert explain._same_shape(model(same[0]), model(same[1]))  # digests and addresses aside
    assert not explain._same_shape(model("Net(Dense(4))"), model("Net(Dense(8))"))
    assert not explain._same_shape(model("Net(Dense(8))"), model("Net(Dense(4))"))  # either way


def test_an_uncommitted_array_is_keyed_as_the_numpy_it_stands_for():
    # Both lower to the same program text; a committed or weakly typed array does not.
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxnitro._src.compile import cache

    host = np.arange(3, dtype=np.float32)
    f = jax.jit(lambda x: x * 2)
    assert f.lower(host).as_text() == f.lower(jnp.asarray(host)).as_text()
    assert cache._aval(jnp.asarray(host)) == cache._aval(host)
    committed = jax.device_put(host, jax.devices()[0])
    assert committed.committed and cache._aval(committed) != cache._aval(host)
    weak = jnp.asarray(2.0)
    assert cache._aval(weak) != cache._aval(np.float32(2.0))
    assert cache._aval(jnp.asarray(host[:2])) != cache._aval(host)
