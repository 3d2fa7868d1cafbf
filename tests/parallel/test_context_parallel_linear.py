"""Context-parallel GDN/KDA (state passing) equals the single-device chunked op,
outputs, final state and every gradient."""

import jax
import jax.numpy as jnp
import pytest

from stellax.parallel import context_parallel_gated_delta_rule, context_parallel_kda
from stellax.testing import assert_close

from .cp_cases import mesh_1d

# The single-device ops (issue 4) these tests compare against.
linear_attention = pytest.importorskip("stellax.ops.linear_attention",
                                       reason="the linear attention family (stellax.ops.linear_attention) is absent")


def _inputs(per_channel, seed=0, b=2, t=64, h=2, hv=4, kd=8, vd=8):
    keys = jax.random.split(jax.random.key(seed), 6)
    q = jax.random.normal(keys[0], (b, t, h, kd))
    k = jax.random.normal(keys[1], (b, t, h, kd))
    v = jax.random.normal(keys[2], (b, t, hv, vd))
    g = -jax.nn.softplus(jax.random.normal(keys[3], (b, t, hv, kd) if per_channel else (b, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (b, t, hv)))
    s0 = jax.random.normal(keys[5], (b, hv, kd, vd))
    return q, k, v, g, beta, s0


def _compare(per_channel, size, *, initial_state=True, seed=0, **kwargs):
    q, k, v, g, beta, s0 = _inputs(per_channel, seed)
    s0 = s0 if initial_state else None
    op = linear_attention.chunk_kda if per_channel else linear_attention.chunk_gated_delta_rule
    cp = context_parallel_kda if per_channel else context_parallel_gated_delta_rule
    mesh = mesh_1d(size)
    w = jax.random.normal(jax.random.key(99), v.shape)

    def loss(fn, q, k, v, g, beta, s0):
        o, final = fn(q, k, v, g, beta, s0)
        return jnp.sum(o * w) + jnp.sum(final * final), (o, final)

    single = lambda *a: op(*a[:5], initial_state=a[5], output_final_state=True, chunk_size=16, **kwargs)
    par = lambda *a: cp(*a[:5], mesh=mesh, axis_name="cp", initial_state=a[5], output_final_state=True,
                        chunk_size=16, **kwargs)
    argnums = (0, 1, 2, 3, 4) + ((5,) if initial_state else ())
    run = lambda fn: jax.jit(jax.value_and_grad(lambda *a: loss(fn, *a), argnums=argnums, has_aux=True))(
        q, k, v, g, beta, s0)
    (_, (o, final)), grads = run(par)
    (_, (o_ref, final_ref)), grads_ref = run(single)
    assert_close(o, o_ref, name="o")
    assert_close(final, final_ref, name="final_state")
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dinitial_state"), grads, grads_ref):
        assert_close(a, b, gradient=True, name=name)


@pytest.mark.parametrize("size", [4])
def test_gdn_context_parallel(size):
    _compare(False, size, use_qk_l2norm=True)


def test_kda_context_parallel():
    _compare(True, 2, initial_state=False)


def test_linear_errors():
    q, k, v, g, beta, _ = _inputs(False, t=30)
    with pytest.raises(ValueError, match="divisible"):
        context_parallel_gated_delta_rule(q, k, v, g, beta, mesh=mesh_1d(4), axis_name="cp")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        context_parallel_gated_delta_rule(q, k, v, g, beta, mesh=mesh_1d(2), axis_name="sp")
    with pytest.raises(ValueError, match="cu_seqlens"):
        context_parallel_gated_delta_rule(q[:1], k[:1], v[:1], g[:1], beta[:1], mesh=mesh_1d(2), axis_name="cp",
                                          cu_seqlens=jnp.asarray([0, 10, 30], jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("size", [2, 8])
def test_linear_matrix(per_channel, size):
    _compare(per_channel, size, seed=size)


@pytest.mark.slow
def test_kda_fused_gate_params():
    q, k, v, g, beta, _ = _inputs(True, 3)
    hv, kd = v.shape[2], q.shape[3]
    a_log = jnp.linspace(-1.0, 0.5, hv)
    dt_bias = jnp.linspace(-0.5, 0.5, hv * kd)
    mesh = mesh_1d(4)

    def loss(fn, a_log, dt_bias):
        o, f = fn(q, k, v, g, beta, A_log=a_log, dt_bias=dt_bias, use_gate_in_kernel=True, output_final_state=True,
                  chunk_size=16)
        return jnp.sum(o) + jnp.sum(f), (o, f)

    par = lambda *a, **kw: context_parallel_kda(*a, mesh=mesh, axis_name="cp", **kw)
    (_, (o, f)), grads = jax.jit(jax.value_and_grad(lambda *a: loss(par, *a), argnums=(0, 1), has_aux=True))(
        a_log, dt_bias)
    (_, (o_r, f_r)), grads_r = jax.jit(jax.value_and_grad(lambda *a: loss(linear_attention.chunk_kda, *a), argnums=(0, 1),
                                                          has_aux=True))(a_log, dt_bias)
    assert_close(o, o_r)
    assert_close(f, f_r)
    for a, b in zip(grads, grads_r):
        assert_close(a, b, gradient=True)
