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


# -- the ops: off adds nothing, on adds the checks (issue 43) ----------------------------------------
def _op_cases():
    """(name, f, valid args, bad args) of ops with data-dependent checks, on tiny shapes (the
    checked-overhead benchmark's ops, benchmarks/checked_overhead.py, and the MoE token movement)."""
    import numpy as np

    import stellax
    from stellax.ops.paged_attention import paged_inputs

    rng = np.random.default_rng(0)
    x = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    cu = jnp.array([0, 3, 8], jnp.int32)
    q, kp, vp, tables, lengths = paged_inputs(0, lengths=[5, 20], page_size=8, kv_heads=1, q_heads=2, head_dim=16,
                                              dtype=jnp.float32)
    kc, vc = stellax.init_kv_cache(4, 4, 1, 8, dtype=jnp.float32)
    ids = jnp.array([[0, 1], [2, 1], [1, 0]], jnp.int32)
    qkv = x(1, 8, 2, 8), x(1, 8, 2, 8), x(1, 8, 2, 8)
    beta = x(1, 8, 2)
    return [
        ("dot_product_attention_varlen", lambda q, k, c: stellax.dot_product_attention_varlen(q, k, k, c, c, 5, 5),
         (x(8, 2, 8), x(8, 2, 8), cu), (x(8, 2, 8), x(8, 2, 8), cu.at[2].set(9))),
        ("ragged_dot", lambda l, r, s: stellax.ragged_dot(l, r, s), (x(8, 4), x(2, 4, 3), jnp.array([3, 5])),
         (x(8, 4), x(2, 4, 3), jnp.array([-3, 5]))),
        ("paged_attention", lambda t, l: stellax.paged_attention(q, kp, vp, t, l), (tables, lengths),
         (tables, lengths.at[0].set(99))),
        ("chunk_gated_delta_rule", lambda g, c: stellax.chunk_gated_delta_rule(*qkv, g, beta, cu_seqlens=c),
         (-jnp.ones((1, 8, 2)), cu), (jnp.ones((1, 8, 2)), cu)),
        ("update_kv_cache", lambda n, s: stellax.update_kv_cache(kc, vc, n, n, s), (x(3, 1, 8), jnp.array([1, 6, 2])),
         (x(3, 1, 8), jnp.array([1, 6, 1]))),
        ("permute", lambda x, i: stellax.permute(x, i, 3), (x(3, 4), ids), (x(3, 4), ids.at[0, 0].set(7))),
        ("unpermute", lambda y, p: stellax.unpermute(y, p, jnp.ones((3, 2))), (x(6, 4), jnp.arange(6)),
         (x(6, 4), jnp.arange(6).at[0].set(9))),
    ]


_OP_IDS = ["varlen", "ragged_dot", "paged", "gdn", "update_kv_cache", "permute", "unpermute"]


@pytest.mark.parametrize("case", range(len(_OP_IDS)), ids=lambda i: _OP_IDS[i])
def test_ops_off_add_nothing_and_on_add_their_checks(case, monkeypatch):
    """With checks off an op's program has no check and is the same whichever way checks are off
    (unset, ``STELLAX_CHECKS=0``, ``checked(False)``), and ``checkify`` reports nothing even on bad
    data (there is nothing in the program to report); with checks on the same bad data is reported
    and valid data is not."""
    monkeypatch.delenv(runtime_checks.ENV, raising=False)
    name, f, good, bad = _op_cases()[case]
    off = str(jax.make_jaxpr(f)(*good))
    assert "check" not in off and "assert" not in off, name
    monkeypatch.setenv(runtime_checks.ENV, "0")
    assert str(jax.make_jaxpr(f)(*good)) == off
    monkeypatch.delenv(runtime_checks.ENV)
    with checked(False):
        assert str(jax.make_jaxpr(f)(*good)) == off
    err, _ = checkify.checkify(jax.jit(lambda *a: f(*a)))(*bad)
    assert err.get() is None, f"{name}: a check with checks off: {err.get()}"
    with checked():
        err, _ = checkify.checkify(jax.jit(lambda *a: f(*a)))(*bad)
        assert err.get() is not None, f"{name}: bad data not reported with checks on"
        err, _ = checkify.checkify(jax.jit(lambda *a: f(*a)))(*good)
        assert err.get() is None, f"{name}: valid data reported: {err.get()}"
