"""moe_mlp vs a dense per-token loop (forward and gradients), and expert
parallelism on 8 simulated CPU devices vs the single-device result."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import stellax
from stellax.ops.moe import moe_mlp, moe_mlp_expert_parallel, permute, route
from stellax.testing import assert_close, golden

from moe_helpers import f64, inputs

T, D, F, E, K = 32, 16, 24, 8, 2


def _args(seed=0, dtype=jnp.float32, experts=E, tokens=T):
    x, logits, w_gate_up, w_down = inputs(seed, [(tokens, D), (tokens, experts), (experts, D, 2, F), (experts, F, D)])
    return (x.astype(dtype), 2.0 * logits, (0.3 * w_gate_up).astype(dtype), (0.3 * w_down).astype(dtype))


def per_token_loop(x, logits, w_gate_up, w_down, top_k, capacity=None):
    """Token by token: its k experts' SwiGLU MLPs, weighted (numpy float64)."""
    weights, ids = route(logits, top_k)
    x, w_gate_up, w_down = f64(x), f64(w_gate_up), f64(w_down)
    weights, ids = np.asarray(weights, np.float64), np.asarray(ids)
    seen = np.zeros(w_down.shape[0], int)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = ids[t, j]
            seen[e] += 1
            if capacity is not None and seen[e] > capacity:
                continue  # dropped copy
            gate, up = x[t] @ w_gate_up[e, :, 0], x[t] @ w_gate_up[e, :, 1]
            out[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ w_down[e])
    return out


@pytest.mark.parametrize("impl", ["xla", "triton", "mosaic_tpu"])
def test_moe_mlp_matches_per_token_loop(impl):
    args = _args(1)
    with stellax.interpret_mode(impl != "xla"):
        out = jax.jit(lambda *a: moe_mlp(*a, top_k=K, implementation=impl))(*args)
    assert out.shape == (T, D) and out.dtype == jnp.float32
    assert_close(out, per_token_loop(*args, K), rel_l2_tolerance=2e-5)


def test_moe_mlp_capacity_drops_like_the_loop():
    args = _args(2)
    _, ids = route(args[1], K)
    dropped = permute(args[0], ids, E, capacity_factor=0.5)[3]
    assert int(dropped.sum()) > 0  # the capacity really drops copies here
    out = jax.jit(lambda *a: moe_mlp(*a, top_k=K, capacity_factor=0.5))(*args)
    assert_close(out, per_token_loop(*args, K, capacity=int(np.ceil(0.5 * T * K / E))), rel_l2_tolerance=2e-5)


@pytest.mark.parametrize("impl", ["xla", "triton", pytest.param("mosaic_tpu", marks=pytest.mark.slow)])
def test_moe_mlp_gradients(impl):
    args = _args(3)
    cot = inputs(4, [(T, D)])[0]

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a) * cot)

    with stellax.interpret_mode(impl != "xla"):
        grads = jax.jit(jax.grad(loss(lambda *a: moe_mlp(*a, top_k=K, implementation=impl)), (0, 1, 2, 3)))(*args)
    ref = golden(jax.jit(jax.grad(loss(lambda *a: stellax.ops.moe.moe_mlp_op.reference(*a, top_k=K)),
                                  (0, 1, 2, 3))), *args)
    for name, g, r in zip(("dx", "dlogits", "dw_gate_up", "dw_down"), grads, ref):
        assert_close(g, r, gradient=True, rel_l2_tolerance=4e-5, name=name)


def test_moe_mlp_bfloat16():
    args = _args(5, jnp.bfloat16)
    out = jax.jit(lambda *a: moe_mlp(*a, top_k=K))(*args)
    assert out.dtype == jnp.bfloat16
    assert_close(out, per_token_loop(*args, K), dtype=jnp.bfloat16)


@pytest.mark.parametrize("call,match", [
    (lambda a: moe_mlp(a[0], a[1], a[2][:, :, :1], a[3], top_k=2), "w_gate_up"),
    (lambda a: moe_mlp(a[0], a[1], a[2], a[3][:4], top_k=2), "w_down"),
    (lambda a: moe_mlp(a[0], a[1], a[2], a[3], top_k=9), "top_k"),
    (lambda a: moe_mlp(a[0], a[1][:5], a[2], a[3], top_k=2), "router_logits"),
    (lambda a: moe_mlp(a[0], a[1], a[2].astype(jnp.bfloat16), a[3], top_k=2), "w_gate_up"),
])
def test_moe_mlp_bad_inputs(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call(_args(6))


# -- expert parallelism -------------------------------------------------------------------
def _mesh():
    devices = jax.devices()
    if len(devices) < 8:
        pytest.skip(f"needs 8 devices (tests/conftest.py simulates them), found {len(devices)}")
    return Mesh(np.array(devices[:8]), ("ep",))


@pytest.mark.parametrize("dispatch,capacity_factor", [
    ("all_to_all", None), ("all_gather", 0.75),
    pytest.param("all_to_all", 0.75, marks=pytest.mark.slow), pytest.param("all_gather", None, marks=pytest.mark.slow)])
def test_expert_parallel_matches_single_device(dispatch, capacity_factor):
    mesh = _mesh()
    experts, tokens, top_k = 16, 64, 3
    args = _args(7, experts=experts, tokens=tokens)
    cot = inputs(8, [(tokens, D)])[0]
    kwargs = dict(top_k=top_k, capacity_factor=capacity_factor)

    def single(*a):
        return moe_mlp(*a, **kwargs)

    def sharded(*a):
        return moe_mlp_expert_parallel(*a, mesh=mesh, axis_name="ep", dispatch=dispatch, **kwargs)

    if capacity_factor is not None:
        _, ids = route(args[1], top_k)
        assert int(permute(args[0], ids, experts, capacity_factor=capacity_factor)[3].sum()) > 0
    out = jax.jit(sharded)(*args)
    assert_close(out, jax.jit(single)(*args), rel_l2_tolerance=1e-5, name="forward")
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a) * cot), (0, 1, 2, 3)))(*args)
    ref = jax.jit(jax.grad(lambda *a: jnp.sum(single(*a) * cot), (0, 1, 2, 3)))(*args)
    for name, g, r in zip(("dx", "dlogits", "dw_gate_up", "dw_down"), grads, ref):
        assert_close(g, r, gradient=True, rel_l2_tolerance=2e-5, name=name)


def test_expert_parallel_ragged_collective_lowers_for_cuda():
    """XLA:CPU cannot run ragged-all-to-all; the GPU path is checked by lowering."""
    mesh = _mesh()
    args = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _args(9, experts=16, tokens=64)]

    def loss(*a):
        return jnp.sum(moe_mlp_expert_parallel(*a, mesh=mesh, axis_name="ep", top_k=2, collective="ragged"))

    lowered = jax.jit(jax.grad(loss, (0, 2))).trace(*args).lower(lowering_platforms=("cuda",))
    assert "ragged_all_to_all" in lowered.as_text()


def test_expert_parallel_on_tpu_uses_ragged_all_to_all_and_the_tpu_kernels():
    """For a TPU (``collective="auto"``, ``implementation=None``): the exchange is
    ``ragged_all_to_all`` and the grouped matmuls (forward and backward) are the
    Mosaic TPU kernels; lowered for ``tpu`` on the CPU (forward and gradients)."""
    mesh = _mesh()
    args = [jax.ShapeDtypeStruct(a.shape, jnp.bfloat16 if i != 1 else a.dtype)
            for i, a in enumerate(_args(9, experts=16, tokens=64))]

    def loss(*a):
        return jnp.sum(moe_mlp_expert_parallel(*a, mesh=mesh, axis_name="ep", top_k=2).astype(jnp.float32))

    with stellax.lowering_target("v6e"):
        text = jax.jit(jax.value_and_grad(loss, (0, 2, 3))).trace(*args).lower(
            lowering_platforms=("tpu",)).as_text()
    assert "ragged_all_to_all" in text and "all_to_all" in text
    assert text.count("tpu_custom_call") >= 4  # gate/up and down forward, their dlhs and drhs kernels
    assert "stellax_ragged_dot_tpu" in text and "stellax_ragged_dot_tgmm_tpu" in text


def test_expert_parallel_bad_inputs():
    mesh = _mesh()
    args = _args(10, experts=12, tokens=64)
    with pytest.raises(ValueError, match="divisible"):
        moe_mlp_expert_parallel(*args, mesh=mesh, axis_name="ep", top_k=2)
    x, logits, _, _ = _args(10, experts=16, tokens=64)
    _, _, w_gate_up, w_down = _args(10, experts=24, tokens=64)
    with pytest.raises(ValueError, match="w_gate_up"):  # 16 experts in the logits, 24 in the weights
        moe_mlp_expert_parallel(x, logits, w_gate_up, w_down, mesh=mesh, axis_name="ep", top_k=2)
    with pytest.raises(ValueError, match="dispatch"):
        moe_mlp_expert_parallel(*_args(10, experts=16, tokens=64), mesh=mesh, axis_name="ep", top_k=2,
                                dispatch="broadcast")
