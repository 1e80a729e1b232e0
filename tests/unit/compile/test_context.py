"""What a trace reads besides code and inputs: JAX's flags and the environment, and the cheap
check that both are still as a program was traced (`context.unchanged`)."""

from __future__ import annotations

import jax

from jaxnitro._src.compile import context


def test_unchanged_sees_a_variable_and_a_flag_change_and_their_return(monkeypatch):
    monkeypatch.delenv("JN_TEST_CONTEXT", raising=False)
    flags, env = context.jax_flags(), context.environment()
    same = context.unchanged(flags, env)
    assert same()
    monkeypatch.setenv("JN_TEST_CONTEXT", "1")
    assert not same() and context.environment() != env
    monkeypatch.delenv("JN_TEST_CONTEXT")
    assert same()
    with jax.numpy_rank_promotion("raise"):
        assert not same() and context.jax_flags() != flags
    assert same()


def test_unchanged_for_values_not_current_compares_the_digests(monkeypatch):
    flags, env = context.jax_flags(), context.environment()
    monkeypatch.setenv("JN_TEST_CONTEXT", "2")
    same = context.unchanged(flags, env)  # built while the environment differs
    assert not same()
    monkeypatch.delenv("JN_TEST_CONTEXT")
    assert same()
