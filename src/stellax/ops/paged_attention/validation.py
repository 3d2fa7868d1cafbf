"""`validate`: the eager argument check of the paged ops and `update_kv_cache`.

Under ``jit`` the ops clamp out-of-range metadata (see `cache`); `validate`
raises instead, naming the argument, the index, the expected and the actual
value.
"""

from __future__ import annotations

import jax
import numpy as np

from ...core.pallas import cdiv
from .base import check_mla, check_paged, check_ragged
from .cache import pages_shape


def _host(name, value):
    try:
        return np.asarray(jax.device_get(value))
    except jax.errors.ConcretizationTypeError as e:  # pragma: no cover - message only
        raise TypeError(f"{name}: validate() needs concrete values (call it outside jit)") from e


def validate(q=None, k_pages=None, v_pages=None, block_tables=None, lengths=None, *, cu_q_lens=None,
             num_seqs=None, q_pe=None, slot_mapping=None, sinks=None) -> None:
    """Eager argument check for the paged ops: raises ``ValueError``/``TypeError``
    naming the argument, the index, the expected and the actual value.

    Call with the arguments of `paged_attention` (``q [B, N, H]`` or ``[B, Q,
    N, H]``, pools, ``block_tables``, ``lengths``), of `ragged_paged_attention`
    (``q [T, N, H]``, pools, ``block_tables``, ``kv_lens`` as ``lengths``,
    plus ``cu_q_lens=`` and ``num_seqs=``) or of `mla_decode` (``q_nope`` as
    ``q``, the latent and rope pools as ``k_pages``/``v_pages``, ``q_pe=``).
    ``slot_mapping=`` checks an `update_kv_cache` slot mapping against the pool.

    Checks shapes and dtypes (as the ops do), then values, which the ops
    cannot check under ``jit`` (there they are clamped, see the module doc):
    lengths in ``[0, max_pages * page_size]``; every block-table entry of a
    live page in ``[0, num_pages)``; ragged ``cu_q_lens`` starting at 0,
    non-decreasing, ending within ``q``, each ``q_len <= kv_len``, and
    ``0 <= num_seqs <= S``; update slots in range and unique.
    """
    if slot_mapping is not None and q is None:
        _validate_slots(k_pages, slot_mapping)
        return
    if q_pe is not None:
        check_mla(q, q_pe, k_pages, v_pages, block_tables, lengths, scale=1.0)
        pool = k_pages
    elif cu_q_lens is not None or num_seqs is not None:
        if cu_q_lens is None or num_seqs is None:
            raise ValueError("cu_q_lens, num_seqs: a ragged validation needs both")
        check_ragged(q, k_pages, v_pages, lengths, block_tables, cu_q_lens, num_seqs, sinks=sinks)
        pool = k_pages
    else:
        check_paged(q, k_pages, v_pages, block_tables, lengths, sinks=sinks)
        pool = k_pages
    shape = pages_shape(pool)
    num_pages, page_size = shape[0], shape[1]
    tables = _host("block_tables", block_tables).astype(np.int64)
    lens = _host("lengths" if cu_q_lens is None else "kv_lens", lengths).astype(np.int64)
    lname = "lengths" if cu_q_lens is None else "kv_lens"
    rows, max_pages = tables.shape
    capacity = max_pages * page_size
    live_rows = rows
    if cu_q_lens is not None:
        n = int(_host("num_seqs", num_seqs).reshape(-1)[0])
        if not 0 <= n <= rows:
            raise ValueError(f"num_seqs: expected a value in [0, {rows}] (block_tables rows), got {n}")
        live_rows = n
        cu = _host("cu_q_lens", cu_q_lens).astype(np.int64)
        total = q.shape[0]
        if cu[0] != 0:
            raise ValueError(f"cu_q_lens[0]: expected 0, got {cu[0]}")
        for s in range(n):
            if cu[s + 1] < cu[s]:
                raise ValueError(f"cu_q_lens[{s + 1}] = {cu[s + 1]}: expected >= cu_q_lens[{s}] = {cu[s]} "
                                 "(non-decreasing)")
        if cu[n] > total:
            raise ValueError(f"cu_q_lens[num_seqs={n}] = {cu[n]}: expected <= {total} (q.shape[0])")
    for b in range(live_rows):
        length = int(lens[b])
        if not 0 <= length <= capacity:
            raise ValueError(f"{lname}[{b}] = {length}: expected a value in [0, {capacity}] "
                             f"(block_tables.shape[1] {max_pages} pages x page_size {page_size})")
        if cu_q_lens is not None:
            q_len = int(cu[b + 1] - cu[b])
            if q_len > length:
                raise ValueError(f"cu_q_lens: sequence {b} has {q_len} new tokens but kv_lens[{b}] = {length}; "
                                 "expected q_len <= kv_len (the new tokens are the last q_len of the sequence)")
        live = cdiv(length, page_size)
        row = tables[b, :live]
        bad = np.nonzero((row < 0) | (row >= num_pages))[0]
        if bad.size:
            j = int(bad[0])
            raise ValueError(f"block_tables[{b}, {j}] = {int(row[j])}: expected a page index in [0, {num_pages}) "
                             f"(page {j} is live: {lname}[{b}] = {length}, page_size {page_size})")


def _validate_slots(pages, slot_mapping) -> None:
    shape = pages_shape(pages)
    capacity = shape[0] * shape[1]
    slots = _host("slot_mapping", slot_mapping).astype(np.int64).reshape(-1)
    live = slots[slots >= 0]
    bad = np.nonzero(slots >= capacity)[0]
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"slot_mapping[{t}] = {int(slots[t])}: expected a slot in [0, {capacity}) "
                         f"(num_pages {shape[0]} x page_size {shape[1]}) or a negative padding slot")
    uniq, counts = np.unique(live, return_counts=True)
    if (counts > 1).any():
        dup = int(uniq[np.argmax(counts > 1)])
        raise ValueError(f"slot_mapping: slot {dup} appears {int(counts.max())} times; expected unique slots")
