"""Pallas Triton kernels: split-K paged attention ("flash-decoding") and the
log-sum-exp reduction that merges its partials.

**Main kernel**, grid ``(Bp, K·hb, num_splits)``: program ``(b, c, s)`` takes
``R`` query rows of kv head ``c // hb`` (the query tokens × query heads of one
KV group: GQA packing, so each page is read once per group, not per head)
of program ``b`` (a batch row or a block of one ragged sequence's tokens).
The pages the rows can see, ``[lo, hi)`` (causal end, local window start,
minus full-precision windows), are cut into ``num_splits`` contiguous ranges
of whole blocks; split ``s`` loops over its range, ``pages_per_block`` pages
per step:

    ids  = block_tables[b, j·n : (j+1)·n]            (n = pages_per_block)
    K, V = pages[ids, :, kv]                         [n·page_size, H] (gathered)
           dequantized in registers: codes·scale (+ zero), int4/int2 unpacked
           from bytes; per-token scales multiply the logits / probabilities
           instead of the tile
    s    = scale · q Kᵀ (+ q_pe PEᵀ)   → soft cap → mask (-inf)
    m'   = max(m, rowmax s);  α = e^{m - m'};  p = e^{s - m'}
    l'   = α l + rowsum p;    o' = α o + p V

and writes ``(o, m, l)`` (float32). With one split and no windows the
kernel normalizes itself (with the attention sinks) and no merge is needed.

**Merge kernel**, grid ``(Bp, K·hb)``: ``M = max(max_s m_s, m_window,
sink)``, ``out = Σ_s e^{m_s - M} o_s / (Σ_s e^{m_s - M} l_s + e^{sink - M})``
(zeros when the denominator is 0).

Page ids and lengths are clamped before the kernels (`plan`), so no load
leaves its array. The kernels take their operands by name (`kv_len`,
`tables`, `row_pos`, `q`, `q_pe`, the pools `k` / `v` / `pe` with their
`*_scale` / `*_zero`, `sinks`, ...; ``None`` when absent).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import (
    cdiv, dot, dot_nt, operand, output, pad_axis, padded_dim, triton_kernel_call, triton_precision,
)
from . import plan as plan_mod
from .cache import Source
from .configs import MlaConfig, PagedConfig, RaggedConfig
from .plan import Problem, window_partial
from .quant_cache import packed_bytes


@dataclasses.dataclass(frozen=True)
class _SrcMeta:
    """Static description of one paged source inside the kernel."""

    spec: object            # KVQuant or None
    part: int | None        # combined kv_pages index
    head_dim: int

    @property
    def column_scale(self) -> bool:
        """Per-token-per-head symmetric scale: applied to logits/probabilities."""
        s = self.spec
        return s is not None and s.symmetric and s.group_axis == "head_dim" and s.group(self.head_dim) == self.head_dim

    @property
    def tensor_scale(self) -> bool:
        """One scale for the pool (``[1]`` in the kernel): applied to logits/probabilities like a column scale."""
        return self.spec is not None and self.spec.group_axis == "tensor"


class _Pool(NamedTuple):
    """A paged source's refs: codes (or values), scales, zero points (``None`` when absent)."""

    data: Any
    scale: Any
    zero: Any


def _pool_operands(name: str, src: Source | None) -> tuple[_SrcMeta | None, dict]:
    """``src`` as named whole-array operands ``{name, name_scale, name_zero}``
    (scales only for a quantized pool, zero points only for an asymmetric one)."""
    if src is None:
        return None, {name: None, f"{name}_scale": None, f"{name}_zero": None}
    full = pl.no_block_spec
    quantized = src.spec is not None
    scale = src.scale.reshape(1) if quantized and src.spec.group_axis == "tensor" else src.scale
    return _SrcMeta(src.spec, src.part, src.head_dim), {
        name: operand(packed_bytes(src.data), full),   # int4's uint4 codes as the bytes `_unpack` reads
        f"{name}_scale": operand(scale, full) if quantized else None,
        f"{name}_zero": operand(src.zero, full) if quantized and not src.spec.symmetric else None,
    }


def _unpack(b, bits: int, tokens: int):
    """int32 bytes ``[T, Hb]`` → codes ``[T, Hb·8/bits]`` (little end first)."""
    hb = b.shape[-1]
    if bits == 4:
        return jnp.stack([b & 15, (b >> 4) & 15], axis=-1).reshape(tokens, 2 * hb)
    v = [(b >> (2 * j)) & 3 for j in range(4)]
    y0 = jnp.stack([v[0], v[2]], axis=-1)
    y1 = jnp.stack([v[1], v[3]], axis=-1)
    return jnp.stack([y0, y1], axis=-1).reshape(tokens, 4 * hb)


def _load_tile(pool: _Pool, meta: _SrcMeta, ids, kv, *, ppb: int, page_size: int, dtype):
    """A ``[T, H]`` tile (``T = ppb·page_size``) of pages ``ids`` for kv head
    ``kv`` in ``dtype``, and per-token column scales ``[T]`` or None.

    Quantized: ``x = codes · scale (+ zero)`` with the group scales expanded
    over their head-dim or token groups; int4/int2 codes unpacked from bytes."""
    tokens = ppb * page_size
    raw = pool.data[ids, :, kv, :] if meta.part is None else pool.data[ids, :, meta.part, kv, :]
    raw = raw.reshape(tokens, raw.shape[-1])
    spec = meta.spec
    if spec is None:
        return raw.astype(dtype), None
    if meta.tensor_scale:  # int8 / fp8 codes are exact in any dot dtype; the scale goes to the logits / p
        return raw.astype(dtype), jnp.broadcast_to(pool.scale[0].astype(jnp.float32), (tokens,))
    if meta.column_scale:
        col = pool.scale[ids, :, kv, :].reshape(tokens).astype(jnp.float32)
        return raw.astype(dtype), col
    h = meta.head_dim
    if spec.per_byte == 1:
        codes = raw.astype(jnp.float32)
    else:
        codes = _unpack(raw.astype(jnp.int32), spec.bits, tokens).astype(jnp.float32)
    g = spec.group(h)

    def expand(ref):
        a = ref[ids, :, kv, :].astype(jnp.float32)
        if spec.group_axis == "head_dim":
            a = a.reshape(tokens, h // g)
            return jnp.broadcast_to(a[:, :, None], (tokens, h // g, g)).reshape(tokens, h)
        groups = page_size // g
        return jnp.broadcast_to(a[:, :, None, :], (ppb, groups, g, h)).reshape(tokens, h)

    x = codes * expand(pool.scale)
    if not spec.symmetric:
        x = x + expand(pool.zero)
    return x.astype(dtype), None


# -- main kernel ---------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Static:
    """Static parameters of the main kernel."""

    k: _SrcMeta
    v: _SrcMeta | None      # None: the values are the keys (MLA latent)
    pe: _SrcMeta | None     # MLA rope part
    ppb: int                # pages per step
    page_size: int
    num_splits: int
    hb: int                 # row blocks per kv head
    window_left: int | None
    sink_tokens: int
    recent_tokens: int
    scale: float
    soft_cap: float | None
    dtype: Any              # the dots' input dtype
    precision: Any = None   # the dots' precision (`triton_precision`; None: native, non-float32 dots)

    @property
    def tokens(self) -> int:
        return self.ppb * self.page_size

    def load(self, pool: _Pool, meta: _SrcMeta, ids, kv):
        return _load_tile(pool, meta, ids, kv, ppb=self.ppb, page_size=self.page_size, dtype=self.dtype)


def _key_blocks(kv_len, row_pos, split, st: _Static):
    """``[start, end)``: the steps of ``st.tokens`` keys split ``split`` visits.

    The rows see positions ``[lo, hi)`` (causal end, local window start, minus
    the full-precision windows), cut into ``num_splits`` contiguous ranges of
    whole steps."""
    valid = row_pos >= 0
    hi = jnp.minimum(kv_len - st.recent_tokens, jnp.max(jnp.where(valid, row_pos, -1)) + 1)
    lo = jnp.int32(st.sink_tokens)
    if st.window_left is not None:
        lo = jnp.maximum(lo, jnp.min(jnp.where(valid, row_pos, 2**30)) - st.window_left)
    lo = jnp.maximum(lo, 0)
    hi = jnp.maximum(hi, lo)
    blk_lo = lo // st.tokens
    blk_hi = (hi + st.tokens - 1) // st.tokens
    per_split = (blk_hi - blk_lo + st.num_splits - 1) // st.num_splits
    start = blk_lo + split * per_split
    return start, jnp.minimum(start + per_split, blk_hi)


def _step_logits(j, q, q_pe, k: _Pool, pe: _Pool | None, ids, kv, rp, kv_len, st: _Static):
    """Step ``j``'s masked logits ``s = scale · (q Kᵀ + q_pe PEᵀ)`` (soft-capped,
    ``-inf`` where not visible) ``[R, T]``, and the key tile and its column scales."""
    k_tile, k_col = st.load(k, st.k, ids, kv)
    s = dot_nt(q, k_tile, precision=st.precision)
    if k_col is not None:
        s = s * k_col[None, :]
    if pe is not None:
        pe_tile, pe_col = st.load(pe, st.pe, ids, kv)
        s_pe = dot_nt(q_pe, pe_tile, precision=st.precision)
        s = s + (s_pe * pe_col[None, :] if pe_col is not None else s_pe)
    s = s * st.scale
    if st.soft_cap is not None:
        s = st.soft_cap * jnp.tanh(s / st.soft_cap)
    pos = j * st.tokens + jax.lax.broadcasted_iota(jnp.int32, (1, st.tokens), 1)
    mask = plan_mod.visible(pos, rp, kv_len, window_left=st.window_left, sink_tokens=st.sink_tokens,
                            recent_tokens=st.recent_tokens)
    return jnp.where(mask, s, -jnp.inf), k_tile, k_col


def _exclude_keys(j, kv_len, v_tile, v_col, st: _Static):
    """The value tile (and its column scales) with keys at positions ``>= kv_len``
    replaced by zeros: unused slots of a live page and free pages may hold
    anything (NaN, inf), and their zero probability times NaN would be NaN."""
    pos = j * st.tokens + jax.lax.broadcasted_iota(jnp.int32, (st.tokens, 1), 0)
    v_tile = jnp.where(pos < kv_len, v_tile, jnp.zeros((), v_tile.dtype))
    if v_col is not None:
        v_col = jnp.where(pos[:, 0] < kv_len, v_col, 0.0)
    return v_tile, v_col


def _online_softmax(s, carry, v_tile, v_col, dtype, precision=None):
    """``m' = max(m, rowmax s)``, ``α = e^{m - m'}``, ``p = e^{s - m'}``,
    ``l' = α l + rowsum p``, ``o' = α o + p V`` (``p`` times the value column scales)."""
    o, m, l = carry
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[:, None])
    l = alpha * l + jnp.sum(p, axis=1)
    if v_col is not None:
        p = p * v_col[None, :]
    o = alpha[:, None] * o + dot(p.astype(dtype), v_tile, precision=precision)
    return o, m_new, l


def _normalize(o, m, l, sink):
    """``o / (l + e^{sink - m})`` with the sink logits ``[R]`` (or ``None``); zeros where the denominator is 0."""
    if sink is not None:
        m_all = jnp.maximum(m, sink)
        m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
        w = jnp.exp(m - m_safe)
        o = o * w[:, None]
        l = l * w + jnp.exp(sink - m_safe)
    safe = jnp.where(l > 0, l, 1.0)
    return jnp.where((l > 0)[:, None], o / safe[:, None], 0.0)


def _main_kernel(*, kv_len, tables, row_pos, q, q_pe, k, k_scale, k_zero, v, v_scale, v_zero, pe, pe_scale,
                 pe_zero, sinks, out, o_part, m_part, l_part, st: _Static):
    """Program ``(b, c, split)``: the online softmax of ``R`` rows of kv head
    ``c // hb`` over split ``split``'s key steps; writes the normalized rows
    (``out``, one split) or the partials ``(o_part, m_part, l_part)``."""
    b, c, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv = c // st.hb
    seq_len = kv_len[b]
    positions = row_pos[...]                                                  # [R]
    start, end = _key_blocks(seq_len, positions, split, st)
    q_rows = q[...]
    q_pe_rows = None if q_pe is None else q_pe[...]
    k_pool = _Pool(k, k_scale, k_zero)
    v_pool = None if v is None else _Pool(v, v_scale, v_zero)
    pe_pool = None if pe is None else _Pool(pe, pe_scale, pe_zero)
    rp = positions[:, None]

    def body(j, carry):
        ids = tables[b, pl.ds(j * st.ppb, st.ppb)]
        s, k_tile, k_col = _step_logits(j, q_rows, q_pe_rows, k_pool, pe_pool, ids, kv, rp, seq_len, st)
        v_tile, v_col = (k_tile, k_col) if v_pool is None else st.load(v_pool, st.v, ids, kv)
        v_tile, v_col = _exclude_keys(j, seq_len, v_tile, v_col, st)
        return _online_softmax(s, carry, v_tile, v_col, st.dtype, st.precision)

    rows = positions.shape[0]
    hv = (o_part if out is None else out).shape[-1]
    init = (jnp.zeros((rows, hv), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o_acc, m_acc, l_acc = jax.lax.fori_loop(start, end, body, init)
    if out is not None:
        out[...] = _normalize(o_acc, m_acc, l_acc, None if sinks is None else sinks[...])
    else:
        o_part[...] = o_acc
        m_part[...] = m_acc
        l_part[...] = l_acc


# -- merge kernel --------------------------------------------------------------------
def _merge_kernel(*, o_part, m_part, l_part, sinks, o_window, m_window, l_window, out, num_splits):
    """``M = max(max_s m_s, m_window, sink)``, ``out = (Σ_s e^{m_s - M} o_s +
    e^{m_w - M} o_w) / (Σ_s e^{m_s - M} l_s + e^{m_w - M} l_w + e^{sink - M})``."""
    m_all = m_part[...]                                                         # [S, R]
    big = jnp.max(m_all, axis=0)
    if m_window is not None:
        mw = m_window[...]
        big = jnp.maximum(big, mw)
    if sinks is not None:
        sink = sinks[...]
        big = jnp.maximum(big, sink)
    big_safe = jnp.where(big == -jnp.inf, 0.0, big)
    denom = jnp.sum(jnp.exp(m_all - big_safe[None, :]) * l_part[...], axis=0)
    acc = jnp.zeros(out.shape, jnp.float32)
    if m_window is not None:
        ww = jnp.exp(mw - big_safe)
        acc = acc + o_window[...] * ww[:, None]
        denom = denom + l_window[...] * ww
    if sinks is not None:
        denom = denom + jnp.exp(sink - big_safe)

    def body(s, acc):
        w = jnp.exp(m_part[s, :] - big_safe)
        return acc + o_part[s, :, :] * w[:, None]

    acc = jax.lax.fori_loop(0, num_splits, body, acc)
    safe = jnp.where(denom > 0, denom, 1.0)
    out[...] = jnp.where((denom > 0)[:, None], acc / safe[:, None], 0.0)


# -- launch -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Rows:
    """The query rows ``[Bp, K, Rt, ...]`` cut into ``hb`` blocks of ``r`` per kv
    head: programs ``c = kv·hb + block`` over ``[Bp, K·hb, r, ...]``."""

    bp: int
    kv_heads: int
    rt: int
    r: int

    @property
    def hb(self) -> int:
        return cdiv(self.rt, self.r)

    @property
    def padded(self) -> int:
        return self.hb * self.r

    @property
    def programs(self) -> int:
        return self.kv_heads * self.hb

    def blocks(self, x, value=0):
        """``[Bp, K, Rt, ...]`` → ``[Bp, K·hb, r, ...]`` (padding rows hold ``value``)."""
        x = pad_axis(x, 2, self.padded, value)
        return x.reshape(self.bp, self.programs, self.r, *x.shape[3:])


def _main_call(problem: Problem, config: PagedConfig, rows: _Rows, finalize: bool, sinks):
    """Launch the main kernel: `Outputs` ``out`` (finalized) or ``o_part`` / ``m_part`` / ``l_part``."""
    r, hb, hv, splits = rows.r, rows.hb, problem.value_dim, config.num_splits
    bp, programs = rows.bp, rows.programs
    ppb = config.pages_per_block
    q = rows.blocks(problem.q)
    q_pe = None if problem.q_pe is None else rows.blocks(problem.q_pe)
    row_pos = pad_axis(problem.row_pos, 1, rows.padded, -1).reshape(bp, hb, r)
    tables = pad_axis(problem.tables, 1, cdiv(problem.tables.shape[1], ppb) * ppb)
    k_meta, k_ops = _pool_operands("k", problem.k)
    v_meta, v_ops = _pool_operands("v", problem.v)
    pe_meta, pe_ops = _pool_operands("pe", problem.pe)
    st = _Static(k=k_meta, v=v_meta, pe=pe_meta, ppb=ppb, page_size=problem.page_size, num_splits=splits, hb=hb,
                 window_left=problem.window_left, sink_tokens=problem.sink_tokens,
                 recent_tokens=problem.recent_tokens, scale=problem.scale, soft_cap=problem.soft_cap,
                 dtype=problem.q.dtype,
                 precision=triton_precision(problem.precision) if problem.q.dtype == jnp.float32 else None)
    full = pl.no_block_spec

    def rows_of(b, c, s):  # program (b, c)'s rows
        return b, c, 0, 0

    def part(*tail):  # split s's partial of program (b, c)
        return pl.BlockSpec((None, None, None, r, *tail), lambda b, c, s: (b, c, s, 0, *(0,) * len(tail)))

    inputs = dict(
        kv_len=operand(problem.kv_len, full), tables=operand(tables, full),
        row_pos=operand(row_pos, pl.BlockSpec((None, None, r), lambda b, c, s: (b, c % hb, 0))),
        q=operand(q, pl.BlockSpec((None, None, r, q.shape[-1]), rows_of)),
        q_pe=operand(q_pe, None if q_pe is None else pl.BlockSpec((None, None, r, q_pe.shape[-1]), rows_of)),
        **k_ops, **v_ops, **pe_ops,
        sinks=operand(sinks if finalize else None, pl.BlockSpec((None, r), lambda b, c, s: (c, 0))))
    partial = not finalize
    outputs = dict(
        out=output((bp, programs, r, hv), jnp.float32, pl.BlockSpec((None, None, r, hv), rows_of)) if finalize
        else None,
        o_part=output((bp, programs, splits, r, hv), jnp.float32, part(hv)) if partial else None,
        m_part=output((bp, programs, splits, r), jnp.float32, part()) if partial else None,
        l_part=output((bp, programs, splits, r), jnp.float32, part()) if partial else None)
    return triton_kernel_call(functools.partial(_main_kernel, st=st), grid=(bp, programs, splits), inputs=inputs,
                              outputs=outputs, num_warps=config.num_warps, num_stages=config.num_stages,
                              name="stellax_paged_attention")


#: Value columns per merge program: a ``[r, 128]`` float32 accumulator (32 rows: 32
#: registers a thread on 4 warps). Whole rows of MLA's 512 latent columns spilled
#: 56–120 B per thread in the static GPU tier.
MERGE_BLOCK_V = 128


def _merge_call(problem: Problem, rows: _Rows, parts, sinks, splits: int):
    """Launch the merge kernel over the main kernel's partials (and the window partial): ``[Bp, K·hb, r, Hv]``,
    grid ``(Bp, K·hb, Hv / MERGE_BLOCK_V)``."""
    r, hv = rows.r, problem.value_dim
    bv = MERGE_BLOCK_V if hv % MERGE_BLOCK_V == 0 else hv
    rows_of = pl.BlockSpec((None, None, r, bv), lambda b, c, j: (b, c, 0, j))
    stat = pl.BlockSpec((None, None, r), lambda b, c, j: (b, c, 0))
    window = window_partial(problem)
    ow = mw = lw = None
    if window is not None:
        ow, mw, lw = window
        ow, mw, lw = rows.blocks(ow), rows.blocks(mw[..., None], -jnp.inf)[..., 0], rows.blocks(lw[..., None])[..., 0]
    inputs = dict(
        o_part=operand(parts.o_part, pl.BlockSpec((None, None, splits, r, bv), lambda b, c, j: (b, c, 0, 0, j))),
        m_part=operand(parts.m_part, pl.BlockSpec((None, None, splits, r), lambda b, c, j: (b, c, 0, 0))),
        l_part=operand(parts.l_part, pl.BlockSpec((None, None, splits, r), lambda b, c, j: (b, c, 0, 0))),
        sinks=operand(sinks, pl.BlockSpec((None, r), lambda b, c, j: (c, 0))),
        o_window=operand(ow, rows_of), m_window=operand(mw, stat), l_window=operand(lw, stat))
    result = triton_kernel_call(
        functools.partial(_merge_kernel, num_splits=splits), grid=(rows.bp, rows.programs, hv // bv), inputs=inputs,
        outputs=dict(out=output((rows.bp, rows.programs, r, hv), jnp.float32, rows_of)),
        num_warps=4, num_stages=1, name="stellax_paged_attention_merge")
    return result.out


def attention_rows(problem: Problem, config: PagedConfig):
    """Normalized float32 output rows ``[Bp, K, Rt, Hv]`` of a problem: the
    main kernel, then (several splits or full-precision windows) the merge."""
    bp, kv_heads, rt, _ = problem.q.shape
    ppb, ps = config.pages_per_block, problem.page_size
    if ppb * ps < 16:
        raise ValueError(f"config.pages_per_block: {ppb} pages of {ps} tokens give a {ppb * ps}-token step; "
                         "the Triton kernel needs at least 16")
    rows = _Rows(bp=bp, kv_heads=kv_heads, rt=rt, r=min(config.block_rows, padded_dim(rt)))
    finalize = config.num_splits == 1 and not problem.has_windows
    sinks = None if problem.sinks is None else pad_axis(problem.sinks, 1, rows.padded).reshape(rows.programs, rows.r)
    parts = _main_call(problem, config, rows, finalize, sinks)
    out = parts.out if finalize else _merge_call(problem, rows, parts, sinks, config.num_splits)
    return out.reshape(bp, kv_heads, rows.padded, problem.value_dim)[:, :, :rt]


def run_paged(call, config: PagedConfig):
    """`paged_attention` on the Triton kernels."""
    problem, finish = plan_mod.paged_problem(call)
    return finish(attention_rows(problem, config))


def run_ragged(call, config: RaggedConfig):
    """`ragged_paged_attention` on the Triton kernels (query blocks of ``config.block_q`` tokens)."""
    problem, finish = plan_mod.ragged_problem(call, block_q=config.block_q)
    return finish(attention_rows(problem, config))


def run_mla(call, config: MlaConfig):
    """`mla_decode` on the Triton kernels."""
    problem, finish = plan_mod.mla_problem(call)
    return finish(attention_rows(problem, config))
