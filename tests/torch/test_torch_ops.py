"""stellax.torch front ends: opcheck, forward and gradients vs plain torch and
vs the JAX ops."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax  # noqa: E402
import stellax.torch as st  # noqa: E402
from stellax.torch import attention as st_attention  # noqa: E402
from stellax.torch import glu as st_glu  # noqa: E402
from stellax.torch import norm as st_norm  # noqa: E402

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
       torch.float16: dict(atol=4e-3, rtol=4e-3)}


def _grads(out, inputs, cotangent):
    return torch.autograd.grad(out, [t for t in inputs if t is not None], cotangent)


def _leaf(t):
    return t.detach().clone().requires_grad_(True)


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# -- norms ------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_layer_norm_matches_torch(dtype):
    torch.manual_seed(0)
    x = _leaf(torch.randn(3, 5, 48).to(dtype))
    w = _leaf((1 + 0.1 * torch.randn(48)).to(dtype))
    b = _leaf((0.1 * torch.randn(48)).to(dtype))
    y = st.layer_norm(x, w, b, eps=1e-5)
    ref = F.layer_norm(x.float(), (48,), w.float(), b.float(), 1e-5)
    assert y.dtype == dtype
    torch.testing.assert_close(y.float(), ref, **TOL[dtype])
    g = torch.randn_like(ref)
    for got, want in zip(_grads(y, (x, w, b), g.to(dtype)), _grads(ref, (x, w, b), g)):
        assert _rel(got.float(), want.float()) < (1e-5 if dtype == torch.float32 else 2e-2)


def test_rms_norm_matches_torch_and_jax():
    torch.manual_seed(1)
    x = _leaf(torch.randn(4, 33))
    w = _leaf(torch.randn(33))
    y = st.rms_norm(x, w, eps=1e-6)
    torch.testing.assert_close(y, F.rms_norm(x, (33,), w, 1e-6), atol=2e-5, rtol=2e-5)
    jax_y = stellax.rms_norm(jnp.asarray(x.detach().numpy()), jnp.asarray(w.detach().numpy()), epsilon=1e-6)
    np.testing.assert_allclose(y.detach().numpy(), np.asarray(jax_y), atol=1e-6, rtol=1e-6)
    g = torch.randn_like(y)
    got = _grads(y, (x, w), g)
    want = _grads(F.rms_norm(x, (33,), w, 1e-6), (x, w), g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=3e-5, rtol=3e-5)


def test_fused_residual_norm_gradients():
    torch.manual_seed(2)
    x, r, w = _leaf(torch.randn(6, 40)), _leaf(torch.randn(6, 40)), _leaf(torch.randn(40))
    y, h = st.rms_norm(x, w, residual=r)
    ref_h = x + r
    ref_y = F.rms_norm(ref_h, (40,), w, 1e-6)
    torch.testing.assert_close(h, ref_h)
    torch.testing.assert_close(y, ref_y, atol=2e-5, rtol=2e-5)
    gy, gh = torch.randn_like(y), torch.randn_like(h)
    got = torch.autograd.grad((y * gy).sum() + (h * gh).sum(), (x, r, w))
    want = torch.autograd.grad((ref_y * gy).sum() + (ref_h * gh).sum(), (x, r, w))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_norm_opcheck():
    x, w, b = torch.randn(4, 16, requires_grad=True), torch.randn(16, requires_grad=True), torch.randn(16)
    torch.library.opcheck(st_norm.layer_norm_op.op, (x, w, b, 1e-5, True, None))
    torch.library.opcheck(st_norm.layer_norm_op.op, (x, None, None, 1e-5, False, None))
    torch.library.opcheck(st_norm.layer_norm_residual_op.op, (x, torch.randn(4, 16, requires_grad=True), w, None,
                                                              1e-6, False, None))


# -- gated linear unit -------------------------------------------------------------------------
@pytest.mark.parametrize("activation,torch_act", [("silu", F.silu), ("gelu", F.gelu),
                                                  ("gelu_tanh", lambda v: F.gelu(v, approximate="tanh"))])
def test_gated_linear_unit_matches_torch(activation, torch_act):
    torch.manual_seed(3)
    x = _leaf(torch.randn(2, 5, 24))
    wg, wu = _leaf(torch.randn(24, 40) * 0.2), _leaf(torch.randn(24, 40) * 0.2)
    y = st.gated_linear_unit(x, wg, wu, activation=activation)
    ref = torch_act(x @ wg) * (x @ wu)
    torch.testing.assert_close(y, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(y)
    for a, b in zip(_grads(y, (x, wg, wu), g), _grads(ref, (x, wg, wu), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_gated_linear_unit_stacked_weights_bf16_and_opcheck():
    torch.manual_seed(4)
    x = torch.randn(7, 16).to(torch.bfloat16)
    w = (torch.randn(16, 2, 24) * 0.3).to(torch.bfloat16)
    y = st.gated_linear_unit(x, w)
    ref = F.silu(x.float() @ w[:, 0].float()) * (x.float() @ w[:, 1].float())
    assert y.dtype == torch.bfloat16 and _rel(y.float(), ref) < 1e-2
    torch.library.opcheck(st_glu.gated_linear_unit_op.op, (x.float().requires_grad_(), w.float().requires_grad_(),
                                                            None, "silu", None, None))


# -- attention ------------------------------------------------------------------------------
def _sdpa_reference(q, k, v, *, is_causal=False, mask=None, bias=None, scale=None):
    """torch SDPA on [B, T, N, H] with GQA by repeating K/V and bottom-right causal."""
    n, kh = q.shape[2], k.shape[2]
    k = k.repeat_interleave(n // kh, dim=2)
    v = v.repeat_interleave(n // kh, dim=2)
    t, s = q.shape[1], k.shape[1]
    attn = None
    if is_causal:
        attn = torch.ones(t, s, dtype=torch.bool).tril(s - t)
    if mask is not None:
        attn = mask if attn is None else attn & mask
    if bias is not None:
        additive = bias if attn is None else bias.masked_fill(~attn, float("-inf"))
        attn = additive
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn, scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("t,s,n,kh,causal", [(5, 5, 4, 4, False), (6, 9, 4, 2, True), (9, 9, 8, 1, True)])
def test_attention_matches_sdpa(t, s, n, kh, causal):
    torch.manual_seed(t * s + n)
    q = _leaf(torch.randn(2, t, n, 16))
    k, v = _leaf(torch.randn(2, s, kh, 16)), _leaf(torch.randn(2, s, kh, 16))
    out = st.dot_product_attention(q, k, v, is_causal=causal)
    ref = _sdpa_reference(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_attention_mask_bias_and_their_gradients():
    torch.manual_seed(5)
    q, k, v = _leaf(torch.randn(2, 7, 4, 8)), _leaf(torch.randn(2, 11, 2, 8)), _leaf(torch.randn(2, 11, 2, 8))
    bias = _leaf(torch.randn(1, 4, 7, 11))
    mask = torch.rand(2, 1, 7, 11) > 0.3
    mask[..., 0] = True  # no fully masked rows here (SDPA gives NaN for those)
    out = st.dot_product_attention(q, k, v, bias, mask, scale=0.3)
    ref = _sdpa_reference(q, k, v, mask=mask, bias=bias.expand(2, 4, 7, 11).masked_fill(~mask, float("-inf")), scale=0.3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v, bias), g), _grads(ref, (q, k, v, bias), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)


def test_attention_segments_and_lengths_match_dense_masks():
    torch.manual_seed(6)
    q, k, v = torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8), torch.randn(2, 8, 2, 8)
    seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 1, 1]])
    out = st.dot_product_attention(q, k, v, q_segment_ids=seg, kv_segment_ids=seg, is_causal=True)
    dense = (seg[:, :, None] == seg[:, None, :])[:, None]
    ref = _sdpa_reference(q, k, v, mask=dense, is_causal=True)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    lengths = torch.tensor([5, 8])
    out = st.dot_product_attention(q, k, v, key_value_seq_lengths=lengths)
    ref = _sdpa_reference(q, k, v, mask=(torch.arange(8)[None, :] < lengths[:, None])[:, None, None, :])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_attention_matches_jax_and_bf16():
    torch.manual_seed(7)
    q, k, v = torch.randn(1, 9, 4, 32), torch.randn(1, 9, 2, 32), torch.randn(1, 9, 2, 32)
    out = st.dot_product_attention(q, k, v, is_causal=True, local_window_size=(3, 0))
    jq, jk, jv = (jnp.asarray(a.numpy()) for a in (q, k, v))
    want = stellax.dot_product_attention(jq, jk, jv, is_causal=True, local_window_size=(3, 0))
    np.testing.assert_allclose(out.numpy(), np.asarray(want), atol=1e-6, rtol=1e-6)
    out16 = st.dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True,
                                     local_window_size=(3, 0))
    assert out16.dtype == torch.bfloat16 and _rel(out16.float(), out) < 1e-2


def test_attention_opcheck():
    q = torch.randn(2, 5, 4, 8, requires_grad=True)
    k, v = torch.randn(2, 6, 2, 8, requires_grad=True), torch.randn(2, 6, 2, 8, requires_grad=True)
    none6 = (None,) * 6
    op = st_attention.dot_product_attention_op.op
    torch.library.opcheck(op, (q, k, v, *none6, None, None, True, None, None, None, None, None))
    seg = torch.ones(2, 5, dtype=torch.int32), torch.tensor([[1, 1, 1, 1, 0, 0]] * 2, dtype=torch.int32)
    bias = torch.randn(2, 4, 5, 6, requires_grad=True)
    torch.library.opcheck(op, (q, k, v, bias, None, *seg, None, None, None, 0.5, False, None, None, None, 3,
                               "highest"))


def test_attention_varlen_matches_per_sequence_calls():
    torch.manual_seed(8)
    cu = torch.tensor([0, 3, 10, 12])
    q, k, v = _leaf(torch.randn(12, 4, 8)), _leaf(torch.randn(12, 2, 8)), _leaf(torch.randn(12, 2, 8))
    out = st.dot_product_attention_varlen(q, k, v, cu, cu, 7, 7, is_causal=True)
    ref = torch.cat([_sdpa_reference(q[None, a:b], k[None, a:b], v[None, a:b], is_causal=True)[0]
                     for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
    torch.library.opcheck(st_attention.dot_product_attention_varlen_op.op,
                          (q, k, v, cu.to(torch.int32), cu.to(torch.int32), None, 7, 7, None, True, None, None, None,
                           None, None))


def test_backward_computes_only_the_gradients_autograd_asks_for():
    from stellax.torch import registry

    torch.manual_seed(9)
    x = _leaf(torch.randn(4, 17))
    w = torch.randn(17)  # frozen: no gradient wanted
    y = st.rms_norm(x, w)
    (gx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    torch.testing.assert_close(gx, torch.autograd.grad(F.rms_norm(x, (17,), w, 1e-6), x, torch.ones_like(y))[0],
                               atol=2e-5, rtol=2e-5)
    wanted = [key[-1] for key in list(registry._cache)
              if key[:2] == ("layer_norm", "vjp") and key[2][0][0] == (4, 17)]
    assert wanted == [(0,)]  # the VJP was built for x (position 0) only
    torch.library.opcheck(st_norm.layer_norm_op.op, (x, w, None, 1e-6, False, None))


# -- fp8 attention ----------------------------------------------------------------------------
@pytest.mark.parametrize("scales", ["token", "head"])
def test_fp8_attention_matches_jax_and_dequantized_sdpa(scales):
    from stellax.ops.attention import quantize_for_attention as jqfa
    from stellax.ops import quant as jquant
    torch.manual_seed(20)
    q = _leaf(torch.randn(1, 12, 4, 16).bfloat16())
    k, v = torch.randn(1, 12, 2, 16), torch.randn(1, 12, 2, 16)
    qk, qv = st.quantize_for_attention(k, scales=scales), st.quantize_for_attention(v, scales=scales)
    assert qk.values.dtype == torch.float8_e4m3fn
    out = st.dot_product_attention(q, qk, qv, is_causal=True)
    assert out.dtype == torch.bfloat16
    jk, jv = jqfa(jnp.asarray(k.numpy()), scales=scales), jqfa(jnp.asarray(v.numpy()), scales=scales)
    np.testing.assert_array_equal(qk.scales.numpy(), np.asarray(jk.scales))
    jq = jnp.asarray(q.detach().float().numpy()).astype(jnp.bfloat16)
    ref = stellax.dot_product_attention(jq, jk, jv, is_causal=True)
    np.testing.assert_allclose(out.detach().float().numpy(), np.asarray(ref.astype(jnp.float32)), atol=1e-2,
                               rtol=1e-2)
    # Attention over the dequantized K/V (torch SDPA): the float query gets its true gradient.
    dk, dv = (st.dequantize(t).repeat_interleave(2, 2) for t in (qk, qv))
    qf = _leaf(q.detach().float())
    sdpa = F.scaled_dot_product_attention(qf.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)
    assert _rel(out.float(), sdpa) < 1e-2
    g = torch.randn_like(sdpa)
    (gq,) = torch.autograd.grad(out.float(), q, g)
    (gref,) = torch.autograd.grad(sdpa, qf, g)
    assert _rel(gq.float(), gref) < 2e-2
    del jquant


def test_fp8_attention_opcheck_and_errors():
    from stellax.torch import attention_fp8 as st_fp8
    torch.manual_seed(21)
    q = torch.randn(1, 8, 2, 16, requires_grad=True)
    qk = st.quantize_for_attention(torch.randn(1, 8, 2, 16), "fp8_e4m3", scales="tensor")
    qv = st.quantize_for_attention(torch.randn(1, 8, 2, 16))
    # The flat custom-op arguments: the float query, then each QTensor as its tensors and statics.
    args = st_fp8.dot_product_attention_fp8_op.flatten(q, qk, qv, None, None, None, None, None, None, None, None,
                                                       False, None, None, "float32", None)
    # test_schema is left out: torch's SchemaCheckMode compares float8 inputs with a multiply that torch
    # does not implement for float8 on the CPU ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn).
    torch.library.opcheck(st_fp8.dot_product_attention_fp8_op.op, args,
                          test_utils=("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic"))
    torch.library.opcheck(st_fp8.quantize_for_attention_op.op, (torch.randn(1, 8, 2, 16), "fp8_e4m3", "head"))
    with pytest.raises(ValueError, match="preferred_element_type: only for fp8 attention"):
        st.dot_product_attention(q, q, q, preferred_element_type=torch.float32)
    with pytest.raises(ValueError, match="key: fp8 attention takes QTensors"):
        st.dot_product_attention(q, st.quantize(torch.randn(1, 8, 2, 16), "int4_asym", block_size=16), qv)


def test_chunked_attention_matches_sdpa_with_chunk_mask():
    torch.manual_seed(22)
    q, k, v = _leaf(torch.randn(1, 10, 2, 8)), _leaf(torch.randn(1, 10, 2, 8)), _leaf(torch.randn(1, 10, 2, 8))
    out = st.dot_product_attention(q, k, v, is_causal=True, chunk_size=4, precision="highest")
    pos = torch.arange(10)
    mask = (pos[:, None] >= pos[None, :]) & (pos[:, None] // 4 == pos[None, :] // 4)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask).transpose(1, 2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(out)
    for a, b in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g)):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=5e-5)
