"""Per-tensor KV scales (``KVQuant(group_axis="tensor")``), fp8 e5m2 codes and
pools that are one half of a combined ``[num_pages, page_size, 2, K, H]``
buffer (vLLM's fp8 pages, read in place): attention over them equals
dequantize-then-attend, on the XLA path, the Triton kernels (interpreted)
and the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.paged_attention import (
    KVQuant, PagedConfig, RaggedConfig, dequantize_pages, paged_attention, paged_attention_op, quantize_pages,
    ragged_paged_attention, ragged_paged_attention_op, update_kv_cache,
)
from stellax.ops.paged_attention.quant_cache import combined_quantized_pages, quantize_with_scale
from stellax.ops.paged_attention import paged_inputs, ragged_inputs
from stellax.testing import assert_close

def _combined(k, v, fmt, k_scale=0.02, v_scale=0.5):
    spec = KVQuant(fmt, group_axis="tensor")
    ks, vs = jnp.float32(k_scale), jnp.float32(v_scale)
    kv = jnp.stack([quantize_with_scale(k, ks, spec), quantize_with_scale(v, vs, spec)], axis=2)
    return kv, combined_quantized_pages(kv, ks, vs, spec)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_ragged_combined_tensor_scale_equals_dequantize_then_attend(fmt, impl):
    q, k, v, kv_lens, t, cu, n = ragged_inputs(7, q_lens=[1, 9, 2], kv_lens=[30, 9, 50], page_size=16, kv_heads=2,
                                               q_heads=4, head_dim=32, dtype=jnp.float32, padding_seqs=1,
                                               padding_tokens=2)
    kv, (kp, vp) = _combined(k, v, fmt)
    assert kp.shape == vp.shape == k.shape and kp.data is vp.data is kv          # one buffer, no copy
    dense = (dequantize_pages(kp), dequantize_pages(vp))
    np.testing.assert_array_equal(np.asarray(dense[0]), np.asarray(kv[:, :, 0].astype(jnp.float32) * 0.02))
    want = jax.jit(ragged_paged_attention_op.reference)(q, *dense, kv_lens, t, cu, n)
    ref = jax.jit(ragged_paged_attention_op.reference)(q, kp, vp, kv_lens, t, cu, n)
    np.testing.assert_array_equal(np.asarray(ref), np.asarray(want))
    cfg = RaggedConfig(block_q=4, pages_per_block=1, num_splits=2) if impl == "triton" else None
    with stellax.interpret_mode(impl == "triton"):
        out = ragged_paged_attention(q, kp, vp, kv_lens, t, cu, n, implementation=impl, config=cfg,
                                     sinks=jnp.linspace(-1, 1, 4), local_window_size=12)
    want = jax.jit(functools.partial(ragged_paged_attention_op.reference, sinks=jnp.linspace(-1, 1, 4),
                                     local_window_size=12))(q, *dense, kv_lens, t, cu, n)
    assert_close(out, want)


@pytest.mark.slow  # 8-14 s each (compiles); the ragged tests above cover the same kernels by default
@pytest.mark.parametrize("impl", ["xla", "triton"])
def test_paged_separate_tensor_scale_pools(impl):
    """Separate key / value pools with a per-tensor scale each (`quantize_pages`: amax / qmax), bfloat16 queries."""
    q, k, v, t, l = paged_inputs(5, lengths=[3, 16, 45], page_size=16, kv_heads=2, q_heads=4, head_dim=32,
                                 dtype=jnp.bfloat16)
    kp, vp = quantize_pages(k, KVQuant("fp8", group_axis="tensor")), quantize_pages(v, KVQuant("fp8_e5m2",
                                                                                                group_axis="tensor"))
    assert kp.scale.shape == () and kp.data.dtype == jnp.float8_e4m3fn and vp.data.dtype == jnp.float8_e5m2
    np.testing.assert_allclose(float(kp.scale), float(jnp.max(jnp.abs(k.astype(jnp.float32)))) / 448, rtol=1e-6)
    cfg = PagedConfig(pages_per_block=1, num_splits=1) if impl == "triton" else None
    with stellax.interpret_mode(impl == "triton"):
        out = paged_attention(q, kp, vp, t, l, implementation=impl, config=cfg)
    want = jax.jit(paged_attention_op.reference)(q, dequantize_pages(kp).astype(q.dtype),
                                                 dequantize_pages(vp).astype(q.dtype), t, l)
    # bfloat16 dense pools round the dequantized values; the quantized kernels keep codes · scale in float32.
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
    assert_close(out, jax.jit(paged_attention_op.reference)(q, kp, vp, t, l))


@pytest.mark.parametrize("fmt, mantissa_bits", [("fp8", 3), ("fp8_e5m2", 2)])
def test_tensor_scale_error_bound(fmt, mantissa_bits):
    x = jax.random.normal(jax.random.PRNGKey(0), (4, 16, 2, 64), jnp.float32) * 3
    qp = quantize_pages(x, KVQuant(fmt, group_axis="tensor"))
    err = np.abs(np.asarray(dequantize_pages(qp)) - np.asarray(x))
    s = float(qp.scale)
    smallest = {"fp8": 2.0 ** -9, "fp8_e5m2": 2.0 ** -16}[fmt]           # the subnormal step (times the scale)
    bound = np.abs(np.asarray(x)) * 2.0 ** -(mantissa_bits + 1) + s * smallest + 1e-7
    assert np.all(err <= bound), float((err - bound).max())


def test_tensor_scale_refusals():
    with pytest.raises(ValueError, match="group_axis: a per-tensor scale is for int8/fp8"):
        KVQuant("int4", group_axis="tensor")
    with pytest.raises(ValueError, match="KVQuant.part"):
        KVQuant("fp8", part=0)
    with pytest.raises(ValueError, match="KVQuant.part"):
        KVQuant("fp8", group_axis="tensor", part=2)
    kv = jnp.zeros((3, 16, 2, 2, 32), jnp.float8_e4m3fn)
    with pytest.raises(TypeError, match="kv_codes: expected dtype float8_e5m2"):
        combined_quantized_pages(kv, 1.0, 1.0, "fp8_e5m2")
    with pytest.raises(ValueError, match="kv_codes: expected"):
        combined_quantized_pages(kv[:, :, 0], 1.0, 1.0)
    with pytest.raises(ValueError, match="v_scale: expected a float32 scalar"):
        combined_quantized_pages(kv, 1.0, jnp.ones((2,)))
    kp = quantize_pages(jnp.ones((3, 16, 2, 32)), KVQuant("fp8", group_axis="tensor"))
    with pytest.raises(ValueError, match="update_kv_cache: a per-tensor .* quantize_with_scale"):
        update_kv_cache(kp, kp, jnp.ones((1, 2, 32)), jnp.ones((1, 2, 32)), jnp.array([5]))
