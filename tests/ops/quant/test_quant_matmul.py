"""quantized_matmul: every supported pair (weight-only and activation ×
weight), Triton (interpreted) and XLA, vs dequantize-then-matmul in float32
(numpy float64 from the dequantized operands); shapes not multiples of
blocks or tiles; unsupported pairs; cuda lowering of every config; PTX tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.quant import QMatmulConfig, dequantize, quantize, quantized_matmul, quantized_matmul_op
from stellax.ops.quant.base import flatten_operands
from stellax.ops.quant.examples import example_operands
from stellax.testing import (assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_for_gpu,
                             triton_compiler_available)

PAIRS = example_operands(jnp.bfloat16, m=19, k=200, n=72)
IDS = [label for label, _, _ in PAIRS]


def _golden(x, w):
    xd = np.asarray(dequantize(x), np.float64) if isinstance(x, stellax.ops.quant.QArray) else np.asarray(
        x.astype(jnp.float32), np.float64)
    return xd @ np.asarray(dequantize(w), np.float64)


def _rel(y, ref):
    y = np.asarray(jnp.asarray(y).astype(jnp.float32), np.float64)
    return np.linalg.norm(y - ref) / np.linalg.norm(ref)


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("idx", range(len(PAIRS)), ids=IDS)
def test_every_pair_matches_dequantize_then_matmul(impl, idx):
    label, x, w = PAIRS[idx]
    ref = _golden(x, w)
    with stellax.interpret_mode():
        y32 = quantized_matmul(x, w, preferred_element_type=jnp.float32, implementation=impl)
    assert y32.shape == (19, 72) and y32.dtype == jnp.float32
    # float32 output: only accumulation order (and the XLA path's bf16 weights) differ
    tol = 5e-3 if (impl == "xla" and not isinstance(x, stellax.ops.quant.QArray)) else 1e-5
    assert _rel(y32, ref) < tol, label


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("idx", [2, 8, 12], ids=[IDS[2], IDS[8], IDS[12]])
def test_bf16_output(impl, idx):
    label, x, w = PAIRS[idx]
    with stellax.interpret_mode():
        y16 = quantized_matmul(x, w, implementation=impl)
    assert y16.dtype == jnp.bfloat16
    assert _rel(y16, _golden(x, w)) < 1e-2, label


@pytest.mark.parametrize("config,fmt,block", [
    (QMatmulConfig(block_m=16, block_n=16, block_k=16), "int4", 32),
    (QMatmulConfig(block_m=16, block_n=16, block_k=16), "nvfp4", 16),
    (QMatmulConfig(block_m=64, block_n=256, block_k=32), "mxfp4", 32),
    (QMatmulConfig(block_m=64, block_n=256, block_k=32), "int4", 32)])
def test_weight_only_tiles_not_dividing_shapes(config, fmt, block):
    kx, kw = jax.random.split(jax.random.PRNGKey(7))
    x = jax.random.normal(kx, (2, 9, 97), jnp.float32)  # K odd: half-filled last byte
    w = quantize(jax.random.normal(kw, (97, 45)), fmt, axis=0, block_size=block)
    with stellax.interpret_mode():
        y = quantized_matmul(x, w, preferred_element_type=jnp.float32, implementation="triton", config=config)
    assert y.shape == (2, 9, 45)
    ref = np.asarray(x, np.float64).reshape(18, 97) @ np.asarray(dequantize(w), np.float64)
    assert _rel(y.reshape(18, 45), ref) < 1e-5


def test_int8_per_channel_accumulates_exactly():
    """int8 × int8 per channel: the int32 accumulation is exact."""
    x = quantize(jax.random.normal(jax.random.PRNGKey(0), (20, 512)), "int8", axis=1)
    w = quantize(jax.random.normal(jax.random.PRNGKey(1), (512, 40)), "int8", axis=0)
    acc = np.asarray(x.values, np.int64) @ np.asarray(w.values, np.int64)
    want = acc * np.asarray(x.scales, np.float64) * np.asarray(w.scales, np.float64)
    with stellax.interpret_mode():
        y = quantized_matmul(x, w, preferred_element_type=jnp.float32, implementation="triton")
    assert _rel(y, want) < 1e-6


def test_unsupported_pairs_and_bad_operands():
    x = jax.random.normal(jax.random.PRNGKey(0), (8, 64))
    w = jax.random.normal(jax.random.PRNGKey(1), (64, 32))
    with pytest.raises(ValueError, match=r"unsupported pair x=int8 × w=fp8_e4m3"):
        quantized_matmul(quantize(x, "int8", axis=1), quantize(w, "fp8_e4m3", axis=0))
    with pytest.raises(ValueError, match=r"unsupported pair x=mxfp4 × w=mxfp4"):
        quantized_matmul(quantize(x, "mxfp4", axis=1), quantize(w, "mxfp4", axis=0))
    with pytest.raises(TypeError, match=r"w: expected a QArray"):
        quantized_matmul(quantize(x, "int8", axis=1), w)
    with pytest.raises(ValueError, match=r"quantized along axis 0"):
        quantized_matmul(x, quantize(w, "int8", axis=1))
    with pytest.raises(ValueError, match=r"expected shape \[..., 64\]"):
        quantized_matmul(x[:, :32], quantize(w, "int8", axis=0))
    with pytest.raises(ValueError, match=r"must share a rotation"):
        quantized_matmul(quantize(x, "fp8_e4m3", axis=1, rotate=64), quantize(w, "fp8_e4m3", axis=0))


def test_rotated_operands_give_the_same_product():
    kx, kw, ks = jax.random.split(jax.random.PRNGKey(3), 3)
    x = jax.random.normal(kx, (16, 256))
    w = jax.random.normal(kw, (256, 64)) / 16
    xq = quantize(x, "mxfp8_e4m3", axis=1, rotate=(64, ks))
    wq = quantize(w, "mxfp8_e4m3", axis=0, rotate=(64, ks))
    y = quantized_matmul(xq, wq, preferred_element_type=jnp.float32)
    ref = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert _rel(y, ref) < 0.05


def test_dispatch_defaults_to_xla_on_cpu_and_supports_jit():
    label, x, w = PAIRS[2]
    y = jax.jit(lambda x, w: quantized_matmul(x, w))(x, w)
    assert _rel(y, _golden(x, w)) < 1e-2


def _lowering_args(idx):
    _, x, w = PAIRS[idx]
    args, kwargs = flatten_operands(x, w)
    return args, {**kwargs, "preferred_element_type": "bfloat16"}


@pytest.mark.parametrize("idx", range(len(PAIRS)), ids=IDS)
def test_cuda_lowering_default_config(idx):
    args, kwargs = _lowering_args(idx)
    call = quantized_matmul_op.check(*args, **kwargs)
    cfg = quantized_matmul_op.implementations["triton"].default_config(call)
    assert check_op_lowering(quantized_matmul_op, "triton", args, kwargs, configs=[cfg]) == 1


@pytest.mark.parametrize("idx", [0, 8, 12], ids=[IDS[0], IDS[8], IDS[12]])
def test_cuda_lowering_every_config_representative(idx):
    args, kwargs = _lowering_args(idx)
    assert check_op_lowering(quantized_matmul_op, "triton", args, kwargs) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("idx", range(len(PAIRS)), ids=IDS)
def test_cuda_lowering_every_config(idx):
    args, kwargs = _lowering_args(idx)
    assert check_op_lowering(quantized_matmul_op, "triton", args, kwargs) >= 1


@pytest.mark.ptx
@pytest.mark.parametrize("idx", range(len(PAIRS)), ids=IDS)
def test_ptx_compiles_and_fits_smem(idx):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    args, kwargs = _lowering_args(idx)
    call = quantized_matmul_op.check(*args, **kwargs)
    for cfg in quantized_matmul_op.implementations["triton"].config_space(call):
        lowered = lower_for_gpu(lambda *a: quantized_matmul_op(*a, implementation="triton", config=cfg, **kwargs),
                                *args)
        assert_fits_smem(compile_triton_to_ptx(lowered))
