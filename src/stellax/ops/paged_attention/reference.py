"""Golden paged attention: gather pages into dense K/V, then masked softmax
attention in float32.

For every sequence ``b`` (length ``L``) the cache is first made dense:

    K_b[p] = pages[block_tables[b, p // page_size], p % page_size]     p < L

(quantized pools are dequantized and un-rotated; positions held by the
full-precision windows are read from them). Query ``i`` of ``Q`` new tokens
sits at position ``qp = L - Q + i`` (bottom-right aligned; decode: ``Q = 1``,
``qp = L - 1``) and sees key ``p`` iff

    p < L,   p <= qp,   and   qp - left <= p        (local_window_size = left)

Then, per query head ``n`` reading kv head ``n // G`` (``G = N / K``):

    s   = scale · q·k                            (float32, HIGHEST precision)
    s   = cap · tanh(s / cap)                    (logits_soft_cap)
    m   = max(max_p s_p, sink_n)
    out = Σ_p exp(s_p - m) v_p / (Σ_p exp(s_p - m) + exp(sink_n - m))

A query that sees no key (``L = 0``) gets zeros. Ragged batches apply the
same per sequence; MLA is the same with ``K = 1``, keys ``[latent, rope]``
and values ``latent``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call
from ..attention.masks import PAD_KV_SEGMENT, PAD_Q_SEGMENT, MaskSpec
from ..attention.reference import attention_forward_reference
from .cache import as_source, pool_from_call, with_query_axis
from .quant_cache import QuantizedPages, dequantize_pages, unrotate, window_slots

_HIGHEST = jax.lax.Precision.HIGHEST


def dense_pages(pages):
    """A page pool as dense float32 ``[NP, PS, K, H]`` in the original basis
    (quantized pools dequantized and un-rotated; windows not applied)."""
    src = as_source(pages)
    if not src.quantized:
        x = src.data if src.part is None else src.data[:, :, src.part]
        return x.astype(jnp.float32)
    qp = QuantizedPages(src.data, src.scale, src.zero, src.signs, src.window, src.spec, src.head_dim)
    return dequantize_pages(qp)


def gather_sequences(pages, block_tables, lengths, window_rows=None, part=None):
    """Dense float32 ``[B, P·page_size, K, H]`` of each sequence's cache
    (positions past the length hold whatever the pages hold; they are masked).
    ``window_rows [B]``: each sequence's row of the full-precision windows."""
    src = as_source(pages, part)
    num_pages, page_size = src.num_pages, src.page_size
    if src.part is not None:
        dense = src.data[:, :, src.part].astype(jnp.float32)
    else:
        dense = dense_pages(pages)
        if dense.ndim == 3:
            dense = dense[:, :, None, :]
    tables = jnp.clip(block_tables.astype(jnp.int32), 0, num_pages - 1)
    b, max_pages = tables.shape
    seq = dense[tables].reshape(b, max_pages * page_size, *dense.shape[2:])
    if src.quantized and src.window is not None:
        lengths = clamp_lengths(lengths, max_pages * page_size)
        rows = jnp.arange(b) if window_rows is None else window_rows
        window = src.window[rows].astype(jnp.float32)                # [B, W, K, H] (rotated)
        if src.signs is not None:
            window = unrotate(window, src.signs)
        positions = jnp.broadcast_to(jnp.arange(max_pages * page_size), (b, max_pages * page_size))
        slots = window_slots(positions, lengths, src.spec)              # [B, S], -1 = pages
        from_window = jnp.take_along_axis(window, jnp.maximum(slots, 0)[:, :, None, None], axis=1)
        seq = jnp.where((slots >= 0)[:, :, None, None], from_window, seq)
    return seq


def clamp_lengths(lengths, capacity: int):
    return jnp.clip(lengths.astype(jnp.int32), 0, capacity)


def attend(q, k, v, q_pos, kv_len, *, scale, soft_cap=None, window_left=None, sinks=None):
    """Masked softmax attention in float32 — the attention family's golden
    (`attention_forward_reference`) on the gathered dense K/V.

    ``q [B, Q, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]``, query
    positions ``q_pos [B, Q]`` (negative: a padding query, zeros out), key
    ``p`` at position ``p``, ``kv_len [B]``, ``sinks [N]`` or None. The cache
    length is a segment mask (keys past it get segment -2, padding queries -1).
    Returns ``[B, Q, N, Hv]`` float32.
    """
    b, nq = q.shape[:2]
    s = k.shape[1]
    kv_pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    q_seg = jnp.where(q_pos >= 0, 0, PAD_Q_SEGMENT).astype(jnp.int32)
    kv_seg = jnp.where(kv_pos < kv_len[:, None], 0, PAD_KV_SEGMENT).astype(jnp.int32)
    # Keys past the length may be garbage (NaN, inf): select them away (0 · NaN would be NaN).
    live = (kv_pos < kv_len[:, None])[:, :, None, None]
    k = jnp.where(live, k, jnp.zeros((), k.dtype))
    v = jnp.where(live, v, jnp.zeros((), v.dtype))
    spec = MaskSpec(causal=True, window_left=window_left, segments=True)
    out, _ = attention_forward_reference(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), None, None,
        None if sinks is None else sinks.astype(jnp.float32), q_pos.astype(jnp.int32), kv_pos, q_seg, kv_seg,
        spec=spec, scale=scale, logits_soft_cap=soft_cap, precision=_HIGHEST)
    return out


def paged_attention_reference(call: Call):
    """Golden `paged_attention` (see the module doc)."""
    q = call.q
    squeeze, q4 = with_query_axis(q)
    b, nq = q4.shape[:2]
    k_pages, v_pages = pool_from_call(call, "k"), pool_from_call(call, "v")
    tables = call.block_tables
    page_size = k_pages.shape[1]
    lengths = clamp_lengths(call.lengths, tables.shape[1] * page_size)
    if v_pages is None:  # combined kv_pages
        k = gather_sequences(k_pages, tables, lengths, part=0)
        v = gather_sequences(k_pages, tables, lengths, part=1)
    else:
        k = gather_sequences(k_pages, tables, lengths)
        v = gather_sequences(v_pages, tables, lengths)
    q_pos = lengths[:, None] - nq + jnp.arange(nq)[None, :]
    out = attend(q4, k, v, q_pos, lengths, scale=call.scale, soft_cap=call.logits_soft_cap,
                 window_left=call.window_left, sinks=call.sinks)
    out = out.astype(q.dtype)
    return out[:, 0] if squeeze else out


def ragged_sequence_of_tokens(cu_q_lens, num_seqs, total: int):
    """For each query token: its sequence (or -1 past ``cu_q_lens[num_seqs]``)
    and its index among the sequence's new tokens."""
    s = cu_q_lens.shape[0] - 1
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, total)
    cu = jax.lax.cummax(cu)
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], 0, s)
    t = jnp.arange(total)
    seq = jnp.sum(cu[1:][None, :] <= t[:, None], axis=1)                 # first s with cu[s+1] > t
    live = (t < cu[n]) & (seq < n)
    seq = jnp.where(live, seq, -1)
    index = t - cu[jnp.clip(seq, 0, s - 1)]
    return seq, index, cu, n


def ragged_paged_attention_reference(call: Call):
    """Golden `ragged_paged_attention`: every query token attends, as in the
    dense golden, to its own sequence's cache; tokens past
    ``cu_q_lens[num_seqs]`` get zeros."""
    q = call.q
    total = q.shape[0]
    k_pages, v_pages = pool_from_call(call, "k"), pool_from_call(call, "v")
    tables = call.block_tables
    page_size = k_pages.shape[1]
    kv_lens = clamp_lengths(call.kv_lens, tables.shape[1] * page_size)
    seq, index, cu, _ = ragged_sequence_of_tokens(call.cu_q_lens, call.num_seqs, total)
    seq_c = jnp.clip(seq, 0, tables.shape[0] - 1)
    if v_pages is None:
        k_all = gather_sequences(k_pages, tables, kv_lens, part=0)
        v_all = gather_sequences(k_pages, tables, kv_lens, part=1)
    else:
        k_all = gather_sequences(k_pages, tables, kv_lens)
        v_all = gather_sequences(v_pages, tables, kv_lens)
    q_len = cu[seq_c + 1] - cu[seq_c]
    q_pos = jnp.where(seq >= 0, kv_lens[seq_c] - q_len + index, -1)
    out = attend(q[:, None], k_all[seq_c], v_all[seq_c], q_pos[:, None], jnp.where(seq >= 0, kv_lens[seq_c], 0),
                 scale=call.scale, soft_cap=call.logits_soft_cap, window_left=call.window_left, sinks=call.sinks)
    return out[:, 0].astype(q.dtype)


def mla_decode_reference(call: Call):
    """Golden `mla_decode`: attention with ``K = 1``, keys ``[latent ‖ rope]``,
    values ``latent``, query ``[q_nope ‖ q_pe]``."""
    q_nope, q_pe = call.q_nope, call.q_pe
    squeeze, qn, qr = with_query_axis(q_nope, q_pe)
    nq = qn.shape[1]
    latent_pages, pe_pages = pool_from_call(call, "latent"), pool_from_call(call, "pe")
    tables = call.block_tables
    page_size = latent_pages.shape[1]
    lengths = clamp_lengths(call.lengths, tables.shape[1] * page_size)
    c = gather_sequences(latent_pages, tables, lengths)                   # [B, S, 1, R]
    pe = gather_sequences(pe_pages, tables, lengths)                      # [B, S, 1, P]
    q = jnp.concatenate([qn.astype(jnp.float32), qr.astype(jnp.float32)], axis=-1)
    k = jnp.concatenate([c, pe], axis=-1)
    q_pos = lengths[:, None] - nq + jnp.arange(nq)[None, :]
    out = attend(q, k, c, q_pos, lengths, scale=call.scale, soft_cap=call.logits_soft_cap,
                 window_left=call.window_left, sinks=None).astype(q_nope.dtype)
    return out[:, 0] if squeeze else out
