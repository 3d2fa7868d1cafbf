"""The public API and the golden: jax.nn equivalence, mask semantics, bad inputs."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import stellax
from stellax.ops.attention import (
    attention_backward_op, attention_fp8_op, attention_op, backward_kernels, base, dot_product_attention_varlen,
    mosaic_tpu, mosaic_tpu_backward, triton, triton_backward, xla_chunked,
)
from stellax.ops.attention.configs import SplashBackwardConfig, SplashConfig
from stellax.testing import assert_close

def jitted(fn):
    """``fn`` (an attention function) under ``jax.jit``: arrays traced, the rest static."""
    def call(*args, **kwargs):
        arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
        static = {k: v for k, v in kwargs.items() if k not in arrays}
        return jax.jit(functools.partial(fn, **static))(*args, **arrays)
    return call


dpa = jitted(stellax.dot_product_attention)
IMPLS = tuple(i for i in ("xla", "xla_chunked") if i in stellax.ops.attention.attention_op.implementations)


def qkv(seed, b, t, s, n, k, h, hv=None, dtype=jnp.float32):
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
    hv = h if hv is None else hv
    return (jax.random.normal(kq, (b, t, n, h)).astype(dtype), jax.random.normal(kk, (b, s, k, h)).astype(dtype),
            jax.random.normal(kv, (b, s, k, hv)).astype(dtype))


def naive(q, k, v, allowed, *, scale=None, bias=None, cap=None, sinks=None):
    """Float64 numpy attention with an explicit [B, N, T, S] visibility array."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    g = n // k.shape[2]
    k, v = np.repeat(k, g, axis=2), np.repeat(v, g, axis=2)
    scale = 1 / np.sqrt(h) if scale is None else scale
    s = np.einsum("btnh,bsnh->bnts", q, k) * scale
    if cap is not None:
        s = cap * np.tanh(s / cap)
    if bias is not None:
        s = s + np.asarray(bias, np.float64)
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        m = np.maximum(m, np.asarray(sinks, np.float64)[None, :, None, None])
    m = np.where(np.isfinite(m), m, 0)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    if sinks is not None:
        l = l + np.exp(np.asarray(sinks, np.float64)[None, :, None, None] - m)
    o = np.einsum("bnts,bsnh->btnh", p, v) / np.where(l > 0, l, 1).transpose(0, 2, 1, 3)
    lse = np.where(l[..., 0] > 0, m[..., 0] + np.log(np.where(l[..., 0] > 0, l[..., 0], 1)), -np.inf)
    return o, lse


def allowed_matrix(t, s, *, causal=False, window=None, chunk=None):
    qp = np.arange(t)[:, None] + s - t
    kp = np.arange(s)[None, :]
    ok = np.ones((t, s), bool)
    if causal or chunk:
        ok &= kp <= qp
    if window is not None:
        ok &= (kp >= qp - window[0]) & (kp <= qp + window[1])
    if chunk:
        ok &= (qp // chunk) == (kp // chunk)
    return ok[None, None]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("kwargs", [
    {}, {"is_causal": True}, {"local_window_size": (5, 3)}, {"local_window_size": 4, "is_causal": True},
    {"scale": 0.3},
])
def test_matches_jax_nn(impl, kwargs):
    q, k, v = qkv(0, 2, 40, 40, 8, 2, 32)
    with jax.default_matmul_precision("highest"):
        ours = dpa(q, k, v, implementation=impl, **kwargs)
        theirs = jax.nn.dot_product_attention(q, k, v, **kwargs)
    assert_close(ours, theirs, rel_l2_tolerance=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_matches_jax_nn_bias_mask_lengths(impl):
    q, k, v = qkv(1, 2, 24, 24, 4, 4, 16)
    bias = jax.random.normal(jax.random.PRNGKey(3), (2, 1, 24, 24))
    mask = jax.random.bernoulli(jax.random.PRNGKey(4), 0.9, (1, 4, 24, 24)) | jnp.eye(24, dtype=bool)
    ql, kl = jnp.array([20, 24], jnp.int32), jnp.array([24, 11], jnp.int32)
    with jax.default_matmul_precision("highest"):
        ours = dpa(q, k, v, bias, mask, query_seq_lengths=ql, key_value_seq_lengths=kl,
                                             implementation=impl)
        theirs = jax.nn.dot_product_attention(q, k, v, bias, mask, query_seq_lengths=ql, key_value_seq_lengths=kl)
    assert_close(ours, theirs, rel_l2_tolerance=1e-5)


def test_causal_alignment_differs_from_jax_when_t_ne_s():
    """Ours is bottom-right aligned (FlashAttention); jax.nn's tril is top-left."""
    q, k, v = qkv(2, 1, 4, 10, 2, 2, 8)
    ours = dpa(q, k, v, is_causal=True, implementation="xla")
    ref, _ = naive(q, k, v, allowed_matrix(4, 10, causal=True))
    assert_close(ours, ref.astype(np.float32), rel_l2_tolerance=1e-5)
    # The last query row sees every key (as in FlashAttention), not only the first 4.
    full = dpa(q, k, v, implementation="xla")
    np.testing.assert_allclose(ours[:, -1], full[:, -1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("t,s", [(1, 17), (17, 17), (33, 20), (20, 47)])
@pytest.mark.parametrize("mask_kind", ["causal", "window", "chunk", "window_causal"])
def test_masks_against_numpy(impl, t, s, mask_kind):
    q, k, v = qkv(t * s, 2, t, s, 4, 2, 16, 24)
    opts = {"causal": dict(is_causal=True), "window": dict(local_window_size=(6, 2)),
            "chunk": dict(chunk_size=8), "window_causal": dict(local_window_size=(5, 9), is_causal=True)}[mask_kind]
    allowed = allowed_matrix(t, s, causal=opts.get("is_causal", False), window=(
        None if "local_window_size" not in opts else opts["local_window_size"]), chunk=opts.get("chunk_size"))
    if mask_kind == "window_causal":
        allowed = allowed & allowed_matrix(t, s, causal=True)
    out, lse = dpa(q, k, v, return_residuals=True, implementation=impl, **opts)
    ref, ref_lse = naive(q, k, v, allowed)
    assert_close(out, ref.astype(np.float32), rel_l2_tolerance=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)
    assert lse.shape == (2, 4, t) and lse.dtype == jnp.float32


@pytest.mark.parametrize("impl", IMPLS)
def test_softcap_sinks_bias(impl):
    q, k, v = qkv(5, 2, 19, 23, 4, 1, 16)
    bias = jax.random.normal(jax.random.PRNGKey(6), (1, 4, 19, 23))
    sinks = jax.random.normal(jax.random.PRNGKey(7), (4,))
    out, lse = dpa(q, k, v, bias, logits_soft_cap=2.0, sinks=sinks, is_causal=True,
                                             return_residuals=True, implementation=impl)
    ref, ref_lse = naive(q, k, v, allowed_matrix(19, 23, causal=True), bias=bias, cap=2.0, sinks=sinks)
    assert_close(out, ref.astype(np.float32), rel_l2_tolerance=2e-5)
    np.testing.assert_allclose(np.asarray(lse), ref_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_segments(impl):
    q, k, v = qkv(8, 2, 30, 30, 2, 2, 16)
    seg = jnp.asarray(np.sort(np.random.default_rng(0).integers(0, 4, (2, 30)), axis=1), jnp.int32)
    out = dpa(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, is_causal=True,
                                        implementation=impl)
    allowed = (np.asarray(seg)[:, None, :, None] == np.asarray(seg)[:, None, None, :]) & allowed_matrix(
        30, 30, causal=True)
    ref, _ = naive(q, k, v, allowed)
    assert_close(out, ref.astype(np.float32), rel_l2_tolerance=2e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_zero_output_and_grads(impl):
    q, k, v = qkv(9, 1, 8, 8, 2, 2, 8)
    mask = jnp.ones((1, 1, 8, 8), bool).at[:, :, 3].set(False)
    ql = jnp.array([6], jnp.int32)

    def f(q, k, v):
        out, lse = dpa(q, k, v, mask=mask, query_seq_lengths=ql, return_residuals=True,
                                                 implementation=impl)
        return out, lse

    out, lse = f(q, k, v)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(np.asarray(out[:, 3]), 0)
    np.testing.assert_array_equal(np.asarray(out[:, 6:]), 0)
    assert np.all(np.isneginf(np.asarray(lse[:, :, 3])))
    grads = jax.grad(lambda *a: jnp.sum(f(*a)[0] ** 2) + jnp.sum(jnp.where(jnp.isfinite(f(*a)[1]), f(*a)[1], 0)),
                     argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert np.isfinite(np.asarray(g)).all()
    np.testing.assert_array_equal(np.asarray(grads[0][:, 3]), 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_gqa_equals_repeated_heads_and_extra_batch_dims(impl):
    q, k, v = qkv(10, 6, 12, 12, 8, 2, 16, 8)
    grouped = dpa(q, k, v, is_causal=True, implementation=impl)
    repeated = dpa(q, jnp.repeat(k, 4, 2), jnp.repeat(v, 4, 2), is_causal=True,
                                             implementation=impl)
    assert_close(grouped, repeated, rel_l2_tolerance=1e-6)
    batched = dpa(q.reshape(2, 3, 12, 8, 16), k.reshape(2, 3, 12, 2, 16),
                                            v.reshape(2, 3, 12, 2, 8), is_causal=True, implementation=impl)
    assert batched.shape == (2, 3, 12, 8, 8)
    assert_close(batched.reshape(grouped.shape), grouped, rel_l2_tolerance=1e-6)
    unbatched = dpa(q[0], k[0], v[0], is_causal=True, implementation=impl)
    assert_close(unbatched, grouped[0], rel_l2_tolerance=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence(impl, causal):
    lens_q, lens_k = [5, 17, 1, 30], [9, 17, 4, 30]
    cu_q = jnp.array(np.concatenate([[0], np.cumsum(lens_q)]), jnp.int32)
    cu_k = jnp.array(np.concatenate([[0], np.cumsum(lens_k)]), jnp.int32)
    n, kh, h = 4, 2, 16
    q = jax.random.normal(jax.random.PRNGKey(0), (sum(lens_q) + 3, n, h))  # 3 padding tokens
    k = jax.random.normal(jax.random.PRNGKey(1), (sum(lens_k), kh, h))
    v = jax.random.normal(jax.random.PRNGKey(2), (sum(lens_k), kh, h))
    out, lse = jitted(dot_product_attention_varlen)(q, k, v, cu_q, cu_k, max_seqlen_q=max(lens_q),
                                                    max_seqlen_k=max(lens_k), is_causal=causal,
                                            local_window_size=(7, None), return_residuals=True,
                                            implementation=impl)
    assert out.shape == q.shape and lse.shape == (n, q.shape[0])
    for i in range(len(lens_q)):
        qs, ks = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref = dpa(q[None, qs], k[None, ks], v[None, ks], is_causal=causal,
                                            local_window_size=(7, None), implementation="xla")
        assert_close(out[qs], ref[0], rel_l2_tolerance=1e-5)
    np.testing.assert_array_equal(np.asarray(out[-3:]), 0)


# -- bad inputs ------------------------------------------------------------------
def _bad(**over):
    q, k, v = qkv(0, 2, 8, 8, 4, 2, 16)
    args = dict(query=q, key=k, value=v)
    args.update(over)
    return args


@pytest.mark.parametrize("over,exc,match", [
    (dict(key=jnp.zeros((2, 8, 3, 16)), value=jnp.zeros((2, 8, 3, 16))), ValueError, "multiple"),
    (dict(key=jnp.zeros((2, 8, 2, 32)), value=jnp.zeros((2, 8, 2, 32))), ValueError, "head dim"),
    (dict(value=jnp.zeros((2, 9, 2, 16))), ValueError, "value"),
    (dict(key=jnp.zeros((2, 8, 2, 16), jnp.bfloat16)), TypeError, "dtype"),
    (dict(bias=jnp.zeros((2, 3, 8, 8))), ValueError, "bias"),
    (dict(mask=jnp.ones((2, 4, 8, 7), bool)), ValueError, "mask"),
    (dict(mask=jnp.ones((2, 4, 8, 8), jnp.float32)), TypeError, "bool"),
    (dict(local_window_size=-1), ValueError, "negative"),
    (dict(local_window_size=(3, -2)), ValueError, "right"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(q_segment_ids=jnp.zeros((2, 7), jnp.int32), kv_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError,
     "q_segment_ids"),
    (dict(q_segment_ids=jnp.zeros((2, 8), jnp.int32)), ValueError, "both"),
    (dict(q_segment_ids=jnp.zeros((2, 8)), kv_segment_ids=jnp.zeros((2, 8))), TypeError, "integer"),
    (dict(query_seq_lengths=jnp.zeros((3,), jnp.int32)), ValueError, "query_seq_lengths"),
    (dict(sinks=jnp.zeros((2,))), ValueError, "sinks"),
    (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    (dict(query=jnp.zeros((8, 4))), ValueError, "rank"),
    (dict(query=jnp.zeros((2, 8, 4, 16), jnp.int32)), TypeError, "query"),
    (dict(implementation="nope"), ValueError, "implementation"),
])
def test_bad_inputs(over, exc, match):
    with pytest.raises(exc, match=match):
        dpa(**_bad(**over))


def test_triton_on_cpu_without_interpret_explains():
    if "triton" not in stellax.ops.attention.attention_op.implementations:
        pytest.skip("no triton implementation registered")
    with pytest.raises(stellax.UnsupportedError, match="GPU"):
        dpa(*qkv(0, 1, 8, 8, 2, 2, 16), implementation="triton")


def test_implementations_are_generated_from_the_backend_table():
    """Each implementation's ``run`` is bound to its row of the family's backend
    table (its kernels: no lookup by name); fp8 attention has the same
    implementations but the Mosaic TPU kernel; the backward kernels are the
    table's flash rows, and the golden is differentiated by autodiff."""
    table = base.BACKENDS
    assert table.names == ("mosaic_tpu", "triton", "xla_chunked", "xla")
    assert list(attention_op.implementations) == list(table.names)
    assert list(attention_fp8_op.implementations) == ["triton", "xla_chunked", "xla"]
    assert list(attention_backward_op.implementations) == list(table.names)
    for name, forward, backward in (("mosaic_tpu", mosaic_tpu.forward, mosaic_tpu_backward.backward),
                                    ("triton", triton.forward, triton_backward.backward),
                                    ("xla_chunked", xla_chunked.forward, xla_chunked.backward)):
        kernels = table.kernels(name)
        assert kernels.forward is forward and kernels.backward is backward and kernels.flash
    assert not table.kernels("xla").flash
    for op in (attention_op, attention_fp8_op, attention_backward_op):
        for name, impl in op.implementations.items():
            assert impl.run.args == (table[name],), (op.name, name)
    assert attention_op.implementations["mosaic_tpu"].config_type is SplashConfig
    assert attention_backward_op.implementations["mosaic_tpu"].config_type is SplashBackwardConfig
    assert backward_kernels() == ("mosaic_tpu", "triton", "xla_chunked")


def test_empty_batch_or_no_query_rows_give_empty_outputs():
    """B = 0 or T = 0: empty outputs of the right shapes (not an error), after
    the same shape checks as any call."""
    k, v = jnp.ones((2, 16, 2, 64)), jnp.ones((2, 16, 2, 32))
    assert stellax.dot_product_attention(jnp.zeros((2, 0, 4, 64)), k, v).shape == (2, 0, 4, 32)
    out, lse = stellax.dot_product_attention(jnp.zeros((0, 8, 4, 64)), jnp.ones((0, 16, 2, 64)),
                                             jnp.ones((0, 16, 2, 32)), return_residuals=True)
    assert out.shape == (0, 8, 4, 32) and lse.shape == (0, 4, 8) and lse.dtype == jnp.float32
    with pytest.raises(ValueError, match="key: expected head dim 64"):
        stellax.dot_product_attention(jnp.zeros((2, 0, 4, 64)), v, v)
    with pytest.raises(ValueError, match="key: expected batch dims"):
        stellax.dot_product_attention(jnp.zeros((2, 0, 4, 64)), jnp.ones((3, 16, 2, 64)), v)
