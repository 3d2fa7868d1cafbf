"""FP8 attention: `dot_product_attention` with fp8 `QArray` query/key/value.

Every path is compared with "dequantize (stellax.dequantize, float32) then the
float32 attention golden", on inputs whose heads and tokens have very
different magnitudes (so a scale applied to the wrong head/token, or not at
all, fails)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.core import use_configs
from stellax.ops.attention import attention_fp8_op, quantize_for_attention
from stellax.ops.attention.configs import ChunkedConfig, FlashBackwardConfig, FlashConfig
from stellax.testing import assert_close, lowering

SMALL = {("attention_fp8", "triton"): FlashConfig(block_q=16, block_k=32),
         ("attention_fp8", "xla_chunked"): ChunkedConfig(block_q=16, block_k=32),
         ("attention_backward", "triton"): FlashBackwardConfig(block_q=32, block_k=16),
         ("attention_backward", "xla_chunked"): ChunkedConfig(block_q=16, block_k=32)}


def operands(seed, b, t, s, n, kh, h, hv=None):
    hv = h if hv is None else hv
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    # Per-head and per-token magnitudes spanning ~2 decades.
    def spread(x):
        heads = 2.0 ** (jnp.arange(x.shape[2]) - x.shape[2] / 2)
        tokens = 1.0 + 3.0 * jax.random.uniform(jax.random.fold_in(keys[0], x.shape[1]), (x.shape[1],))
        return x * heads[None, None, :, None] * tokens[None, :, None, None]
    q = spread(jax.random.normal(keys[0], (b, t, n, h))) / 4
    k = spread(jax.random.normal(keys[1], (b, s, kh, h)))
    v = spread(jax.random.normal(keys[2], (b, s, kh, hv)))
    return q, k, v


def golden(q, k, v, **kwargs):
    """Independent path: stellax.dequantize to float32, then the float golden."""
    deq = lambda x: stellax.dequantize(x, jnp.float32) if isinstance(x, stellax.QArray) else x.astype(jnp.float32)
    return stellax.dot_product_attention(deq(q), deq(k), deq(v), implementation="xla", **kwargs)


def run(impl, q, k, v, **kwargs):
    with use_configs(SMALL), stellax.interpret_mode(impl == "triton"):
        return jax.jit(lambda q, k, v: stellax.dot_product_attention(q, k, v, implementation=impl, **kwargs))(q, k, v)


CASES = [  # (formats q/k/v, scale layouts q/k/v, causal, (b, t, s, n, kh, h))
    (("fp8_e4m3",) * 3, ("token", "token", "token"), True, (2, 33, 70, 4, 2, 40)),
    (("fp8_e5m2",) * 3, ("head", "head", "head"), False, (1, 45, 37, 4, 1, 32)),
    (("fp8_e4m3", "fp8_e5m2", "fp8_e4m3"), ("tensor", "head", "token"), True, (2, 70, 33, 8, 2, 16)),
    (("fp8_e5m2", "fp8_e4m3", "fp8_e5m2"), ("head", "tensor", "head"), False, (1, 17, 50, 4, 4, 24)),
]


@pytest.mark.parametrize("impl", ["xla_chunked", "triton", pytest.param("xla", marks=pytest.mark.slow)])
@pytest.mark.parametrize("formats,layouts,causal,dims", CASES)
def test_forward_matches_dequantized_golden(impl, formats, layouts, causal, dims):
    q, k, v = operands(sum(dims), *dims)
    qq, kq, vq = (quantize_for_attention(x, f, scales=sc) for x, f, sc in zip((q, k, v), formats, layouts))
    out, lse = run(impl, qq, kq, vq, is_causal=causal, return_residuals=True)
    ref, ref_lse = golden(qq, kq, vq, is_causal=causal, return_residuals=True)
    assert out.dtype == jnp.bfloat16 and out.shape == ref.shape
    assert_close(out, ref, dtype=jnp.bfloat16)
    assert_close(lse, ref_lse, dtype=jnp.bfloat16)
    # Sanity: fp8 attention approximates the unquantized attention (catches a wrong golden).
    exact = stellax.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
    rel = float(jnp.linalg.norm(out.astype(jnp.float32) - exact) / jnp.linalg.norm(exact))
    assert rel < (0.2 if "fp8_e5m2" in formats else 0.08), rel


def test_default_quantize_layout_and_mixed_float_query():
    """`quantize(x, fmt)` (per token and head along the head dim) works as is; a
    float query against fp8 K/V; float32 output; masks and sinks still apply."""
    q, k, v = operands(3, 2, 29, 41, 4, 2, 16)
    kq, vq = stellax.quantize(k, "fp8_e4m3"), stellax.quantize(v, "fp8_e5m2")
    q = q.astype(jnp.bfloat16)
    kwargs = dict(local_window_size=(9, 4), sinks=jnp.linspace(-1, 1, 4), preferred_element_type=jnp.float32,
                  key_value_seq_lengths=jnp.array([41, 30], jnp.int32))
    ref = golden(q, kq, vq, **{k_: a for k_, a in kwargs.items() if k_ != "preferred_element_type"})
    for impl in ("xla", "xla_chunked", "triton"):
        out = run(impl, q, kq, vq, **kwargs)
        assert out.dtype == jnp.float32
        assert_close(out, ref, dtype=jnp.bfloat16, name=impl)


def _loss(impl, **kwargs):
    def loss(q, k, v, bias):
        out = stellax.dot_product_attention(q, k, v, bias, implementation=impl, **kwargs)
        w = jax.random.normal(jax.random.PRNGKey(9), out.shape)
        return jnp.sum(out.astype(jnp.float32) * w)
    return loss


@pytest.mark.parametrize("impl", ["triton", pytest.param("xla_chunked", marks=pytest.mark.slow),
                                  pytest.param("xla", marks=pytest.mark.slow)])
def test_gradients_quantized_constant_float_exact(impl):
    """QArray operands get zero cotangents; a float query and the bias get the
    gradients of the attention of the dequantized operands."""
    q, k, v = operands(4, 1, 24, 40, 4, 2, 16)
    kq, vq = quantize_for_attention(k, "fp8_e4m3", scales="head"), quantize_for_attention(v, "fp8_e4m3")
    q = q.astype(jnp.bfloat16)
    bias = (0.3 * jax.random.normal(jax.random.PRNGKey(5), (1, 4, 24, 40))).astype(jnp.bfloat16)
    with use_configs(SMALL), stellax.interpret_mode(impl == "triton"):
        g = jax.jit(jax.grad(_loss(impl, is_causal=True), argnums=(0, 1, 2, 3)))(q, kq, vq, bias)
    dq, dk, dv, dbias = g
    assert isinstance(dk, stellax.QArray) and isinstance(dv, stellax.QArray)
    for leaf in jax.tree_util.tree_leaves((dk, dv)):
        np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0)
    deq = lambda x: stellax.dequantize(x, jnp.float32)
    ref_dq, ref_dbias = jax.grad(_loss("xla", is_causal=True), argnums=(0, 3))(
        q.astype(jnp.float32), deq(kq), deq(vq), bias.astype(jnp.float32))
    assert dq.dtype == jnp.bfloat16 and dbias.dtype == jnp.bfloat16
    assert_close(dq, ref_dq, dtype=jnp.bfloat16, gradient=True, name="dq")
    assert_close(dbias, ref_dbias, dtype=jnp.bfloat16, gradient=True, name="dbias")


def test_lowering_default_config():
    """The default tier's lowering check (the extended tier lowers every config): the config
    dispatch resolves, forward and the VJP of a float bias."""
    q, k, v = operands(0, 1, 64, 50, 4, 2, 64)
    args = (quantize_for_attention(q, "fp8_e4m3", scales="token"), quantize_for_attention(k, "fp8_e5m2", scales="head"),
            quantize_for_attention(v, "fp8_e4m3", scales="tensor"))
    assert lowering.check_op_lowering(attention_fp8_op, "triton", args, {"is_causal": True}, configs=[None]) == 1
    assert lowering.check_op_lowering(attention_fp8_op, "triton", args + (jnp.zeros((1, 4, 64, 50)),),
                                      {"is_causal": True}, configs=[None], grad=True) == 1


def test_lowering_every_forward_config():
    q, k, v = operands(0, 1, 256, 200, 4, 2, 64)
    args = (quantize_for_attention(q, "fp8_e4m3", scales="token"), quantize_for_attention(k, "fp8_e5m2", scales="head"),
            quantize_for_attention(v, "fp8_e4m3", scales="tensor"))
    call = attention_fp8_op.check(*args, is_causal=True)
    space = attention_fp8_op.implementations["triton"].config_space(call)
    assert len(space) >= 8
    n = lowering.check_op_lowering(attention_fp8_op, "triton", args, {"is_causal": True})
    assert n == len(space)
    # The VJP (float bias; the quantized operands are constants) lowers too.
    lowering.check_op_lowering(attention_fp8_op, "triton", args + (jnp.zeros((1, 4, 256, 200)),),
                               {"is_causal": True}, configs=[space[0]], grad=True)


@pytest.mark.ptx
def test_ptx_compiles_and_fits_smem():
    ok, reason = lowering.triton_compiler_available()
    if not ok:
        pytest.skip(reason)
    q, k, v = operands(0, 1, 512, 512, 4, 2, 128)
    args = tuple(quantize_for_attention(x, "fp8_e4m3", scales="head") for x in (q, k, v))
    call = attention_fp8_op.check(*args, is_causal=True)
    for config in attention_fp8_op.implementations["triton"].config_space(call):
        with use_configs({("attention_fp8", "triton"): config}):
            low = lowering.lower_for_gpu(lambda a: stellax.dot_product_attention(
                *a, is_causal=True, implementation="triton"), args)
        lowering.assert_fits_smem(lowering.compile_triton_to_ptx(low, "9.0"), "9.0")


# -- bad inputs ------------------------------------------------------------------------------
def test_bad_inputs():
    q, k, v = operands(1, 1, 32, 64, 4, 2, 16)
    kq = quantize_for_attention(k, "fp8_e4m3")
    with pytest.raises(ValueError, match="key: fp8 attention takes QArrays in"):
        stellax.dot_product_attention(q, stellax.quantize(k, "int8"), v)
    with pytest.raises(ValueError, match="value: fp8 attention takes QArrays in"):
        stellax.dot_product_attention(q, kq, stellax.quantize(v, "mxfp8_e4m3", block_size=32))
    # 16-token blocks along S split a dimension: unsupported scale layout, named.
    blocked = attention_fp8_op.check.__globals__["quantize_op"](k, format="fp8_e4m3", axis=-1,
                                                                  block_shape=(1, 16, 1, 16))
    with pytest.raises(ValueError, match="key: unsupported scale layout"):
        stellax.dot_product_attention(q, blocked, v)
    with pytest.raises(ValueError, match="query: unsupported scale layout"):
        stellax.dot_product_attention(stellax.quantize(q, "fp8_e4m3", axis=-1, block_size=8), kq, v)
    with pytest.raises(ValueError, match="query: a rotated QArray"):
        stellax.dot_product_attention(stellax.quantize(q, "fp8_e4m3", rotate=True), kq, v)
    with pytest.raises(TypeError, match="preferred_element_type"):
        stellax.dot_product_attention(q, kq, v, preferred_element_type=jnp.int8)
    with pytest.raises(ValueError, match="preferred_element_type: only for fp8"):
        stellax.dot_product_attention(q, k, v, preferred_element_type=jnp.float32)
    with pytest.raises(ValueError, match="key: expected head dim"):
        stellax.dot_product_attention(q, quantize_for_attention(k[..., :8], "fp8_e4m3"), v)
    with pytest.raises(TypeError, match="value: float operands of fp8 attention must share a dtype"):
        stellax.dot_product_attention(q, kq, v.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="scales: expected 'tensor', 'head' or 'token'"):
        quantize_for_attention(q, scales="block")


def test_builtin_examples_check_at_the_output_dtypes_tolerance_and_take_abstract_operands():
    """`stellax check` runs the op's examples: the bfloat16 output is held to
    bfloat16's tolerance (not float32's, which its bf16 tensor-core math cannot
    meet), and the check accepts abstract operands (the static GPU tier's)."""
    from stellax.testing.static_gpu import abstract_examples
    from stellax.testing.validation import check_example

    example = attention_fp8_op.examples(jnp.float32)[0]
    result = check_example(attention_fp8_op, "xla_chunked", example, jnp.float32)
    assert result.passed and result.worst.tolerance == 1e-2, result
    abstract = abstract_examples(lambda: attention_fp8_op.examples(jnp.bfloat16))[0]
    call = attention_fp8_op.check(*abstract.args, **abstract.kwargs)
    assert isinstance(call.arrays["k_scales"], jax.ShapeDtypeStruct)
    assert call.arrays["k_scales"].shape == (2, 128, 2)
