"""Checked mode (`core.runtime_checks`): off adds nothing to the program, on raises eagerly and under
`checkify`, blocks nest, and a bad `STELLAX_CHECKS` is an error naming it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import checkify

from stellax.core import runtime_checks
from stellax.core.runtime_checks import checked, checks_enabled, require


def _positive_double(x):
    require(lambda: jnp.all(x > 0), "x: expected every value > 0, got {smallest}", smallest=lambda: jnp.min(x))
    return 2 * x


def test_off_the_program_is_unchanged(monkeypatch):
    monkeypatch.delenv(runtime_checks.ENV, raising=False)
    x = jnp.arange(1.0, 4.0)
    assert not checks_enabled()
    assert str(jax.make_jaxpr(_positive_double)(x)) == str(jax.make_jaxpr(lambda x: 2 * x)(x))
    assert jnp.array_equal(jax.jit(_positive_double)(-x), -2 * x)  # no check: no error


def test_on_an_eager_call_raises_naming_the_argument_and_value():
    with checked():
        assert checks_enabled()
        assert jnp.array_equal(_positive_double(jnp.ones(2)), jnp.full(2, 2.0))
        with pytest.raises(Exception, match=r"x: expected every value > 0, got -3.0"):
            _positive_double(jnp.array([1.0, -3.0]))


def test_on_under_jit_checkify_reports_the_failure():
    with checked():
        err, out = checkify.checkify(jax.jit(_positive_double))(jnp.array([-1.0, 2.0]))
        assert "got -1.0" in err.get()
        err, _ = checkify.checkify(jax.jit(_positive_double))(jnp.array([1.0, 2.0]))
        assert err.get() is None


def test_blocks_nest_and_restore():
    assert not checks_enabled()
    with checked():
        with checked(False):
            assert not checks_enabled()
            with checked():
                assert checks_enabled()
            assert not checks_enabled()
        assert checks_enabled()
    assert not checks_enabled()
    with pytest.raises(TypeError, match="enabled: expected a bool, got str"):
        with checked("yes"):
            pass


def test_the_environment_switch(monkeypatch):
    monkeypatch.setenv(runtime_checks.ENV, "1")
    assert checks_enabled()
    with checked(False):
        assert not checks_enabled()
    monkeypatch.setenv(runtime_checks.ENV, "off")
    assert not checks_enabled()
    monkeypatch.setenv(runtime_checks.ENV, "sometimes")
    with pytest.raises(ValueError, match=r"STELLAX_CHECKS: expected one of .* got 'sometimes'"):
        checks_enabled()


def test_a_jitted_function_is_traced_again_when_checks_turn_on():
    jitted = jax.jit(_positive_double)
    bad = jnp.array([-1.0, 2.0])
    assert jnp.array_equal(jitted(bad), 2 * bad)  # traced with checks off: no check in its program
    with checked():
        err, _ = checkify.checkify(jitted)(bad)
        assert "got -1.0" in err.get()
    assert jnp.array_equal(jitted(bad), 2 * bad)  # off again: the unchecked program
