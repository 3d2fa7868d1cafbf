"""dequantize: the Triton kernel (interpreted) is bitwise equal to the XLA
path for every format (partial blocks, NaN blocks, leading dims); cuda
lowering of every config; PTX tier; layouts the kernel does not take fall
back to XLA with a reason."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.quant import DequantConfig, dequantize, dequantize_op, quantize
from stellax.ops.quant.qarray import qarray_fields
from stellax.testing import (assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_for_gpu,
                             triton_compiler_available)

CASES = [("int8", "channel"), ("int8", 64), ("int8_asym", 32), ("int4", 128), ("int4_asym", 32),
         ("fp8_e4m3", 128), ("fp8_e5m2", "channel"), ("mxfp8_e4m3", None), ("mxfp4", None), ("nvfp4", None)]


def _x():
    x = jax.random.normal(jax.random.PRNGKey(0), (3, 7, 301))  # 301: partial last block, odd packing
    return x.at[0, 0, 5].set(jnp.nan).at[1, 2, 100].set(40.0)


def _fields(q):
    arrays, options = qarray_fields(q)
    return tuple(arrays.values()), options


@pytest.mark.parametrize("fmt,block", CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_triton_bitwise_equal_to_xla(fmt, block):
    q = quantize(_x(), fmt, block_size=block)
    for dtype in (jnp.float32, jnp.bfloat16):
        ref = np.asarray(dequantize(q, dtype, implementation="xla").astype(jnp.float32))
        with stellax.interpret_mode():
            out = dequantize(q, dtype, implementation="triton")
        assert out.dtype == dtype and out.shape == q.shape
        got = np.asarray(out.astype(jnp.float32))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
        np.testing.assert_array_equal(np.nan_to_num(got), np.nan_to_num(ref))


def test_small_tiles_many_blocks_per_tile():
    q = quantize(_x(), "nvfp4")
    with stellax.interpret_mode():
        out = dequantize(q, implementation="triton", config=DequantConfig(block_rows=8, block_k=128))
    np.testing.assert_array_equal(np.nan_to_num(np.asarray(out)), np.nan_to_num(np.asarray(dequantize(q))))


def test_unsupported_layout_falls_back_with_reason():
    q = quantize(jnp.ones((64, 32)), "int8", axis=0)
    with pytest.raises(stellax.UnsupportedError, match=r"1-D blocks along the last axis"):
        with stellax.interpret_mode():
            dequantize(q, implementation="triton")
    assert np.all(np.asarray(dequantize(q)) == 1)  # default chain ends in XLA


@pytest.mark.parametrize("fmt,block", [("int4", 128), ("mxfp4", None), ("fp8_e4m3", "channel")])
def test_cuda_lowering_every_config(fmt, block):
    args, kw = _fields(quantize(_x(), fmt, block_size=block))
    assert check_op_lowering(dequantize_op, "triton", args, {**kw, "dtype": "bfloat16"}) >= 1


@pytest.mark.ptx
@pytest.mark.parametrize("fmt,block", CASES, ids=[f"{f}-{b}" for f, b in CASES])
def test_ptx_compiles_and_fits_smem(fmt, block):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    args, kw = _fields(quantize(_x(), fmt, block_size=block))
    call = dequantize_op.check(*args, **kw, dtype="bfloat16")
    for cfg in dequantize_op.implementations["triton"].config_space(call):
        lowered = lower_for_gpu(lambda *a: dequantize_op(*a, implementation="triton", config=cfg, **kw,
                                                         dtype="bfloat16"), *args)
        assert_fits_smem(compile_triton_to_ptx(lowered))
