"""`ragged_dot` with a `QArray` rhs ``[G, K, N]`` (quantized along K).

Golden: ``stellax.dequantize`` (the quant family's own tested op) to float32,
then the float64 numpy grouped-matmul loop of `moe_helpers`.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.moe import GroupedMatmulConfig, ragged_dot_quantized_op
from stellax.ops.moe.checks import flatten_quantized as flatten
from stellax.ops.quant import QArray
from stellax.testing import assert_close, check_op_lowering
from stellax.testing.lowering import (assert_fits_smem, compile_triton_to_ptx, lower_for_gpu,
                                      triton_compiler_available)

from moe_helpers import f64, group_rows, numpy_ragged_dot, sizes

#: Tiles smaller than the shapes so that tiles, K steps and N blocks are partial.
SMALL = GroupedMatmulConfig(block_m=16, block_n=16, block_k=32, num_warps=4, num_stages=2)

#: (format, block) — K = 160 is not a multiple of 64 or 128 (partial last block).
CASES = [("int8", "channel"), ("int8_asym", 64), ("int4", 32), ("int4", 128), ("int4_asym", 64),
         ("fp8_e4m3", "channel"), ("fp8_e4m3", (128, 128)), ("fp8_e5m2", 128),
         ("mxfp8_e4m3", 32), ("mxfp4", 32), ("nvfp4", 16), ("nvfp4", (16, 16))]
M, K, N = 61, 160, 40
GS = [17, 0, 25, 0]  # empty groups, sum < M (rows past the groups are zero)


def _weights(seed, fmt, block, g=len(GS), k=K, n=N):
    w = jax.random.normal(jax.random.PRNGKey(seed), (g, k, n), jnp.float32) / np.sqrt(k)
    return stellax.quantize(w, fmt, axis=1, block_size=block)


def _lhs(seed, dtype, m=M, k=K):
    return jax.random.normal(jax.random.PRNGKey(seed), (m, k), jnp.float32).astype(dtype)


def _interpret(impl):
    """Interpret mode around the whole computation (the backward kernel is traced after the forward)."""
    return stellax.interpret_mode() if impl == "triton" else contextlib.nullcontext()


def _run(lhs, w, gs, impl, **kw):
    if impl == "triton":
        with stellax.interpret_mode():
            return stellax.ragged_dot(lhs, w, gs, implementation="triton", config=kw.pop("config", SMALL), **kw)
    return stellax.ragged_dot(lhs, w, gs, implementation="xla", **kw)


@pytest.mark.parametrize("fmt,block", CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_formats_match_dequantize_then_ragged_dot(fmt, block):
    w = _weights(1, fmt, block)
    wd = stellax.dequantize(w, jnp.float32)
    lhs = _lhs(2, jnp.float32)
    want = numpy_ragged_dot(lhs, wd, GS)
    assert np.abs(want).max() > 0.5  # not a trivially small result
    for impl in ("xla", "triton"):
        out = _run(lhs, w, sizes(GS), impl)
        assert out.shape == (M, N) and out.dtype == jnp.float32
        assert_close(out, want, dtype=jnp.float32, name=f"{fmt}[{block}] {impl}")
        np.testing.assert_array_equal(np.asarray(out)[sum(GS):], 0.0)


@pytest.mark.parametrize("fmt,block", [("int4", 32), ("mxfp4", 32), ("nvfp4", 16)])
def test_odd_k_bfloat16(fmt, block):
    """Odd K (a half-filled last byte for 4-bit codes), bf16 activations and output."""
    k, gs = 97, [0, 9, 30, 0, 14]
    w = _weights(3, fmt, block, g=5, k=k)
    lhs = _lhs(4, jnp.bfloat16, m=60, k=k)
    want = numpy_ragged_dot(lhs, stellax.dequantize(w, jnp.float32), gs)
    for impl in ("xla", "triton"):
        out = _run(lhs, w, sizes(gs), impl)
        assert out.dtype == jnp.bfloat16
        assert_close(out, want, dtype=jnp.bfloat16, name=f"{fmt} {impl}")


def test_group_offset_activation_and_jit():
    """Expert-sharded weights (offset 1 of 4 groups), a fused activation, traced group sizes."""
    w = _weights(5, "fp8_e4m3", 32, g=2)
    lhs = _lhs(6, jnp.float32)
    gs = [10, 21, 0, 18]
    wd = stellax.dequantize(w, jnp.float32)
    want = numpy_ragged_dot(lhs, wd, gs, offset=1, activation="silu")
    for impl in ("xla", "triton"):
        fn = jax.jit(lambda l, q, s: _run(l, q, s, impl, group_offset=1, activation="silu"))
        out = fn(lhs, w, sizes(gs))
        assert_close(out, want, dtype=jnp.float32, name=impl)


def test_full_default_config_and_dispatch():
    """The heuristic config (block_k capped at the K block), default implementation on CPU (XLA)."""
    w = _weights(7, "nvfp4", 16)
    lhs = _lhs(8, jnp.float32)
    want = numpy_ragged_dot(lhs, stellax.dequantize(w, jnp.float32), GS)
    assert_close(stellax.ragged_dot(lhs, w, sizes(GS)), want, dtype=jnp.float32)
    with stellax.interpret_mode():
        out = stellax.ragged_dot(lhs, w, sizes(GS), implementation="triton")
    assert_close(out, want, dtype=jnp.float32)
    args, kwargs = flatten(lhs, w, sizes(GS), None, None, None, None)
    assert_close(ragged_dot_quantized_op.reference(*args, **kwargs), want, dtype=jnp.float32)
    for impl in ("xla", "triton"):  # every group empty: all zeros (every element written once)
        np.testing.assert_array_equal(np.asarray(_run(lhs, w, sizes([0, 0, 0, 0]), impl)), 0.0)


def test_ragged_dot_general_forward_layout():
    w = _weights(22, "int4", 32)
    lhs = _lhs(23, jnp.float32)
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                             lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    out = stellax.ragged_dot_general(lhs, w, sizes(GS), dims)
    assert_close(out, numpy_ragged_dot(lhs, stellax.dequantize(w), GS), dtype=jnp.float32)
    tdims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [2]), ([], [])),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
    with pytest.raises(ValueError, match="rhs: a QArray rhs supports only the forward layout"):
        stellax.ragged_dot_general(_lhs(23, jnp.float32, k=N), w, sizes(GS), tdims)


def _numpy_dlhs(dy, wd, gs):
    dy, wd = f64(dy), f64(wd)
    out = np.zeros((dy.shape[0], wd.shape[1]))
    for g, (s, e) in enumerate(group_rows(gs)):
        out[s:e] = dy[s:e] @ wd[g].T
    return out


@pytest.mark.parametrize("fmt,block", [("int4", 32), ("nvfp4", 16)])
def test_lhs_gradient_and_frozen_weights(fmt, block):
    w = _weights(9, fmt, block)
    wd = stellax.dequantize(w, jnp.float32)
    lhs = _lhs(10, jnp.float32)
    dy = jax.random.normal(jax.random.PRNGKey(11), (M, N), jnp.float32)
    want = _numpy_dlhs(dy, wd, GS)
    for impl in ("xla", "triton"):
        def loss(l, scales):
            q = QArray(w.values, scales, w.zero_points, w.tensor_scale, format=w.format, shape=w.shape,
                       block_shape=w.block_shape, axis=w.axis)
            return jnp.sum(_run(l, q, sizes(GS), impl) * dy)

        with _interpret(impl):
            dlhs, dscales = jax.grad(loss, argnums=(0, 1))(lhs, w.scales)
        assert_close(dlhs, want, dtype=jnp.float32, gradient=True, name=f"dlhs {impl}")
        np.testing.assert_array_equal(np.asarray(dscales, np.float32), 0.0)  # frozen weights


def test_activation_gradient_bfloat16():
    """Per-channel scales (the epilogue / unblocked transposed path), silu, bf16."""
    w = _weights(12, "int8", "channel")
    wd = stellax.dequantize(w, jnp.float32)
    lhs = _lhs(13, jnp.bfloat16)
    dy = jax.random.normal(jax.random.PRNGKey(14), (M, N), jnp.float32)
    # numpy: d/dl sum(silu(l @ W) * dy) = (dy * silu'(z)) @ W^T
    z = numpy_ragged_dot(lhs, wd, GS)
    sig = 1 / (1 + np.exp(-z))
    want = _numpy_dlhs(f64(dy) * sig * (1 + z * (1 - sig)), wd, GS)
    for impl in ("xla", "triton"):
        g = jax.grad(lambda l: jnp.sum(_run(l, w, sizes(GS), impl, activation="silu").astype(jnp.float32) * dy))
        with _interpret(impl):
            got = g(lhs)
        assert_close(got, want, dtype=jnp.bfloat16, gradient=True, name=impl)


#: Kernel variants: packed codes + zero points, per-channel (epilogue) scales, E8M0 scales, E4M3 scales + tensor scale.
LOWER = [("int4_asym", 64), ("fp8_e4m3", "channel"), ("mxfp4", 32), ("nvfp4", 16)]


@pytest.mark.parametrize("fmt,block", LOWER, ids=[f"{f}-{b}" for f, b in LOWER])
def test_cuda_lowering_every_config(fmt, block):
    w = _weights(15, fmt, block, g=4, k=256, n=192)
    args, kwargs = flatten(_lhs(16, jnp.bfloat16, m=96, k=256), w, sizes([30, 0, 40, 26]), None, None, None,
                           "silu")
    grad = fmt in ("int4_asym", "fp8_e4m3")  # the dlhs kernel: packed + zero points, unpacked
    assert check_op_lowering(ragged_dot_quantized_op, "triton", args, kwargs, grad=grad) >= 2


@pytest.mark.ptx
@pytest.mark.parametrize("fmt,block", [("int4", 128), ("fp8_e4m3", 128), ("nvfp4", 16)])
def test_ptx_compile_and_shared_memory(fmt, block):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    w = _weights(17, fmt, block, g=8, k=512, n=256)
    lhs = _lhs(18, jnp.bfloat16, m=256, k=512)
    args, kwargs = flatten(lhs, w, sizes([32] * 8), None, None, None, None)
    call = ragged_dot_quantized_op.check(*args, **kwargs)
    for config in ragged_dot_quantized_op.implementations["triton"].config_space(call):
        def dlhs(l, q):  # forward and the transposed-decode backward kernel
            f = lambda x: stellax.ragged_dot(x, q, sizes([32] * 8), implementation="triton",  # noqa: E731
                                             config=config).astype(jnp.float32).sum()
            return jax.grad(f)(l)

        kernels = compile_triton_to_ptx(lower_for_gpu(dlhs, lhs, w), "9.0")
        assert len(kernels) == 2
        assert_fits_smem(kernels, "9.0")


# -- bad inputs -------------------------------------------------------------------------
def test_bad_inputs():
    lhs = _lhs(19, jnp.float32)
    w = _weights(20, "int8", 32)
    gs = sizes(GS)
    with pytest.raises(ValueError, match="rhs: expected a QArray quantized along axis 1"):
        stellax.ragged_dot(lhs, stellax.quantize(stellax.dequantize(w), "int8", axis=2), gs)
    with pytest.raises(ValueError, match=r"rhs: expected shape \[G, 128, N\] \(K = lhs.shape\[1\]\)"):
        stellax.ragged_dot(_lhs(19, jnp.float32, k=128), w, gs)
    with pytest.raises(ValueError, match="rhs: expected a rank-3 QArray"):
        stellax.ragged_dot(lhs, stellax.quantize(jnp.ones((K, N)), "int8", axis=0), gs)
    with pytest.raises(ValueError, match="rhs: expected a rank-3 QArray"):
        stellax.ragged_dot(lhs, stellax.quantize(jnp.ones((4, K, 2, 8)), "int8", axis=1), gs)
    with pytest.raises(ValueError, match="rhs: expected blocks of size 1 along the group axis"):
        stellax.ragged_dot(lhs, stellax.quantize(jnp.ones((4, K, N)), "int8", axis=1, block_size="tensor"), gs)
    with pytest.raises(ValueError, match="rotate"):
        stellax.ragged_dot(lhs, w.with_rotation(32), gs)
    with pytest.raises(ValueError, match="group_sizes: expected length 4"):
        stellax.ragged_dot(lhs, w, sizes([1, 2, 3]))
    with pytest.raises(ValueError, match=r"group_sizes: expected sum\(group_sizes\) <= 61"):
        stellax.ragged_dot(lhs, w, sizes([40, 0, 40, 0]))
    with pytest.raises(TypeError, match="lhs"):
        stellax.ragged_dot(lhs.astype(jnp.int32), w, gs)
    with pytest.raises(ValueError, match="QArray.scales: expected shape"):  # a hand-built QArray is validated
        QArray(w.values, w.scales[:, :2], format="int8", shape=w.shape, block_shape=w.block_shape, axis=1)
    # a K block the Triton kernel cannot step (48, not a power of two): XLA only, with a clear reason
    w48 = _weights(21, "int8", 48)
    out = stellax.ragged_dot(lhs, w48, gs, implementation="xla")
    assert_close(out, numpy_ragged_dot(lhs, stellax.dequantize(w48), GS), dtype=jnp.float32)
    with pytest.raises(Exception, match="K blocks that are powers of two"):
        with stellax.interpret_mode():
            stellax.ragged_dot(lhs, w48, gs, implementation="triton")
