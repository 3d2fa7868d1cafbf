"""Paged-KV-cache attention front ends vs torch SDPA over the gathered cache."""

import pytest

torch = pytest.importorskip("torch", reason="stellax.torch needs PyTorch (pip install 'stellax[torch]')")
import torch.nn.functional as F  # noqa: E402

import stellax.torch as st  # noqa: E402
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
                          (q, k_pages, v_pages, tables, lengths.to(torch.int32), None, None, None, None, None))


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
                          (q, k_pages, v_pages, kv_lens, tables, cu, torch.tensor([3], dtype=torch.int32), None,
                           None, None, None, None))


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
    torch.library.opcheck(st_paged.mla_decode_op.op, (q_nope, q_pe, latent, pe, tables, lengths, 0.2, None, None,
                                                      None))


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
