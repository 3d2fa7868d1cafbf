"""Variable-length (packed) attention, as FlashAttention's ``flash_attn_varlen_func``.

Sequences are packed along one token axis and delimited by cumulative
lengths ``cu_seqlens`` (``[num_seqs + 1]``, starting at 0). This is one call
of the batched op with ``B = 1``: every token gets the segment id of its
sequence and its position inside the sequence, and causal/window/chunk
masks are aligned bottom-right *per sequence* (query ``i`` of a sequence with
``len_q`` queries and ``len_k`` keys sees keys ``j <= i + len_k - len_q``).
Block skipping works on the packed layout directly (blocks of different
sequences are empty), so no padding to ``max_seqlen`` happens.

Bad offsets (issue 43). An offset ``cu[j]`` is bad when ``cu[0] != 0``, ``cu[j] < 0``,
``cu[j] > total`` or ``cu[j] < cu[j - 1]``. Concrete offsets raise (`check_offsets`); under
``jit`` the first bad offset ``j`` (of either array) makes sequence ``max(j - 1, 0)`` and every
later one invalid, and their query rows are NaN (`poison_rows`): the rows from that sequence's
start (from row 0 when it is sequence 0) to ``cu_seqlens_q[-1]``, or to ``total_q`` when
``cu_seqlens_q`` itself is bad (where its padding starts is then unknown). Rows of the sequences
before it are exact. In checked mode (`stellax.checked`) the same conditions are checkify checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core import checks
from ...core.runtime_checks import require
from .api import attention_op


def _safe_offsets(cu_seqlens, total: int):
    """Traced offsets made safe (eagerly they are checked, see `check_offsets`):
    clamped into ``[0, total]`` and made non-decreasing."""
    return jax.lax.cummax(jnp.clip(jnp.asarray(cu_seqlens).astype(jnp.int32), 0, total))


def check_offsets(name: str, cu_seqlens, total: int, what: str) -> None:
    """Concrete ``cu_seqlens``: start at 0, non-decreasing, end within ``total``."""
    values = checks.concrete_values(cu_seqlens)
    if values is None:
        return
    values = values.astype(np.int64)
    if values[0] != 0:
        raise ValueError(f"{name}[0]: expected 0, got {values[0]}")
    steps = np.diff(values)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0)) + 1
        raise ValueError(f"{name}[{i}] = {values[i]}: expected >= {name}[{i - 1}] = {values[i - 1]} (non-decreasing)")
    if values[-1] > total:
        raise ValueError(f"{name}[-1] = {values[-1]}: expected <= {total} ({what}; tokens past it are padding)")


def _first_bad_offset(cu_seqlens, total: int):
    """Index of the first bad offset (``cu[0] != 0``, negative, past ``total``, or below the one
    before it); ``len(cu)`` when every offset is good."""
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    idx = jnp.arange(cu.shape[0], dtype=jnp.int32)
    prev = jnp.concatenate([cu[:1], cu[:-1]])
    bad = (cu < 0) | (cu > total) | (cu < prev) | ((idx == 0) & (cu != 0))
    return jnp.min(jnp.where(bad, idx, cu.shape[0]))


def poisoned_rows(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """Bool ``[total_q]``: the query rows of sequences whose offsets are invalid (module doc)."""
    n1 = cu_seqlens_q.shape[0]
    jq, jk = _first_bad_offset(cu_seqlens_q, total_q), _first_bad_offset(cu_seqlens_k, total_k)
    j = jnp.minimum(jq, jk)
    cu_q = _safe_offsets(cu_seqlens_q, total_q)
    s0 = jnp.clip(j - 1, 0, n1 - 1)
    start = jnp.where(s0 == 0, 0, cu_q[s0])
    end = jnp.where(jq < n1, total_q, cu_q[-1])
    idx = jnp.arange(total_q, dtype=jnp.int32)
    return (j < n1) & (idx >= start) & (idx < end)


def poison_rows(x, rows, axis: int):
    """``x`` with NaN where ``rows`` (along ``axis``) is true."""
    shape = [1] * x.ndim
    shape[axis] = rows.shape[0]
    return jnp.where(rows.reshape(shape), jnp.asarray(jnp.nan, x.dtype), x)


def require_offsets(name: str, cu_seqlens, total: int, what: str) -> None:
    """Checked mode: ``cu_seqlens`` starts at 0, is non-decreasing and ends within ``total``."""
    cu = jnp.asarray(cu_seqlens)
    require(lambda: cu[0] == 0, f"{name}[0]: expected 0, got {{value}}", value=lambda: cu[0])
    steps = lambda: cu[1:] - cu[:-1]
    require(lambda: jnp.all(steps() >= 0),
            f"{name}: expected non-decreasing offsets, got {name}[{{index}}] = {{value}} below the one before it",
            index=lambda: jnp.argmax(steps() < 0) + 1, value=lambda: cu[jnp.argmax(steps() < 0) + 1])
    require(lambda: cu[-1] <= total, f"{name}[-1]: expected <= {total} ({what}), got {{value}}",
            value=lambda: cu[-1])


def _segments_and_positions(cu_seqlens, total: int, pad_segment: int):
    idx = jnp.arange(total, dtype=jnp.int32)
    cu = _safe_offsets(cu_seqlens, total)
    seg = jnp.searchsorted(cu, idx, side="right").astype(jnp.int32) - 1
    num = cu.shape[0] - 1
    valid = (idx < cu[-1]) & (seg >= 0) & (seg < num)
    seg_safe = jnp.clip(seg, 0, num - 1)
    local = idx - cu[seg_safe]
    return jnp.where(valid, seg_safe, pad_segment), local, seg_safe


def varlen_masks(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int):
    """``(q_seg, kv_seg, q_pos, kv_pos)`` (each ``[total]`` int32) of a packed batch."""
    q_seg, q_local, q_idx = _segments_and_positions(cu_seqlens_q, total_q, -1)
    kv_seg, kv_local, _ = _segments_and_positions(cu_seqlens_k, total_k, -2)
    cu_q, cu_k = _safe_offsets(cu_seqlens_q, total_q), _safe_offsets(cu_seqlens_k, total_k)
    len_q = cu_q[1:] - cu_q[:-1]
    len_k = cu_k[1:] - cu_k[:-1]
    q_pos = q_local + (len_k - len_q)[q_idx]
    return q_seg, kv_seg, q_pos, kv_local


def dot_product_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, scale=None,
                                 is_causal=False, local_window_size=None, chunk_size=None, logits_soft_cap=None,
                                 sinks=None, precision=None, return_residuals=False, implementation=None,
                                 config=None):
    """Attention over packed variable-length sequences.

    Args:
      q: ``[total_q, N, H]``; k: ``[total_kv, K, H]``; v: ``[total_kv, K, Hv]``.
      cu_seqlens_q / cu_seqlens_k: ``[num_seqs + 1]`` int cumulative lengths
        (``cu[0] == 0``, non-decreasing, ``cu[-1] <= total``); tokens past
        ``cu_seqlens_q[-1]`` are padding (zero output). Data-dependent checks:
        concrete offsets raise ``ValueError`` naming the entry; under ``jit``
        the rows of the sequences from the first bad offset on are NaN (see
        the module doc), the rows before them exact; in checked mode
        (`stellax.checked`) ``cu_seqlens_q[0] == 0``, non-decreasing and
        ``cu_seqlens_q[-1] <= total_q`` (the same for ``cu_seqlens_k``
        against ``total_kv``) are checkify checks naming the argument.
      max_seqlen_q / max_seqlen_k: the longest sequence (an int, as in
        FlashAttention; validated to be ≥ 1, otherwise only informative).
      Other arguments as in `dot_product_attention`; masks align per sequence.
      precision: float32 contraction precision, as in `dot_product_attention`
        (docs/precision.md).
      implementation / config: as in `dot_product_attention`: ``"mosaic_tpu"``
        (`SplashConfig`), ``"triton"`` (`FlashConfig`), ``"xla_chunked"``
        (`ChunkedConfig`), ``"xla"`` (no config), ``None`` or a sequence.

    Returns:
      ``out [total_q, N, Hv]``, or ``(out, lse [N, total_q])`` with ``return_residuals``.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.as_array(name, x)
        checks.require_ndim(name, x, 3)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checks.require_int(name, cu)
        checks.require_ndim(name, cu, 1)
        if cu.shape[0] < 2:
            raise ValueError(f"{name}: expected [num_seqs + 1] with num_seqs >= 1, got shape {tuple(cu.shape)}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(f"cu_seqlens_k: expected shape {tuple(cu_seqlens_q.shape)} (that of cu_seqlens_q), "
                         f"got {tuple(cu_seqlens_k.shape)}")
    for name, m in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise ValueError(f"{name}: expected a positive int, got {m!r}")
    total_q, total_k = q.shape[0], k.shape[0]
    check_offsets("cu_seqlens_q", cu_seqlens_q, total_q, "q.shape[0]")
    check_offsets("cu_seqlens_k", cu_seqlens_k, total_k, "k.shape[0]")
    require_offsets("cu_seqlens_q", cu_seqlens_q, total_q, "q.shape[0]")
    require_offsets("cu_seqlens_k", cu_seqlens_k, total_k, "k.shape[0]")
    q_seg, kv_seg, q_pos, kv_pos = varlen_masks(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    result = attention_op(
        q[None], k[None], v[None], scale=scale, is_causal=is_causal, local_window_size=local_window_size,
        chunk_size=chunk_size, q_segment_ids=q_seg[None], kv_segment_ids=kv_seg[None],
        logits_soft_cap=logits_soft_cap, sinks=sinks, precision=precision, return_residuals=return_residuals,
        q_positions=q_pos[None], kv_positions=kv_pos[None], implementation=implementation, config=config)
    bad = poisoned_rows(cu_seqlens_q, cu_seqlens_k, total_q, total_k)
    if return_residuals:
        out, lse = result
        return poison_rows(out[0], bad, 0), poison_rows(lse[0], bad, 1)
    return poison_rows(result[0], bad, 0)
