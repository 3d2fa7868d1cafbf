"""Paged-KV-cache attention front ends vs torch SDPA over the gathered cache."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax  # noqa: E402
import stellax.torch as st  # noqa: E402
from stellax.ops import paged_attention as jpaged  # noqa: E402
from stellax.torch import paged as st_paged  # noqa: E402

PAGE, PAGES, K, N, H = 4, 16, 2, 4, 8


def _cache(seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_pages = torch.randn(PAGES, PAGE, K, H, generator=gen)
    v_pages = torch.randn(PAGES, PAGE, K, H, generator=gen)
    tables = torch.randperm(PAGES, generator=gen)[:12].reshape(3, 4).to(torch.int32)
    return k_pages, v_pages, tables


def _reference(q, k_pages, v_pages, table, length):
    """q [Q, N, H] for one sequence: the last Q positions of `length` tokens."""
    k = k_pages[table.long()].reshape(-1, K, H)[:length].repeat_interleave(N // K, 1)
    v = v_pages[table.long()].reshape(-1, K, H)[:length].repeat_interleave(N // K, 1)
    qn = q.shape[0]
    mask = torch.ones(qn, length, dtype=torch.bool).tril(length - qn)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def test_paged_decode_and_multi_token_decode():
    k_pages, v_pages, tables = _cache()
    lengths = torch.tensor([5, 16, 9])
    q = torch.randn(3, N, H)
    out = st.paged_attention(q, k_pages, v_pages, tables, lengths)
    for b in range(3):
        ref = _reference(q[b:b + 1], k_pages, v_pages, tables[b], int(lengths[b]))
        torch.testing.assert_close(out[b], ref[0], atol=2e-5, rtol=2e-5)
    q3 = torch.randn(3, 3, N, H)
    out3 = st.paged_attention(q3, k_pages, v_pages, tables, lengths)
    for b in range(3):
        ref = _reference(q3[b], k_pages, v_pages, tables[b], int(lengths[b]))
        torch.testing.assert_close(out3[b], ref, atol=2e-5, rtol=2e-5)
    torch.library.opcheck(st_paged.paged_attention_op.op,
                          (q, k_pages, None, None, None, None, v_pages, None, None, None, None, tables,
                           lengths.to(torch.int32), None, None, None, None, None, None, None, None, None, None))


def test_ragged_paged_attention_mixed_step():
    k_pages, v_pages, tables = _cache(1)
    kv_lens = torch.tensor([7, 12, 3], dtype=torch.int32)
    cu = torch.tensor([0, 4, 5, 8], dtype=torch.int32)  # a chunked prefill of 4, a decode, a prefill of 3
    q = torch.randn(8, N, H)
    out = st.ragged_paged_attention(q, k_pages, v_pages, kv_lens, tables, cu, 3)
    for s in range(3):
        lo, hi = int(cu[s]), int(cu[s + 1])
        ref = _reference(q[lo:hi], k_pages, v_pages, tables[s], int(kv_lens[s]))
        torch.testing.assert_close(out[lo:hi], ref, atol=2e-5, rtol=2e-5)
    torch.library.opcheck(st_paged.ragged_paged_attention_op.op,
                          (q, k_pages, None, None, None, None, v_pages, None, None, None, None, kv_lens, tables, cu,
                           torch.tensor([3], dtype=torch.int32), None, *[None] * 9))


def test_mla_decode_matches_dense_latent_attention():
    gen = torch.Generator().manual_seed(2)
    r, p = 16, 8
    latent = torch.randn(PAGES, PAGE, r, generator=gen)
    pe = torch.randn(PAGES, PAGE, p, generator=gen)
    tables = torch.randperm(PAGES, generator=gen)[:8].reshape(2, 4).to(torch.int32)
    lengths = torch.tensor([6, 13], dtype=torch.int32)
    q_nope, q_pe = torch.randn(2, N, r, generator=gen), torch.randn(2, N, p, generator=gen)
    out = st.mla_decode(q_nope, q_pe, latent, pe, tables, lengths, scale=0.2)
    for b in range(2):
        c = latent[tables[b].long()].reshape(-1, r)[: int(lengths[b])]
        rope = pe[tables[b].long()].reshape(-1, p)[: int(lengths[b])]
        s = 0.2 * (q_nope[b] @ c.t() + q_pe[b] @ rope.t())
        torch.testing.assert_close(out[b], torch.softmax(s, -1) @ c, atol=2e-5, rtol=2e-5)
    torch.library.opcheck(st_paged.mla_decode_op.op, (q_nope, q_pe, latent, None, None, None, None, pe, None, None,
                                                      None, None, tables, lengths, None, None, None, None, 0.2, None,
                                                      None, None, None))


def test_update_kv_cache_in_place_then_decode():
    k_pages, v_pages, tables = _cache(3)
    new_k, new_v = torch.randn(3, K, H), torch.randn(3, K, H)
    page = int(tables[0, 1])
    slots = torch.tensor([page * PAGE + 1, -1, page * PAGE + 3])  # the middle token is padding
    before = k_pages.clone()
    st.update_kv_cache_(k_pages, v_pages, new_k, new_v, slots)
    torch.testing.assert_close(k_pages[page, 1], new_k[0])
    torch.testing.assert_close(v_pages[page, 3], new_v[2])
    changed = (k_pages != before).any(-1).any(-1)
    assert int(changed.sum()) == 2


# -- quantized caches -------------------------------------------------------------------------
def _j(t):
    return jnp.asarray(t.numpy())


@pytest.mark.parametrize("spec", ["int8", pytest.param(jpaged.KVQuant("int4", group_size=4, rotation=True),
                                                        marks=pytest.mark.slow)])
def test_paged_attention_over_quantized_pools_matches_jax(spec):
    k_pages, v_pages, tables = _cache(4)
    qk = st.quantize_pages(k_pages, spec)
    qv = st.quantize_pages(v_pages, spec)
    assert isinstance(qk, st.QuantizedPages) and qk.shape == tuple(k_pages.shape)
    jk, jv = jpaged.quantize_pages(_j(k_pages), spec), jpaged.quantize_pages(_j(v_pages), spec)
    for name in ("data", "scale", "zero", "signs"):
        a, b = getattr(qk, name), getattr(jk, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(a.numpy(), np.asarray(b), err_msg=name)
    # The torch QuantizedPages crosses to JAX as the same pool.
    np.testing.assert_array_equal(np.asarray(jpaged.dequantize_pages(qk.to_jax())),
                                  st.dequantize_pages(qk).numpy())
    lengths = torch.tensor([5, 16, 9])
    q = torch.randn(3, 2, N, H)
    out = st.paged_attention(q, qk, qv, tables, lengths)
    ref = stellax.paged_attention(_j(q), jk, jv, _j(tables), _j(lengths.int()))
    np.testing.assert_allclose(out.numpy(), np.asarray(ref), atol=1e-5, rtol=1e-5)
    # ... and is attention over the dequantized pages.
    dk, dv = st.dequantize_pages(qk), st.dequantize_pages(qv)
    for b in range(3):
        torch.testing.assert_close(out[b], _reference(q[b], dk, dv, tables[b], int(lengths[b])), atol=1e-4,
                                   rtol=1e-4)
    torch.library.opcheck(st_paged.paged_attention_op.op,
                          (q, qk.data, qk.scale, qk.zero, qk.signs, None, qv.data, qv.scale, qv.zero, qv.signs, None,
                           tables, lengths.int(), None, st_paged._encode_spec(qk.spec), H,
                           st_paged._encode_spec(qv.spec), H, None, None, None, None, None))


def test_ragged_over_quantized_pools_matches_jax():
    k_pages, v_pages, tables = _cache(5)
    qk, qv = st.quantize_pages(k_pages, "fp8"), st.quantize_pages(v_pages, "int8")
    kv_lens = torch.tensor([7, 12, 3], dtype=torch.int32)
    cu = torch.tensor([0, 4, 5, 8], dtype=torch.int32)
    q = torch.randn(8, N, H)
    out = st.ragged_paged_attention(q, qk, qv, kv_lens, tables, cu, 3)
    ref = stellax.ragged_paged_attention(_j(q), qk.to_jax(), qv.to_jax(), _j(kv_lens), _j(tables), _j(cu),
                                         jnp.array([3], jnp.int32))
    np.testing.assert_allclose(out.numpy(), np.asarray(ref), atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_mla_over_quantized_latent_pool_matches_jax():
    _, _, tables = _cache(5)
    gen = torch.Generator().manual_seed(6)
    latent = torch.randn(PAGES, PAGE, 16, generator=gen)
    pe = torch.randn(PAGES, PAGE, 8, generator=gen)
    ql = st.quantize_pages(latent, "int8")
    lengths = torch.tensor([6, 13, 2], dtype=torch.int32)
    q_nope, q_pe = torch.randn(3, N, 16, generator=gen), torch.randn(3, N, 8, generator=gen)
    out = st.mla_decode(q_nope, q_pe, ql, pe, tables, lengths, scale=0.2)
    ref = stellax.mla_decode(_j(q_nope), _j(q_pe), ql.to_jax(), _j(pe), _j(tables), _j(lengths), scale=0.2)
    np.testing.assert_allclose(out.numpy(), np.asarray(ref), atol=1e-5, rtol=1e-5)


def test_functional_update_kv_cache_quantized_and_dense():
    k_pages, v_pages, tables = _cache(7)
    qk, qv = st.init_kv_cache(PAGES, PAGE, K, H, dtype=torch.float32, quant="int8")
    assert isinstance(qk, st.QuantizedPages) and qk.data.dtype == torch.int8
    new_k, new_v = torch.randn(3, K, H), torch.randn(3, K, H)
    slots = torch.tensor([9, -1, 30])
    k2, v2 = st.update_kv_cache(qk, qv, new_k, new_v, slots)
    jk, jv = jpaged.update_kv_cache(qk.to_jax(), qv.to_jax(), _j(new_k), _j(new_v), _j(slots.int()))
    np.testing.assert_array_equal(k2.data.numpy(), np.asarray(jk.data))
    np.testing.assert_array_equal(v2.scale.numpy(), np.asarray(jv.scale))
    assert int(qk.data.abs().sum()) == 0  # functional: the input pool is unchanged
    dense = st.dequantize_pages(k2).reshape(-1, K, H)
    torch.testing.assert_close(dense[9], new_k[0], atol=0.02, rtol=0.02)
    # Dense pools: the same as the in-place writer.
    kd, vd = st.update_kv_cache(k_pages, v_pages, new_k, new_v, slots)
    k_ip, v_ip = k_pages.clone(), v_pages.clone()
    st.update_kv_cache_(k_ip, v_ip, new_k, new_v, slots)
    assert torch.equal(kd, k_ip) and torch.equal(vd, v_ip)
    torch.library.opcheck(st_paged.update_kv_cache_op.op,
                          (qk.data, qk.scale, None, None, None, qv.data, qv.scale, None, None, None, new_k, new_v,
                           slots.int(), None, None, st_paged._encode_spec(qk.spec), H,
                           st_paged._encode_spec(qv.spec), H))


def test_cache_helper_opchecks():
    k_pages, _, _ = _cache(8)
    spec = st_paged._encode_spec(jpaged.KVQuant("int4", group_size=4))
    torch.library.opcheck(st_paged.quantize_pages_op.op, (k_pages, None, None, spec, None))
    qk = st.quantize_pages(k_pages, jpaged.KVQuant("int4", group_size=4))
    torch.library.opcheck(st_paged.dequantize_pages_op.op, (qk.data, qk.scale, qk.zero, None, None, spec, H, False))


def test_serving_ops_are_forward_only_with_a_clear_error():
    k_pages, v_pages, tables = _cache(9)
    q = torch.randn(3, N, H, requires_grad=True)
    out = st.paged_attention(q, k_pages, v_pages, tables, torch.tensor([5, 16, 9]))
    with pytest.raises(st.ForwardOnlyError, match=r"stellax::paged_attention is forward only.*respect to q"):
        out.sum().backward()
    k_leaf = k_pages.clone().requires_grad_()
    out = st.ragged_paged_attention(q.detach(), k_leaf, v_pages, torch.tensor([4], dtype=torch.int32), tables[:1],
                                    torch.tensor([0, 1], dtype=torch.int32), 1)
    with pytest.raises(st.ForwardOnlyError, match=r"ragged_paged_attention is forward only.*k_pages"):
        torch.autograd.grad(out.sum(), k_leaf)
    # Without grad-requiring inputs the op just runs (no autograd node).
    assert not st.paged_attention(q.detach(), k_pages, v_pages, tables, torch.tensor([5, 16, 9])).requires_grad


def test_quantized_decode_step_compiles_fullgraph():
    k_pages, v_pages, tables = _cache(10)
    qk, qv = st.quantize_pages(k_pages, "int8"), st.quantize_pages(v_pages, "int8")
    lengths = torch.tensor([5, 16, 9])

    def step(q, new_k, new_v, slots):
        k2, v2 = st.update_kv_cache(qk, qv, new_k, new_v, slots)
        return st.paged_attention(q, k2, v2, tables, lengths)

    args = (torch.randn(3, N, H), torch.randn(3, K, H), torch.randn(3, K, H), torch.tensor([3, 40, 20]))
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(*args), step(*args))
