"""Quantized KV caches: packing, error bounds per bit width, the Hadamard
rotation, and attention with dequantization fused into the kernels."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import (
    KVQuant, PagedConfig, RaggedConfig, dequantize_pages, hadamard, pack_codes, paged_attention,
    paged_attention_op, quantize_pages, ragged_paged_attention, ragged_paged_attention_op, rotate,
    rotation_signs, unpack_codes, unrotate,
)
from stellax.ops.paged_attention import paged_inputs, ragged_inputs
from stellax.testing import assert_close


@pytest.mark.parametrize("bits", [2, 4])
def test_pack_unpack_exact(bits):
    codes = jax.random.randint(jax.random.PRNGKey(bits), (3, 5, 64), 0, 2**bits).astype(jnp.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 64 * bits // 8) and packed.dtype == jnp.uint8
    np.testing.assert_array_equal(np.asarray(unpack_codes(packed, bits)), np.asarray(codes))
    # little end first: byte 0 holds element 0 in its lowest bits
    assert int(packed[0, 0, 0]) & (2**bits - 1) == int(codes[0, 0, 0])


@pytest.mark.parametrize("fmt,group", [("int8", None), ("fp8", None), ("int4", 32), ("int2", 32), ("int4", 128)])
def test_error_bounds_per_bit_width(fmt, group):
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 2, 128), jnp.float32) * 3
    spec = KVQuant(fmt, group_size=group)
    q = quantize_pages(x, spec)
    xh = dequantize_pages(q)
    g = spec.group(128)
    xg = np.asarray(x).reshape(4, 16, 2, 128 // g, g)
    err = np.abs(np.asarray(xh) - np.asarray(x)).reshape(xg.shape)
    if fmt == "fp8":
        amax = np.abs(xg).max(-1, keepdims=True)
        # e4m3: 3 mantissa bits → relative error <= 2^-4, plus the subnormal step near 0
        bound = np.abs(xg) * 2.0**-4 + amax / 448 * 2.0**-9 + 1e-6
    elif spec.symmetric:
        bound = np.abs(xg).max(-1, keepdims=True) / 127 / 2 * (1 + 1e-3) + 1e-6
    else:
        rng_ = xg.max(-1, keepdims=True) - xg.min(-1, keepdims=True)
        bound = rng_ / spec.qmax / 2 * (1 + 2e-3) + np.abs(xg).max(-1, keepdims=True) * 2.0**-10
    assert np.all(err <= bound), float((err - bound).max())


def test_hadamard_is_orthonormal_and_rotation_preserves_dot_products():
    # jitted: op by op, each butterfly stage's primitives compiled one by one per shape (~10 s)
    wht, rot, unrot = jax.jit(hadamard), jax.jit(rotate), jax.jit(unrotate)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, 64), jnp.float32)
    np.testing.assert_allclose(np.asarray(wht(wht(x))), np.asarray(x), atol=1e-5)
    h = np.asarray(wht(jnp.eye(8)))
    np.testing.assert_allclose(h @ h.T, np.eye(8), atol=1e-6)
    assert np.allclose(np.abs(h), 1 / np.sqrt(8))
    signs = rotation_signs(64, seed=3)
    q, k = x[:2], x[2:]
    np.testing.assert_allclose(np.asarray(rot(q, signs) @ rot(k, signs).T), np.asarray(q @ k.T), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_allclose(np.asarray(unrot(rot(x, signs), signs)), np.asarray(x), atol=1e-5)


def test_rotation_spreads_outlier_channels():
    x = jax.random.normal(jax.random.PRNGKey(2), (8, 16, 2, 128), jnp.float32)
    x = x.at[..., jnp.asarray([3, 70])].multiply(20.0)
    errs = {}
    for rot in (False, True):
        xh = dequantize_pages(quantize_pages(x, KVQuant("int4", group_size=32, rotation=rot)))
        errs[rot] = float(jnp.linalg.norm(xh - x) / jnp.linalg.norm(x))
    assert errs[True] < 0.7 * errs[False], errs


FORMATS = [KVQuant("int8"), KVQuant("fp8"), KVQuant("int4", group_size=32),
           KVQuant("int2", group_size=32, rotation=True), KVQuant("int4", group_axis="token", group_size=8),
           KVQuant("int2", group_size=64, sink_tokens=4, recent_tokens=16, rotation=True)]


@pytest.mark.parametrize("spec", FORMATS, ids=lambda s: f"{s.format}-{s.group_axis}-rot{int(s.rotation)}-w{s.window}")
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_paged_attention_quantized_matches_golden(spec, impl):
    value_spec = KVQuant(spec.format, group_size=spec.group_size if spec.group_axis == "head_dim" else None,
                         rotation=spec.rotation, sink_tokens=spec.sink_tokens, recent_tokens=spec.recent_tokens)
    q, k, v, t, l = paged_inputs(5, lengths=[0, 3, 16, 45, 70], page_size=16, kv_heads=2, q_heads=8, head_dim=64,
                                 dtype=jnp.float32, quant=spec, value_quant=value_spec, q_tokens=2)
    kw = dict(sinks=jnp.linspace(-1, 1, 8))
    cfg = PagedConfig(pages_per_block=2, num_splits=2) if impl == "triton" else None
    with stellax.interpret_mode(impl == "triton"):
        out = paged_attention(q, k, v, t, l, implementation=impl, config=cfg, **kw)
    ref = jax.jit(functools.partial(paged_attention_op.reference, **kw))(q, k, v, t, l)
    assert_close(out, ref)


def test_quantized_attention_error_vs_exact_cache_per_bit_width():
    q, k, v, t, l = paged_inputs(6, lengths=[40, 64], page_size=16, kv_heads=2, q_heads=4, head_dim=64,
                                 dtype=jnp.float32)
    ref = jax.jit(paged_attention_op.reference)
    exact = ref(q, k, v, t, l)
    errors = {}
    for fmt in ("int8", "fp8", "int4", "int2"):
        spec = KVQuant(fmt, group_size=32 if fmt in ("int4", "int2") else None)
        out = ref(q, quantize_pages(k, spec), quantize_pages(v, spec), t, l)
        errors[fmt] = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
    assert errors["int8"] < 0.01 and errors["fp8"] < 0.05 and errors["int4"] < 0.15 and errors["int2"] < 0.8, errors
    assert errors["int8"] < errors["int4"] < errors["int2"], errors


def test_ragged_quantized_triton():
    spec = KVQuant("int4", group_size=32, rotation=True)
    q, k, v, kv_lens, t, cu, n = ragged_inputs(7, q_lens=[1, 9, 2], kv_lens=[30, 9, 50], page_size=16,
                                               kv_heads=2, q_heads=4, head_dim=64, dtype=jnp.bfloat16,
                                               padding_seqs=1, padding_tokens=2, quant=spec)
    with stellax.interpret_mode():
        out = ragged_paged_attention(q, k, v, kv_lens, t, cu, n, implementation="triton",
                                     config=RaggedConfig(block_q=4, pages_per_block=1, num_splits=2))
    assert_close(out, jax.jit(ragged_paged_attention_op.reference)(q, k, v, kv_lens, t, cu, n))


def test_bytes_per_token():
    assert KVQuant("int8").bytes_per_token(128) == 128 + 4
    assert KVQuant("int4", group_size=32).bytes_per_token(128, num_heads=2) == 2 * (64 + 4 * 2 * 2)
    assert KVQuant("int2", group_size=64, scale_dtype=jnp.bfloat16).bytes_per_token(128) == 32 + 2 * 2 * 2


def test_format_validation():
    with pytest.raises(ValueError, match="format"):
        KVQuant("int3")
    with pytest.raises(ValueError, match="group_axis"):
        KVQuant("int4", group_axis="heads")
    with pytest.raises(ValueError, match="group_size 48 must divide head_dim 64"):
        quantize_pages(jnp.zeros((2, 4, 1, 64)), KVQuant("int4", group_size=48))
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        quantize_pages(jnp.zeros((2, 4, 1, 48)), KVQuant("int8", rotation=True))
