"""The Mosaic TPU grouped matmul with quantized expert weights
(`ops/moe/mosaic_tpu_quantized.py`), interpreted on the CPU against the golden
(``dequantize`` in float32, then the float64 grouped matmul) per format; the
fp8 gate per TPU generation; the weights entering the kernel as codes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import UnsupportedError, interpret_mode, lowering_target
from stellax.ops.moe import mosaic_tpu_quantized, ragged_dot_quantized_op
from stellax.ops.moe.checks import flatten_quantized
from stellax.ops.moe.configs import (TpuGroupedMatmulConfig, quantized_tpu_heuristic, quantized_tpu_space,
                                         quantized_tpu_vmem)
from stellax.testing import TPU_CUSTOM_CALL, assert_close

from moe_helpers import numpy_ragged_dot, sizes

M, K, N = 120, 300, 100  # none a multiple of the 128/256 tiles: padded inside
GS = [40, 0, 60]  # an empty group; 100 of 120 rows (the rest are zeros)
CFG = TpuGroupedMatmulConfig(128, 256, 128)
HIGHEST = jax.lax.Precision.HIGHEST  # what the op resolves precision=None to


def _weights(seed, fmt, block, g=len(GS), k=K, n=N):
    w = jax.random.normal(jax.random.PRNGKey(seed), (g, k, n), jnp.float32) / np.sqrt(k)
    return stellax.quantize(w, fmt, axis=1, block_size=block)


def _lhs(seed, dtype=jnp.float32, m=M, k=K):
    return jax.random.normal(jax.random.PRNGKey(seed), (m, k), jnp.float32).astype(dtype)


def _kernel(lhs, w, gs, *, k_block, config=CFG, activation=None, group_offset=None, out_dtype=jnp.float32):
    with interpret_mode():
        return mosaic_tpu_quantized.gmm(lhs, w, sizes(gs), group_offset, activation=activation, precision=HIGHEST,
                                        out_dtype=out_dtype, k_block=k_block, config=config)


FAST = [("int8", "channel"), ("int4", 32), ("nvfp4", 16), ("fp8_e4m3", (128, 128))]
SLOW = [("int8", 32), ("int8_asym", 64), ("int4_asym", 64), ("mxfp4", 32), ("fp8_e4m3", "channel"),
        ("fp8_e5m2", 128), ("mxfp8_e4m3", 32), ("nvfp4", (16, 16))]
CASES = [pytest.param(f, b, id=f"{f}-{b}") for f, b in FAST] + [
    pytest.param(f, b, id=f"{f}-{b}", marks=pytest.mark.slow) for f, b in SLOW]


@pytest.mark.parametrize("fmt,block", CASES)
def test_formats_match_the_golden_in_interpret_mode(fmt, block):
    """Every format, per-channel and block scales (one scale row per K step, several per
    step, 2-D blocks); fp8 formats run the kernel directly (their gate is a generation's)."""
    w, lhs = _weights(1, fmt, block), _lhs(2)
    k_block = None if block == "channel" else w.block_shape[1]
    out = _kernel(lhs, w, GS, k_block=k_block)
    want = numpy_ragged_dot(lhs, stellax.dequantize(w, jnp.float32), GS)
    assert_close(out, want, dtype=jnp.float32, name=f"{fmt} {block}")
    assert not np.asarray(out[sum(GS):]).any()


def test_scale_rows_longer_than_a_k_step():
    """K blocks of 256 with K steps of 128: a step reads row ``k·128 // 256``."""
    w, lhs = _weights(3, "int8", 256, k=512), _lhs(4, k=512)
    out = _kernel(lhs, w, GS, k_block=256, config=TpuGroupedMatmulConfig(128, 128, 128))
    assert_close(out, numpy_ragged_dot(lhs, stellax.dequantize(w, jnp.float32), GS), dtype=jnp.float32)


@pytest.mark.slow  # ~90 s on the shared CI CPU (interpreted forward inside the VJP, XLA gradient)
def test_op_bfloat16_activation_group_offset_and_lhs_gradient():
    """Through the op: bfloat16, fused silu, expert-parallel group offset, and the gradient
    w.r.t. ``lhs`` (the TPU implementation's dlhs is the XLA path)."""
    w = _weights(5, "int4", 32, g=2)
    lhs = _lhs(6, jnp.bfloat16)
    gs, offset = sizes([30, 40, 0, 40]), jnp.int32(1)
    args, kwargs = flatten_quantized(lhs, w, gs, None, None, offset, "silu")
    golden = ragged_dot_quantized_op.reference(*args, **kwargs)
    cot = jax.random.normal(jax.random.PRNGKey(7), (M, N), jnp.float32).astype(jnp.bfloat16)

    def loss(impl):
        def f(x):
            y = stellax.ragged_dot(x, w, gs, group_offset=offset, activation="silu", implementation=impl,
                                   config=CFG if impl == "mosaic_tpu" else None)
            return jnp.sum(y.astype(jnp.float32) * cot), y
        return f

    with interpret_mode():
        (_, out), dx = jax.value_and_grad(loss("mosaic_tpu"), has_aux=True)(lhs)
    (_, _), dx_xla = jax.value_and_grad(loss("xla"), has_aux=True)(lhs)
    assert_close(out, golden, dtype=jnp.bfloat16, name="forward")
    assert not np.asarray(out[:30]).any() and not np.asarray(out[70:]).any()  # rows of other experts
    assert_close(dx, dx_xla, dtype=jnp.bfloat16, gradient=True, name="dlhs")


def _lower_for(generation, fmt, block):
    w = _weights(8, fmt, block)
    lhs = jax.ShapeDtypeStruct((M, K), jnp.bfloat16)
    with lowering_target(generation):
        return jax.jit(lambda x, q: stellax.ragged_dot(x, q, sizes(GS))).trace(lhs, w).lower(
            lowering_platforms=("tpu",)).as_text()


def test_fp8_needs_a_generation_with_float8_and_dispatch_falls_back():
    w, lhs = _weights(9, "fp8_e4m3", 128), _lhs(10)
    args, kwargs = flatten_quantized(lhs, w, sizes(GS), None, None, None, None)
    call = ragged_dot_quantized_op.check(*args, **kwargs)
    impl = ragged_dot_quantized_op.implementations["mosaic_tpu"]
    with lowering_target("v6e"):
        reason = impl.requirements(call)
    assert "float8" in reason and "v6e" in reason and "tpu7x" in reason
    with lowering_target("tpu7x"):
        assert impl.requirements(call) is None
    with interpret_mode(), pytest.raises(UnsupportedError, match="float8"):  # a CPU targets v6e's configs
        stellax.ragged_dot(lhs, w, sizes(GS), implementation="mosaic_tpu")
    assert TPU_CUSTOM_CALL not in _lower_for("v6e", "fp8_e4m3", 128)  # implementation=None: XLA
    assert TPU_CUSTOM_CALL in _lower_for("tpu7x", "fp8_e4m3", 128)
    assert TPU_CUSTOM_CALL in _lower_for("v5e", "int4", 128)


def _pallas_inputs(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            return [v.aval for v in eqn.invars]
        for param in eqn.params.values():
            sub = getattr(param, "jaxpr", param)
            if hasattr(sub, "eqns"):
                found = _pallas_inputs(sub)
                if found:
                    return found
    return None


@pytest.mark.parametrize("fmt,block,code_dtype,rows", [("int8", 32, jnp.int8, K), ("int4", 32, jnp.int8, K // 2)])
def test_the_weights_enter_the_kernel_as_codes(fmt, block, code_dtype, rows):
    """No dequantized weight in HBM: the kernel's weight operand is the code array
    (padded to the tiles); no float operand has the weights' size."""
    w, lhs = _weights(11, fmt, block), _lhs(12)
    jaxpr = jax.make_jaxpr(lambda x, q: mosaic_tpu_quantized.gmm(
        x, q, sizes(GS), None, activation=None, precision=None, out_dtype=jnp.float32, k_block=block,
        config=CFG))(lhs, w).jaxpr
    avals = _pallas_inputs(jaxpr)
    assert avals is not None
    weights = [a for a in avals if a.ndim == 3 and a.shape[2] == 128]  # [G, K(/2) padded, N padded]
    assert any(np.dtype(a.dtype) == np.dtype(code_dtype) and a.shape[1] >= rows for a in weights)
    assert all(a.size < len(GS) * K * N // 8 for a in weights if jnp.issubdtype(a.dtype, jnp.floating))


def test_space_and_heuristic_fit_the_scoped_vmem_and_the_packing():
    w = jax.eval_shape(lambda: _weights(13, "int4", 32, g=8, k=4096, n=2048))
    args, kwargs = flatten_quantized(jax.ShapeDtypeStruct((4096, 4096), jnp.bfloat16), w, sizes([512] * 8),
                                     None, None, None, None)
    call = ragged_dot_quantized_op.check(*args, **kwargs)
    for generation in ("v5e", "v6e"):
        with lowering_target(generation):
            space, best = quantized_tpu_space(call), quantized_tpu_heuristic(call)
            budget = stellax.core.platform.target_generation().scoped_vmem_bytes
        assert best in space and len(space) > 3
        assert all(c.block_k >= 256 and quantized_tpu_vmem(call, c) <= budget for c in space)
