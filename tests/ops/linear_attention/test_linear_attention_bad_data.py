"""Bad data under jit (issue 43, `linear_attention.bad_data`): a positive (or NaN) log decay ``g``
makes exactly its (sequence, value head) NaN — outputs, final state and gradients — in every
implementation, the recurrent forms and the golden; invalid ``cu_seqlens`` make every output NaN.
In checked mode both are checks naming the argument; off, the program has no check. Valid data is
unchanged bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import stellax
from stellax.ops.linear_attention import api
from stellax.ops.linear_attention.reference import delta_rule_recurrence, l2norm

B, T, H, D = 2, 10, 2, 8
CHUNKED = (stellax.chunk_gated_delta_rule, stellax.chunk_kda)
ALL = (stellax.chunk_gated_delta_rule, stellax.fused_recurrent_gated_delta_rule, stellax.chunk_kda,
       stellax.fused_recurrent_kda)


def _inputs(op, batch=B):
    rng = np.random.default_rng(0)
    f = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    q, k, v = f(batch, T, H, D), f(batch, T, H, D) / 3, f(batch, T, H, D)
    per_channel = op in (stellax.chunk_kda, stellax.fused_recurrent_kda)
    g = -jnp.asarray(rng.random((batch, T, H) + ((D,) if per_channel else ())), jnp.float32)
    beta = jnp.asarray(rng.random((batch, T, H)), jnp.float32)
    return q, k, v, g, beta


def _jitted(op, **kw):
    return jax.jit(lambda q, k, v, g, beta: op(q, k, v, g, beta, output_final_state=True, **kw))


def _nan_rows(o):  # [B, T, HV, V] → [B, T, HV]: NaN in every entry of the row
    o = np.asarray(o)
    rows = np.isnan(o).all(axis=-1)
    assert (rows | ~np.isnan(o).any(axis=-1)).all(), "a row is partly NaN"
    return rows


@pytest.mark.parametrize("op", ALL, ids=lambda o: o.__name__)
@pytest.mark.parametrize("value", [2.0, 30.0, float("nan")])
def test_positive_decay_under_jit_poisons_exactly_its_batch_row_and_head(op, value):
    q, k, v, g, beta = _inputs(op)
    f = _jitted(op)
    o_ok, s_ok = f(q, k, v, g, beta)
    o, s = f(q, k, v, g.at[1, 4, 0].set(value), beta)
    want = np.zeros((B, T, H), bool)
    want[1, :, 0] = True
    np.testing.assert_array_equal(_nan_rows(o), want)
    np.testing.assert_array_equal(np.isnan(np.asarray(s)).all(axis=(2, 3)), want[:, 0])
    assert not np.isnan(np.asarray(s))[~want[:, 0]].any()
    np.testing.assert_array_equal(np.asarray(o)[~want], np.asarray(o_ok)[~want])  # the rest is untouched
    np.testing.assert_array_equal(np.asarray(s)[~want[:, 0]], np.asarray(s_ok)[~want[:, 0]])


def test_positive_decay_chunked_and_recurrent_agree_and_the_golden_too():
    q, k, v, g, beta = _inputs(stellax.chunk_gated_delta_rule)
    bad = g.at[0, 2, 1].set(0.5)
    o_c, s_c = _jitted(stellax.chunk_gated_delta_rule)(q, k, v, bad, beta)
    o_r, s_r = _jitted(stellax.fused_recurrent_gated_delta_rule)(q, k, v, bad, beta)
    ref, ref_s = jax.jit(lambda *a: api.chunk_gated_delta_rule_op.reference_fn(
        api.chunk_gated_delta_rule_op.check(*a, output_final_state=True)))(q, k, v, bad, beta)
    for o in (o_c, o_r, ref):
        np.testing.assert_array_equal(np.isnan(np.asarray(o)), np.isnan(np.asarray(o_c)))
    np.testing.assert_allclose(np.asarray(o_c), np.asarray(o_r), rtol=1e-5, atol=1e-5)  # NaN == NaN here
    np.testing.assert_allclose(np.asarray(ref_s), np.asarray(s_r), rtol=1e-5, atol=1e-5)


def test_positive_decay_gradients_are_nan_in_the_affected_head_only():
    q, k, v, g, beta = _inputs(stellax.chunk_gated_delta_rule)
    loss = jax.jit(jax.grad(lambda v, g: jnp.sum(stellax.chunk_gated_delta_rule(q, k, v, g, beta)[0] ** 2),
                            argnums=(0, 1)))
    dv, dg = loss(v, g.at[1, 4, 0].set(2.0))
    dv = np.asarray(dv)
    assert np.isnan(dv[1, :, 0]).all()
    assert np.isfinite(np.delete(dv.reshape(B * T, H, D), [T * 1 + t for t in range(T)], axis=0)).all()
    assert np.isfinite(dv[1, :, 1]).all() and np.isfinite(np.asarray(dg)[0]).all()


def test_the_kda_fused_gate_is_not_range_checked():
    q, k, v, g, beta = _inputs(stellax.chunk_kda)
    o, s = _jitted(stellax.chunk_kda, use_gate_in_kernel=True)(q, k, v, jnp.abs(g) + 5.0, beta)
    assert np.isfinite(np.asarray(o)).all() and np.isfinite(np.asarray(s)).all()


@pytest.mark.parametrize("op", ALL, ids=lambda o: o.__name__)
def test_varlen_positive_decay_poisons_its_sequence_only(op):
    q, k, v, g, beta = _inputs(op, batch=1)
    cu = jnp.array([0, 3, 3, T], jnp.int32)
    f = jax.jit(lambda g, cu: op(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True))
    o_ok, s_ok = f(g, cu)
    o, s = f(g.at[0, 5, 1].set(1.0), cu)
    want = np.zeros((1, T, H), bool)
    want[0, 3:, 1] = True  # sequence 2 = tokens 3..9, head 1
    np.testing.assert_array_equal(_nan_rows(o), want)
    want_s = np.zeros((3, H), bool)
    want_s[2, 1] = True
    np.testing.assert_array_equal(np.isnan(np.asarray(s)).all(axis=(2, 3)), want_s)
    np.testing.assert_array_equal(np.asarray(o)[~want], np.asarray(o_ok)[~want])
    np.testing.assert_array_equal(np.asarray(s)[~want_s], np.asarray(s_ok)[~want_s])


BAD_OFFSETS = {"not_from_0": [1, 3, 6, T], "decreasing": [0, 6, 3, T], "short": [0, 3, 6, T - 1],
               "past_T": [0, 3, 6, T + 4]}


@pytest.mark.parametrize("cu", list(BAD_OFFSETS.values()), ids=list(BAD_OFFSETS))
@pytest.mark.parametrize("op", ALL + (stellax.ssd,), ids=lambda o: getattr(o, "__name__", o))
def test_invalid_cu_seqlens_under_jit_make_everything_nan(op, cu):
    cu = jnp.asarray(cu, jnp.int32)
    if op is stellax.ssd:
        x, dt, bc = jnp.ones((1, T, H, D)), jnp.full((1, T, H), 0.1), jnp.ones((1, T, 1, 4))
        f = jax.jit(lambda cu: op(x, dt, -jnp.ones(H), bc, bc, cu_seqlens=cu, return_final_states=True))
        good = f(jnp.array([0, 3, 6, T], jnp.int32))
        assert all(np.isfinite(np.asarray(a)).all() for a in good)
    else:
        q, k, v, g, beta = _inputs(op, batch=1)
        f = jax.jit(lambda cu: op(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True))
    o, s = f(cu)
    assert np.isnan(np.asarray(o)).all() and np.isnan(np.asarray(s)).all()


@pytest.mark.parametrize("op", ALL, ids=lambda o: o.__name__)
def test_checked_mode_names_g_and_its_largest_value(op):
    q, k, v, g, beta = _inputs(op)
    bad = g.at[1, 4, 0].set(30.0)
    with stellax.checked():
        with pytest.raises(ValueError, match=r"^g\[1, 4, 0"):  # eager: the host check (index and value)
            op(q, k, v, bad, beta)
        err, _ = checkify.checkify(_jitted(op))(q, k, v, bad, beta)
        assert "g: expected a log-space decay <= 0" in err.get() and "largest value of 30.0" in err.get()
        err, _ = checkify.checkify(_jitted(op))(q, k, v, g, beta)
        assert err.get() is None


@pytest.mark.parametrize("op", (stellax.chunk_gated_delta_rule, stellax.fused_recurrent_kda, stellax.ssd),
                         ids=lambda o: o.__name__)
def test_checked_mode_names_cu_seqlens(op):
    if op is stellax.ssd:
        x, dt, bc = jnp.ones((1, T, H, D)), jnp.full((1, T, H), 0.1), jnp.ones((1, T, 1, 4))
        call = lambda cu: op(x, dt, -jnp.ones(H), bc, bc, cu_seqlens=cu)
    else:
        q, k, v, g, beta = _inputs(op, batch=1)
        call = lambda cu: op(q, k, v, g, beta, cu_seqlens=cu)
    with stellax.checked():
        with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-decreasing"):  # eager: host check
            call(jnp.array([0, 6, 3, T]))
        err, _ = checkify.checkify(jax.jit(call))(jnp.array([0, 6, 3, T]))
        assert err.get().startswith("cu_seqlens: expected offsets starting at 0") and "smallest step -3" in err.get()
        err, _ = checkify.checkify(jax.jit(call))(jnp.array([0, 3, 6, T]))
        assert err.get() is None


def test_checked_mode_names_ssd_A():
    x, dt, bc = jnp.ones((1, T, H, D)), jnp.full((1, T, H), 0.1), jnp.ones((1, T, 1, 4))
    with stellax.checked():
        err, _ = checkify.checkify(jax.jit(lambda A: stellax.ssd(x, dt, A, bc, bc)))(jnp.array([-1.0, 0.5]))
        assert err.get().startswith("A: expected a decay rate <= 0") and "0.5" in err.get()
        step = jax.jit(lambda A: stellax.ssd_step(jnp.zeros((1, H, D, 4)), x[:, 0], dt[:, 0], A, bc[:, 0], bc[:, 0]))
        err, _ = checkify.checkify(step)(jnp.array([-1.0, 0.5]))
        assert err.get().startswith("A: expected a decay rate <= 0")


@pytest.mark.parametrize("op", ALL + (stellax.ssd,), ids=lambda o: o.__name__)
def test_checks_off_add_no_check_to_the_program(op):
    if op is stellax.ssd:
        x, dt, bc = jnp.ones((1, T, H, D)), jnp.full((1, T, H), 0.1), jnp.ones((1, T, 1, 4))
        f = lambda A, cu: op(x, dt, A, bc, bc, cu_seqlens=cu)
        args = (-jnp.ones(H), jnp.array([0, 3, T]))
    else:
        q, k, v, g, beta = _inputs(op, batch=1)
        f = lambda g, cu: op(q, k, v, g, beta, cu_seqlens=cu)
        args = (g, jnp.array([0, 3, T]))
    with stellax.checked(False):
        text = str(jax.make_jaxpr(f)(*args))
        off = str(jax.make_jaxpr(checkify.checkify(f))(*args))
    assert "check" not in text and "assert" not in text
    with stellax.checked():
        assert str(jax.make_jaxpr(checkify.checkify(f))(*args)) != off  # on, the checks are there


@pytest.mark.parametrize("op", ALL, ids=lambda o: o.__name__)
def test_valid_data_unchanged_bit_for_bit(op):
    """The guarded op against its unguarded implementation (the same program without `bad_data`)."""
    q, k, v, g, beta = _inputs(op, batch=1)
    cu = jnp.array([0, 3, 3, T], jnp.int32)
    run = api._run_chunked if op in CHUNKED else api._run_recurrent
    op_obj = {stellax.chunk_gated_delta_rule: api.chunk_gated_delta_rule_op,
              stellax.fused_recurrent_gated_delta_rule: api.fused_recurrent_gated_delta_rule_op,
              stellax.chunk_kda: api.chunk_kda_op, stellax.fused_recurrent_kda: api.fused_recurrent_kda_op}[op]
    row = (api.BACKENDS if op in CHUNKED else api.RECURRENT_BACKENDS)["xla"]
    kw = {"per_channel": op is stellax.chunk_kda} if op in CHUNKED else {}

    def both(g, cu):
        call = op_obj.check(q, k, v, g, beta, cu_seqlens=cu, output_final_state=True)
        return run(row, call, None, **kw), run.__wrapped__(row, call, None, **kw)

    (o, s), (o_raw, s_raw) = jax.jit(both)(g, cu)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_raw))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(s_raw))


def test_measured_range_chunked_is_not_exact_for_positive_g():
    """Why the range is g <= 0: at g = +2 the chunked algorithm (unguarded, chunk 64) is NaN from
    the first token, where the exact recurrence is finite for 45 tokens (the evidence in `bad_data`)."""
    from stellax.ops.linear_attention import xla
    rng = np.random.default_rng(0)
    n = 48
    q, k = (l2norm(jnp.asarray(rng.standard_normal((1, n, 1, 16)), jnp.float32)) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, n, 1, 16)), jnp.float32)
    g, beta = jnp.full((1, n, 1), 2.0), jnp.asarray(rng.random((1, n, 1)), jnp.float32)
    exact, _ = delta_rule_recurrence(q, k, v, g, beta, scale=1.0)
    chunked, _ = xla.chunked_scan({"q": q, "k": k, "v": v, "g": g, "beta": beta},
                                  lambda x: (x["q"], x["k"], x["v"], x["g"], x["beta"]),
                                  initial_state=jnp.zeros((1, 1, 16, 16)), cu_seqlens=None, chunk_size=64)
    assert np.isfinite(np.asarray(exact)[:, :40]).all()
    assert not np.isfinite(np.asarray(chunked)[:, :40]).all()


@pytest.mark.parametrize("op, implementation", [
    (stellax.chunk_gated_delta_rule, "triton"), (stellax.chunk_gated_delta_rule, "mosaic_tpu"),
    (stellax.fused_recurrent_gated_delta_rule, "mosaic_tpu"), (stellax.fused_recurrent_kda, "mosaic_tpu")],
    ids=lambda p: getattr(p, "__name__", p))
def test_interpreted_kernels_give_the_documented_result(op, implementation):
    """A positive decay at one token: the kernels, reading NaN decays for that (sequence, head)
    (`bad_data.poison_decay`), write all of its rows and its final state NaN, the rest as XLA."""
    q, k, v, g, beta = _inputs(op)
    bad_g = g.at[1, 4, 0].set(2.0)
    with stellax.interpret_mode():
        o, s = _jitted(op, implementation=implementation)(q, k, v, bad_g, beta)
    want = np.zeros((B, T, H), bool)
    want[1, :, 0] = True
    np.testing.assert_array_equal(_nan_rows(o), want)
    np.testing.assert_array_equal(np.isnan(np.asarray(s)).all(axis=(2, 3)), want[:, 0])
    o_x, _ = _jitted(op, implementation="xla")(q, k, v, bad_g, beta)
    np.testing.assert_allclose(np.asarray(o)[~want], np.asarray(o_x)[~want], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("op", ALL, ids=lambda o: o.__name__)
def test_ops_poison_the_decays_not_the_outputs(op):
    """The ops make bad data NaN through the decays (`bad_data.poison_decay`): their program
    multiplies ``g`` by the 1 / NaN scales and takes no elementwise pass over ``o [B, T, HV, V]`` after
    the recurrence (on a v5e such a pass moved ``o`` through HBM twice: 0.3 ms at T = 16384, HV = 32)."""
    q, k, v, g, beta = _inputs(op)
    jaxpr = jax.make_jaxpr(lambda *a: op(*a, output_final_state=True)[0])(q, k, v, g, beta)

    def muls(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "mul":
                yield tuple(eqn.outvars[0].aval.shape)
            for sub in jax.core.jaxprs_in_params(eqn.params):
                yield from muls(sub)

    shapes = list(muls(jaxpr.jaxpr))
    assert v.shape not in shapes[-3:], shapes[-3:]          # no multiply of o at the end
    assert g.shape in shapes                                 # the decays are scaled
