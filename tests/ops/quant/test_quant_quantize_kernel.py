"""The Triton quantize kernels (interpreted: MX, and int8/int4/fp8 1-D
blocks) vs the independent numpy spec:
codes and E8M0 scales bit-exact (random, outliers, wide range, zeros,
NaN/Inf, partial blocks, leading dims); fallback reasons; cuda lowering of
every config; PTX tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import quant_spec as S
import stellax
from stellax.ops.quant import quantize, quantize_op
from stellax.testing import (assert_fits_smem, check_op_lowering, compile_triton_to_ptx, lower_for_gpu,
                             triton_compiler_available)
from test_quant_formats import KINDS, _bits, _data

MX = [("mxfp8_e4m3", "e4m3"), ("mxfp8_e5m2", "e5m2"), ("mxfp4", "e2m1")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,name", MX)
def test_triton_mx_quantize_bit_exact(kind, fmt, name):
    x = _data(kind, (6, 200), seed=11)
    with stellax.interpret_mode():
        q = quantize(jnp.asarray(x), fmt, implementation="triton")
    codes, scale_codes = S.quantize_mx(x, name)
    np.testing.assert_array_equal(_bits(q.scales), scale_codes)
    got = S.unpack_nibbles_last(q.values, 200) if name == "e2m1" else _bits(q.values)
    np.testing.assert_array_equal(got, codes)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt,block", [("int8", 64), ("int4", 32), ("fp8_e4m3", 128), ("fp8_e5m2", 32)])
def test_triton_block_quantize_bit_exact(kind, fmt, block):
    x = _data(kind, (6, 200), seed=12)
    with stellax.interpret_mode():
        q = quantize(jnp.asarray(x), fmt, block_size=block, implementation="triton")
    if fmt.startswith("int"):
        codes, s = S.quantize_int_sym(x, block, 127 if fmt == "int8" else 7)
        if fmt == "int4":
            nib = S.unpack_nibbles_last(q.values, 200)
            got = np.where(nib >= 8, nib - 16, nib)
        else:
            got = np.asarray(q.values).astype(np.int64)
    else:
        codes, s = S.quantize_fp8(x, block, fmt[-4:])
        got = _bits(q.values)
    np.testing.assert_array_equal(got, codes)
    np.testing.assert_array_equal(np.asarray(q.scales), s)


def test_leading_dims_and_bf16_input():
    x = jax.random.normal(jax.random.PRNGKey(0), (2, 5, 96), jnp.float32).astype(jnp.bfloat16)
    with stellax.interpret_mode():
        q = quantize(x, "mxfp4", implementation="triton")
    ref = quantize(x, "mxfp4", implementation="xla")
    np.testing.assert_array_equal(np.asarray(q.values), np.asarray(ref.values))
    np.testing.assert_array_equal(_bits(q.scales), _bits(ref.scales))


def test_fallbacks_have_reasons():
    x = jnp.ones((8, 64))
    with stellax.interpret_mode():
        for kwargs, match in (({"format": "nvfp4"}, r"cover the MX formats"),
                              ({"format": "fp8_e4m3", "block_size": 16}, r"1-D blocks of 32–256"),
                              ({"format": "mxfp4", "axis": 0}, r"along the last axis"),
                              ({"format": "mxfp4", "stochastic_rounding_key": jax.random.PRNGKey(0)},
                               r"no stochastic_rounding_key")):
            with pytest.raises(stellax.UnsupportedError, match=match):
                quantize(x, implementation="triton", **kwargs)


@pytest.mark.parametrize("fmt,block", [("mxfp8_e4m3", 32), ("mxfp4", 32), ("fp8_e4m3", 128), ("int4", 64)])
def test_cuda_lowering_every_config(fmt, block):
    x = jax.ShapeDtypeStruct((64, 1000), jnp.bfloat16)
    assert check_op_lowering(quantize_op, "triton", (x,), {"format": fmt, "axis": -1, "block_shape": (1, block)}) == 4


@pytest.mark.ptx
@pytest.mark.parametrize("fmt,block", [("mxfp8_e4m3", 32), ("mxfp8_e5m2", 32), ("mxfp4", 32), ("int8", 128),
                                       ("int4", 32), ("fp8_e4m3", 128), ("fp8_e5m2", 256)])
def test_ptx_compiles_and_fits_smem(fmt, block):
    ok, reason = triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    x = jax.ShapeDtypeStruct((256, 4096), jnp.bfloat16)
    call = quantize_op.check(x, format=fmt, axis=-1, block_shape=(1, block))
    for cfg in quantize_op.implementations["triton"].config_space(call):
        lowered = lower_for_gpu(lambda x: quantize_op(x, format=fmt, axis=-1, block_shape=(1, block),
                                                      implementation="triton", config=cfg), x)
        assert_fits_smem(compile_triton_to_ptx(lowered))
