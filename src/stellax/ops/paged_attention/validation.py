"""`validate`: the eager argument check of the paged ops and `update_kv_cache`;
and the same value conditions under ``jit`` (issue 43).

Under ``jit`` the kernels read clamped metadata (see `cache`) and the ops make
the rows of sequences with invalid metadata NaN (`bad_batch_rows`,
`bad_ragged_tokens`, applied with `poison` to every implementation's output
and the golden's); in checked mode (`stellax.checked`) the same conditions are
checkify checks. `validate` raises eagerly, naming the argument, the index,
the expected and the actual value.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ...core.pallas import cdiv
from ...core.runtime_checks import require
from .base import check_mla, check_paged, check_ragged
from .cache import pages_shape, pool_from_call


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
    bad = np.nonzero(slots >= capacity)[0]
    if bad.size:
        t = int(bad[0])
        raise ValueError(f"slot_mapping[{t}] = {int(slots[t])}: expected a slot in [0, {capacity}) "
                         f"(num_pages {shape[0]} x page_size {shape[1]}) or a negative padding slot")
    first_writer: dict[int, int] = {}
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        if slot in first_writer:
            raise ValueError(f"slot_mapping[{t}] = {slot}: the slot is already written by "
                             f"slot_mapping[{first_writer[slot]}]; expected unique slots (without checks the last "
                             "write of a slot wins)")
        first_writer[slot] = t


# -- under jit: documented results for bad metadata, and the checked-mode checks (issue 43) ----------
def _pool_geometry(call, prefix: str) -> tuple[int, int]:
    shape = pages_shape(pool_from_call(call, prefix))
    return shape[0], shape[1]


def _bad_tables(tables, lengths, num_pages: int, page_size: int):
    """Bool ``[rows, max_pages]``: live entries (``j < ceil(clip(L) / page_size)``) outside ``[0, num_pages)``."""
    capacity = tables.shape[1] * page_size
    live = (jnp.clip(lengths.astype(jnp.int32), 0, capacity) + page_size - 1) // page_size
    j = jnp.arange(tables.shape[1], dtype=jnp.int32)
    return (j[None, :] < live[:, None]) & ((tables < 0) | (tables >= num_pages))


def _bad_lengths(lengths, capacity: int):
    return (lengths < 0) | (lengths > capacity)


def _require_tables(tables, lengths, lname: str, num_pages: int, page_size: int, rows_live=None) -> None:
    capacity = tables.shape[1] * page_size
    lens = lengths if rows_live is None else jnp.where(rows_live, lengths, 0)
    require(lambda: ~jnp.any(_bad_lengths(lens, capacity)),
            f"{lname}: expected values in [0, {capacity}] (block_tables.shape[1] {tables.shape[1]} pages x "
            f"page_size {page_size}), got {lname}[{{index}}] = {{value}}",
            index=lambda: jnp.argmax(_bad_lengths(lens, capacity)),
            value=lambda: lens[jnp.argmax(_bad_lengths(lens, capacity))])
    bad = lambda: _bad_tables(tables, lens, num_pages, page_size).reshape(-1)
    cols = tables.shape[1]
    require(lambda: ~jnp.any(bad()),
            f"block_tables: expected page indices in [0, {num_pages}) for every live page (the first "
            f"ceil({lname}[b] / page_size)), got block_tables[{{row}}, {{col}}] = {{value}}",
            row=lambda: jnp.argmax(bad()) // cols, col=lambda: jnp.argmax(bad()) % cols,
            value=lambda: tables.reshape(-1)[jnp.argmax(bad())])


def bad_batch_rows(call, prefix: str):
    """`paged_attention` / `mla_decode`: bool ``[B]``, the rows whose ``lengths`` is outside
    ``[0, capacity]`` or whose live block-table entries are outside ``[0, num_pages)``; in checked
    mode the same as checks."""
    num_pages, page_size = _pool_geometry(call, prefix)
    tables, lengths = jnp.asarray(call.block_tables), jnp.asarray(call.lengths)
    _require_tables(tables, lengths, "lengths", num_pages, page_size)
    capacity = tables.shape[1] * page_size
    return _bad_lengths(lengths, capacity) | jnp.any(_bad_tables(tables, lengths, num_pages, page_size), axis=1)


def bad_ragged_tokens(call):
    """`ragged_paged_attention`: bool ``[total_q]``, the query tokens whose result is undefined
    (see `ragged_paged_attention`); in checked mode the same as checks."""
    num_pages, page_size = _pool_geometry(call, "k")
    tables, kv_lens = jnp.asarray(call.block_tables), jnp.asarray(call.kv_lens)
    cu = jnp.asarray(call.cu_q_lens).astype(jnp.int32)
    total, s = call.q.shape[0], kv_lens.shape[0]
    capacity = tables.shape[1] * page_size
    n_raw = jnp.asarray(call.num_seqs).reshape(-1)[0].astype(jnp.int32)
    require(lambda: (n_raw >= 0) & (n_raw <= s), f"num_seqs: expected a value in [0, {s}] (block_tables rows), "
            "got {value}", value=lambda: n_raw)
    n = jnp.clip(n_raw, 0, s)
    idx = jnp.arange(s + 1, dtype=jnp.int32)
    prev = jnp.concatenate([cu[:1], cu[:-1]])
    require(lambda: cu[0] == 0, "cu_q_lens[0]: expected 0, got {value}", value=lambda: cu[0])
    decreasing = lambda: (cu < prev) & (idx <= n)
    require(lambda: ~jnp.any(decreasing()), "cu_q_lens: expected non-decreasing offsets up to num_seqs, got "
            "cu_q_lens[{index}] = {value} below the one before it",
            index=lambda: jnp.argmax(decreasing()), value=lambda: cu[jnp.argmax(decreasing())])
    require(lambda: cu[n] <= total, f"cu_q_lens[num_seqs]: expected <= {total} (q.shape[0]), got {{value}}",
            value=lambda: cu[n])
    seq_live = jnp.arange(s) < n
    _require_tables(tables, kv_lens, "kv_lens", num_pages, page_size, rows_live=seq_live)
    cu_safe = jax.lax.cummax(jnp.clip(cu, 0, total))
    q_len = cu_safe[1:] - cu_safe[:-1]
    too_many = lambda: seq_live & (q_len > kv_lens)
    require(lambda: ~jnp.any(too_many()), "cu_q_lens: expected q_len <= kv_len for every live sequence, got "
            "sequence {index} with {q_len} new tokens and kv_lens = {kv_len}",
            index=lambda: jnp.argmax(too_many()), q_len=lambda: q_len[jnp.argmax(too_many())],
            kv_len=lambda: kv_lens[jnp.argmax(too_many())])
    # Offsets: the first bad one invalidates its sequence and every later one, padding included.
    bad_offset = ((cu < 0) | (cu > total) | (cu < prev) | ((idx == 0) & (cu != 0))) & (idx <= n)
    j = jnp.min(jnp.where(bad_offset, idx, s + 1))
    s0 = jnp.clip(j - 1, 0, s)
    start = jnp.where(j > s, total, jnp.where(s0 == 0, 0, cu_safe[s0]))
    bad_seq = seq_live & (_bad_lengths(kv_lens, capacity) | (q_len > kv_lens)
                          | jnp.any(_bad_tables(tables, jnp.where(seq_live, kv_lens, 0), num_pages, page_size),
                                    axis=1))
    t = jnp.arange(total, dtype=jnp.int32)
    tseq = jnp.searchsorted(cu_safe[1:], t, side="right").astype(jnp.int32)
    in_live = (t < cu_safe[n]) & (tseq < n)
    bad = (in_live & bad_seq[jnp.minimum(tseq, s - 1)]) | (t >= start)
    return bad | (n_raw < 0) | (n_raw > s)


def poison(out, bad):
    """``out`` with NaN in the leading-axis rows where ``bad`` is true."""
    mask = bad.reshape(bad.shape + (1,) * (out.ndim - 1))
    return jnp.where(mask, jnp.asarray(jnp.nan, out.dtype), out)
