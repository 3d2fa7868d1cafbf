"""One internal problem for all three ops, shared by the XLA and Triton paths.

`paged_attention`, `ragged_paged_attention` and `mla_decode` are all turned
into the same `Problem`: ``Bp`` *programs* (a batch row, or a block of one
sequence's new tokens), each with

* query *rows* ``q [Bp, K, Rt, Hq]``: the ``Qb`` query tokens × ``G`` query
  heads of kv head ``k``, row ``r = i·G + g`` (GQA packing: every query head
  of a KV group is processed against one read of the group's keys);
* a position per row ``row_pos [Bp, Rt]`` (``-1``: a padding row);
* the sequence's ``kv_len``, block table row and window row.

Keys at position ``p`` are visible to row ``r`` iff ``p <= row_pos[r]``,
``p < kv_len`` and ``p >= row_pos[r] - left`` (a local window), and, when
the cache has full-precision windows, the main pass skips positions held by
them (``p < sink_tokens`` or ``p >= kv_len - recent_tokens``), which
`window_partial` covers. Each pass yields online-softmax partials
``(o, m, l)``: unnormalized output, running max and sum of ``exp(s - m)``;
`merge` combines them with the attention sinks (log-sum-exp merging):

    M = max(max_i m_i, sink),  L = Σ_i e^{m_i - M} l_i + e^{sink - M}
    out = Σ_i e^{m_i - M} o_i / L          (0 when L = 0)

Rotated caches (random Hadamard signs ``[H]`` or calibrated per-head
matrices ``[K, H, H]``, see `rotation`): the query is rotated with the key
cache's rotation here (query head ``n`` with ``R_K[n // G]``), and the output
un-rotated with the value cache's (``R_V[k]ᵀ``) in `finish`, outside the
kernels, so every implementation (XLA, Triton, Mosaic TPU) gets them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ...core import Call
from ...core.pallas import cdiv
from ...core.precision import soft_cap
from .cache import Source, as_source, pool_from_call, with_query_axis
from .quant_cache import expand_token_groups, load_codes, rotate, unrotate


@dataclasses.dataclass(frozen=True)
class Problem:
    q: Any                 # [Bp, K, Rt, Hq] in the compute dtype (rotated)
    q_pe: Any              # [Bp, K, Rt, Hpe] or None (MLA rope part)
    row_pos: Any           # [Bp, Rt] int32, -1 = padding row
    kv_len: Any            # [Bp] int32 (clamped)
    tables: Any            # [Bp, P] int32 (clamped to [0, num_pages))
    seq_rows: Any          # [Bp] int32: window row of each program
    k: Source
    v: Source | None       # None: values are the keys' main part (MLA latent)
    pe: Source | None
    scale: float
    soft_cap: float | None
    window_left: int | None
    sinks: Any             # [K, Rt] float32 sink logit per row, or None
    sink_tokens: int = 0
    recent_tokens: int = 0
    precision: Any = jax.lax.Precision.HIGHEST   # the call's resolved float32 precision

    @property
    def num_programs(self) -> int:
        return self.q.shape[0]

    @property
    def num_kv_heads(self) -> int:
        return self.q.shape[1]

    @property
    def rows(self) -> int:
        return self.q.shape[2]

    @property
    def page_size(self) -> int:
        return self.k.page_size

    @property
    def values(self) -> Source:
        return self.k if self.v is None else self.v

    @property
    def value_dim(self) -> int:
        return self.values.head_dim

    @property
    def has_windows(self) -> bool:
        return bool(self.sink_tokens or self.recent_tokens)


# -- masks and loop bounds (plain jnp: used by the XLA path and inside kernels) ----------
def visible(pos, row_pos, kv_len, *, window_left, sink_tokens, recent_tokens):
    """``pos [T]`` (key positions), ``row_pos [R, 1]`` → bool ``[R, T]`` for the main pass."""
    ok = (pos <= row_pos) & (pos < kv_len) & (row_pos >= 0)
    if window_left is not None:
        ok = ok & (pos >= row_pos - window_left)
    if sink_tokens or recent_tokens:
        ok = ok & (pos >= sink_tokens) & (pos < kv_len - recent_tokens)
    return ok


def key_range(row_pos, kv_len, *, window_left, sink_tokens, recent_tokens):
    """``[lo, hi)``: the key positions any row of a program may see in the main pass."""
    big = jnp.int32(2**30)
    valid = row_pos >= 0
    hi = jnp.minimum(kv_len - recent_tokens, jnp.max(jnp.where(valid, row_pos, -1), axis=-1) + 1)
    lo = jnp.full_like(hi, sink_tokens)
    if window_left is not None:
        lo = jnp.maximum(lo, jnp.min(jnp.where(valid, row_pos, big), axis=-1) - window_left)
    return lo, hi


# -- building problems ----------------------------------------------------------------------
def _rows(x, kv_heads: int):
    """``[Bp, Qb, N, H]`` → rows ``[Bp, K, Qb·G, H]`` (row ``i·G + g``)."""
    bp, qb, n, h = x.shape
    g = n // kv_heads
    return x.reshape(bp, qb, kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(bp, kv_heads, qb * g, h)


def _unrows(o, qb: int):
    """Inverse of `_rows`: ``[Bp, K, Qb·G, H]`` → ``[Bp, Qb, N, H]``."""
    bp, kv_heads, rt, h = o.shape
    g = rt // qb
    return o.reshape(bp, kv_heads, qb, g, h).transpose(0, 2, 1, 3, 4).reshape(bp, qb, kv_heads * g, h)


def _prepare_query(q, src: Source | None):
    if src is not None and src.signs is not None:
        return rotate(q, src.signs).astype(q.dtype)
    return q


def _sink_rows(sinks, kv_heads: int, qb: int):
    if sinks is None:
        return None
    g = sinks.shape[0] // kv_heads
    s = sinks.astype(jnp.float32).reshape(kv_heads, 1, g)
    return jnp.broadcast_to(s, (kv_heads, qb, g)).reshape(kv_heads, qb * g)


def _window_counts(*sources):
    for src in sources:
        if src is not None and src.quantized and src.window is not None:
            return src.spec.sink_tokens, src.spec.recent_tokens
    return 0, 0


def _pool_source(pool) -> Source:
    """`as_source`, with a quantized pool's half of a combined buffer (`KVQuant.part`) as the source's part."""
    src = as_source(pool)
    if src.quantized and src.spec.part is not None:
        src = dataclasses.replace(src, part=src.spec.part)
    return src


def _sources(call: Call, key_name: str, value_name: str | None):
    k_pool = pool_from_call(call, key_name)
    v_pool = None if value_name is None else pool_from_call(call, value_name)
    if value_name is not None and v_pool is None:  # combined kv_pages
        return as_source(k_pool, 0), as_source(k_pool, 1)
    return _pool_source(k_pool), None if v_pool is None else _pool_source(v_pool)


def _finish(values: Source, qb: int, out_dtype, post: Callable | None = None):
    def finish(o_rows):
        if values.signs is not None:  # rows [Bp, K, Rt, H]: KV head k un-rotates with R_V[k]ᵀ
            o_rows = unrotate(o_rows, values.signs, head_axis=1)
        out = _unrows(o_rows, qb)
        if post is not None:
            out = post(out)
        return out.astype(out_dtype)
    return finish


def paged_problem(call: Call):
    """`paged_attention` → (Problem, finish)."""
    q = call.q
    squeeze, q4 = with_query_axis(q)
    b, qb = q4.shape[:2]
    k, v = _sources(call, "k", "v")
    kv_heads = k.num_heads
    tables = call.block_tables
    capacity = tables.shape[1] * k.page_size
    kv_len = jnp.clip(call.lengths.astype(jnp.int32), 0, capacity)
    pos = kv_len[:, None] - qb + jnp.arange(qb, dtype=jnp.int32)[None, :]
    g = q4.shape[2] // kv_heads
    row_pos = jnp.repeat(jnp.where(pos >= 0, pos, -1), g, axis=1)
    sink_tokens, recent_tokens = _window_counts(k, v)
    problem = Problem(
        q=_rows(_prepare_query(q4, k), kv_heads), q_pe=None, row_pos=row_pos, kv_len=kv_len,
        tables=jnp.clip(tables.astype(jnp.int32), 0, k.num_pages - 1), seq_rows=jnp.arange(b, dtype=jnp.int32),
        k=k, v=v, pe=None, scale=call.scale, soft_cap=call.logits_soft_cap, window_left=call.window_left,
        precision=call.precision,
        sinks=_sink_rows(call.sinks, kv_heads, qb), sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    post = (lambda out: out[:, 0]) if squeeze else None
    return problem, _finish(v, qb, q.dtype, post)


def mla_problem(call: Call):
    """`mla_decode` → (Problem, finish): one kv "head" shared by all query heads."""
    qn, qr = call.q_nope, call.q_pe
    squeeze, qn4, qr4 = with_query_axis(qn, qr)
    b, qb = qn4.shape[:2]
    k, _ = _sources(call, "latent", None)
    pe, _ = _sources(call, "pe", None)
    tables = call.block_tables
    capacity = tables.shape[1] * k.page_size
    kv_len = jnp.clip(call.lengths.astype(jnp.int32), 0, capacity)
    pos = kv_len[:, None] - qb + jnp.arange(qb, dtype=jnp.int32)[None, :]
    row_pos = jnp.repeat(jnp.where(pos >= 0, pos, -1), qn4.shape[2], axis=1)
    sink_tokens, recent_tokens = _window_counts(k, pe)
    problem = Problem(
        q=_rows(_prepare_query(qn4, k), 1), q_pe=_rows(_prepare_query(qr4, pe), 1), row_pos=row_pos,
        kv_len=kv_len, tables=jnp.clip(tables.astype(jnp.int32), 0, k.num_pages - 1),
        seq_rows=jnp.arange(b, dtype=jnp.int32), k=k, v=None, pe=pe, scale=call.scale,
        soft_cap=call.logits_soft_cap, window_left=call.window_left, precision=call.precision, sinks=None,
        sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    post = (lambda out: out[:, 0]) if squeeze else None
    return problem, _finish(k, qb, qn.dtype, post)


def ragged_programs(cu_q_lens, kv_lens, num_seqs, total: int, block_q: int):
    """Split every live sequence's new tokens into blocks of ``block_q``.

    Returns per program ``g`` (a static upper bound ``cdiv(total, block_q) +
    min(S, total)`` of them): its sequence (clamped; ``live`` says whether
    it is real), its first token, its query positions ``[G, block_q]`` (-1 for
    rows past the sequence's tokens), and per query token its program and
    offset (``-1``: past ``cu_q_lens[num_seqs]``, zeros out).
    """
    s = kv_lens.shape[0]
    cu = jax.lax.cummax(jnp.clip(cu_q_lens.astype(jnp.int32), 0, total))
    n = jnp.clip(jnp.asarray(num_seqs, jnp.int32).reshape(-1)[0], 0, s)
    live_seq = jnp.arange(s) < n
    q_len = jnp.where(live_seq, cu[1:] - cu[:-1], 0)
    blocks = (q_len + block_q - 1) // block_q
    ends = jnp.cumsum(blocks)
    starts = ends - blocks
    num_programs = cdiv(total, block_q) + min(s, total)
    g = jnp.arange(num_programs, dtype=jnp.int32)
    seq = jnp.sum(ends[None, :] <= g[:, None], axis=1).astype(jnp.int32)
    live = seq < s
    seq_c = jnp.minimum(seq, s - 1)
    j = g - starts[seq_c]
    first = cu[seq_c] + j * block_q
    count = jnp.where(live, jnp.clip(q_len[seq_c] - j * block_q, 0, block_q), 0)
    i = jnp.arange(block_q, dtype=jnp.int32)
    pos = kv_lens[seq_c][:, None] - q_len[seq_c][:, None] + j[:, None] * block_q + i[None, :]
    row_ok = (i[None, :] < count[:, None]) & (pos >= 0)
    q_pos = jnp.where(row_ok, pos, -1)
    token_idx = jnp.clip(first[:, None] + i[None, :], 0, max(total - 1, 0))
    # Per token: its program and offset.
    t = jnp.arange(total, dtype=jnp.int32)
    tseq = jnp.sum(cu[1:][None, :] <= t[:, None], axis=1).astype(jnp.int32)
    tlive = (t < cu[n]) & (tseq < n)
    tseq_c = jnp.minimum(tseq, s - 1)
    local = t - cu[tseq_c]
    tprog = jnp.where(tlive, starts[tseq_c] + local // block_q, -1)
    toff = local % block_q
    return dict(seq=seq_c, live=live, q_pos=q_pos, token_idx=token_idx, token_program=tprog,
                token_offset=toff, num_programs=num_programs)


def ragged_problem(call: Call, block_q: int):
    """`ragged_paged_attention` → (Problem, finish) with programs of ``block_q`` tokens."""
    q = call.q
    total, n_heads, _ = q.shape
    k, v = _sources(call, "k", "v")
    kv_heads = k.num_heads
    tables = call.block_tables
    capacity = tables.shape[1] * k.page_size
    kv_lens = jnp.clip(call.kv_lens.astype(jnp.int32), 0, capacity)
    plan = ragged_programs(call.cu_q_lens, kv_lens, call.num_seqs, total, block_q)
    seq, live = plan["seq"], plan["live"]
    q_prog = q[plan["token_idx"]]                                               # [G, bq, N, H]
    g = n_heads // kv_heads
    row_pos = jnp.repeat(plan["q_pos"], g, axis=1)
    sink_tokens, recent_tokens = _window_counts(k, v)
    problem = Problem(
        q=_rows(_prepare_query(q_prog, k), kv_heads), q_pe=None, row_pos=row_pos,
        kv_len=jnp.where(live, kv_lens[seq], 0),
        tables=jnp.clip(tables.astype(jnp.int32), 0, k.num_pages - 1)[seq], seq_rows=seq, k=k, v=v, pe=None,
        scale=call.scale, soft_cap=call.logits_soft_cap, window_left=call.window_left, precision=call.precision,
        sinks=_sink_rows(call.sinks, kv_heads, block_q), sink_tokens=sink_tokens, recent_tokens=recent_tokens)
    tprog, toff = plan["token_program"], plan["token_offset"]

    def post(out):  # [G, bq, N, Hv] → [T, N, Hv]
        picked = out[jnp.maximum(tprog, 0), toff]
        return jnp.where((tprog >= 0)[:, None, None], picked, 0.0)

    return problem, _finish(v if v is not None else k, block_q, q.dtype, post)


# -- loading a block of pages in XLA --------------------------------------------------------
def gather_block(src: Source, ids):
    """Rows of the pages ``ids [Bp, n]`` → float32 ``[Bp, n·PS, K, H]`` in the
    cache's (rotated) basis: dequantized when quantized."""
    bp, n = ids.shape
    ps = src.page_size
    data = src.data[ids]
    if src.part is not None:
        data = data[:, :, :, src.part]
    if not src.quantized:
        return data.reshape(bp, n * ps, *data.shape[3:]).astype(jnp.float32)
    spec = src.spec
    codes = load_codes(data, spec)                                               # [Bp, n, PS, K, H]
    if spec.group_axis == "tensor":                                              # one float32 scale
        x = codes * jnp.asarray(src.scale, jnp.float32)
        return x.reshape(bp, n * ps, *x.shape[3:])
    scale = src.scale[ids].astype(jnp.float32)
    zero = None if src.zero is None else src.zero[ids].astype(jnp.float32)
    if spec.group_axis == "token":
        expand = lambda a: expand_token_groups(a.reshape(bp * n, *a.shape[2:]), ps).reshape(codes.shape)
        x = codes * expand(scale)
        if zero is not None:
            x = x + expand(zero)
    else:
        h = codes.shape[-1]
        grp = h // scale.shape[-1]
        c = codes.reshape(*codes.shape[:-1], h // grp, grp)
        x = c * scale[..., None]
        if zero is not None:
            x = x + zero[..., None]
        x = x.reshape(codes.shape)
    return x.reshape(bp, n * ps, *x.shape[3:])


def _positions_values(src: Source, problem: Problem, positions):
    """Values at per-program key ``positions [Bp, W]`` (clamped) → ``[Bp, W, K, H]``."""
    ps = src.page_size
    pos = jnp.clip(positions, 0, problem.tables.shape[1] * ps - 1)
    page = jnp.take_along_axis(problem.tables, pos // ps, axis=1)               # [Bp, W]
    bp, w = pos.shape
    rows = gather_block(src, page.reshape(bp * w, 1))                            # [Bp·W, PS, K, H]
    rows = rows.reshape(bp, w, ps, *rows.shape[2:])
    off = (pos % ps)[:, :, None, None, None]
    return jnp.take_along_axis(rows, off, axis=2)[:, :, 0]


def _window_values(src: Source, problem: Problem, positions, slots):
    if src.quantized and src.window is not None:
        return src.window[problem.seq_rows].astype(jnp.float32)                # rotated basis
    return _positions_values(src, problem, positions)


def scores(problem: Problem, kx, pex, *, dot_dtype=None):
    """Scaled (soft-capped) logits ``[Bp, K, Rt, T]`` of the query rows against
    key rows ``kx [Bp, T, K, H]`` (+ rope part)."""
    def dot(a, b):
        if dot_dtype is not None and dot_dtype != jnp.float32:
            return jnp.einsum("bkrh,btkh->bkrt", a.astype(dot_dtype), b.astype(dot_dtype),
                              preferred_element_type=jnp.float32)
        return jnp.einsum("bkrh,btkh->bkrt", a.astype(jnp.float32), b.astype(jnp.float32),
                          precision=problem.precision)
    s = dot(problem.q, kx)
    if pex is not None:
        s = s + dot(problem.q_pe, pex)
    s = s * problem.scale
    return soft_cap(s, problem.soft_cap, problem.q.dtype, problem.precision)


def pv(p, vx, dot_dtype=None, precision=jax.lax.Precision.HIGHEST):
    """``p [Bp, K, Rt, T]`` · ``vx [Bp, T, K, Hv]`` → ``[Bp, K, Rt, Hv]`` float32."""
    if dot_dtype is not None and dot_dtype != jnp.float32:
        return jnp.einsum("bkrt,btkh->bkrh", p.astype(dot_dtype), vx.astype(dot_dtype),
                          preferred_element_type=jnp.float32)
    return jnp.einsum("bkrt,btkh->bkrh", p, vx.astype(jnp.float32), precision=precision)


def exclude_keys(vx, mask):
    """Values ``vx [Bp, T, K, H]`` with the keys no row sees (``mask [Bp, 1|K,
    R, T]`` all false) replaced by zeros: the unused slots of a live page and
    free pages may hold anything (NaN, inf), and a zero probability times NaN
    is NaN, so excluded values are selected away, not multiplied by zero."""
    key_ok = jnp.any(mask, axis=(1, 2))                                         # [Bp, T]
    return jnp.where(key_ok[:, :, None, None], vx, jnp.zeros((), vx.dtype))


def softmax_partial(s, mask, vx, dot_dtype=None, precision=jax.lax.Precision.HIGHEST):
    """One-shot partial ``(o, m, l)`` of logits ``s`` (masked) against values."""
    s = jnp.where(mask, s, -jnp.inf)
    vx = exclude_keys(vx, mask)
    m = jnp.max(s, axis=-1)
    m_safe = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp(s - m_safe[..., None])
    return pv(p, vx, dot_dtype, precision), m, jnp.sum(p, axis=-1)


def window_partial(problem: Problem, dot_dtype=None):
    """Partial ``(o, m, l)`` over the positions held by full-precision windows
    (``None`` when the cache has none)."""
    if not problem.has_windows:
        return None
    sink, recent = problem.sink_tokens, problem.recent_tokens
    w = sink + recent
    slots = jnp.arange(w, dtype=jnp.int32)
    kv_len = problem.kv_len[:, None]
    last = kv_len - 1
    pos_recent = last - jnp.mod(last - (slots[None, :] - sink), max(recent, 1))
    pos = jnp.where(slots[None, :] < sink, slots[None, :], pos_recent)           # [Bp, W]
    in_window = jnp.where(slots[None, :] < sink, pos < kv_len, (pos >= sink) & (pos >= 0))
    kx = _window_values(problem.k, problem, pos, slots)
    pex = None if problem.pe is None else _window_values(problem.pe, problem, pos, slots)
    vx = kx if problem.v is None else _window_values(problem.v, problem, pos, slots)
    s = scores(problem, kx, pex, dot_dtype=dot_dtype)
    row_pos = problem.row_pos[:, None, :, None]                                 # [Bp, 1, Rt, 1]
    p_ = pos[:, None, None, :]
    mask = in_window[:, None, None, :] & (p_ <= row_pos) & (row_pos >= 0)
    if problem.window_left is not None:
        mask = mask & (p_ >= row_pos - problem.window_left)
    return softmax_partial(s, mask, vx, dot_dtype, problem.precision)


def merge(partials, sinks=None):
    """Merge partials ``(o [.., R, H], m [.., R], l [.., R])`` by log-sum-exp
    with optional sink logits (broadcast against ``m``) → normalized output."""
    m_all = partials[0][1]
    for _, m, _ in partials[1:]:
        m_all = jnp.maximum(m_all, m)
    if sinks is not None:
        m_all = jnp.maximum(m_all, sinks)
    m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
    o_sum, l_sum = 0.0, 0.0
    for o, m, l in partials:
        w = jnp.exp(m - m_safe)
        o_sum = o_sum + o * w[..., None]
        l_sum = l_sum + l * w
    if sinks is not None:
        l_sum = l_sum + jnp.exp(sinks - m_safe)
    safe = jnp.where(l_sum > 0, l_sum, 1.0)
    return jnp.where((l_sum > 0)[..., None], o_sum / safe[..., None], 0.0)
