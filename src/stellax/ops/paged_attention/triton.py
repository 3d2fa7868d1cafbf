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
leaves its array.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import next_power_of_two
from ...core.pallas import triton_call
from . import plan as plan_mod
from .cache import Source
from .configs import MlaConfig, PagedConfig, RaggedConfig
from .plan import Problem, window_partial


@dataclasses.dataclass(frozen=True)
class _SrcMeta:
    """Static description of one paged source inside the kernel."""

    spec: object            # KVQuant or None
    part: int | None        # combined kv_pages index
    head_dim: int

    @property
    def n_refs(self) -> int:
        if self.spec is None:
            return 1
        return 2 if self.spec.symmetric else 3

    @property
    def column_scale(self) -> bool:
        """Per-token-per-head symmetric scale: applied to logits/probabilities."""
        s = self.spec
        return s is not None and s.symmetric and s.group_axis == "head_dim" and s.group(self.head_dim) == self.head_dim


def _src_arrays(src: Source):
    meta = _SrcMeta(src.spec, src.part, src.head_dim)
    arrays = [src.data]
    if src.spec is not None:
        arrays.append(src.scale)
        if not src.spec.symmetric:
            arrays.append(src.zero)
    return meta, arrays


def _unpack(b, bits: int, tokens: int):
    """int32 bytes ``[T, Hb]`` → codes ``[T, Hb·8/bits]`` (little end first)."""
    hb = b.shape[-1]
    if bits == 4:
        return jnp.stack([b & 15, (b >> 4) & 15], axis=-1).reshape(tokens, 2 * hb)
    v = [(b >> (2 * j)) & 3 for j in range(4)]
    y0 = jnp.stack([v[0], v[2]], axis=-1)
    y1 = jnp.stack([v[1], v[3]], axis=-1)
    return jnp.stack([y0, y1], axis=-1).reshape(tokens, 4 * hb)


def _load_tile(refs, meta: _SrcMeta, ids, kv, *, ppb: int, page_size: int, dtype):
    """A ``[T, H]`` tile (``T = ppb·page_size``) of pages ``ids`` for kv head
    ``kv`` in ``dtype``, and per-token column scales ``[T]`` or None."""
    tokens = ppb * page_size
    data_ref = refs[0]
    raw = data_ref[ids, :, kv, :] if meta.part is None else data_ref[ids, :, meta.part, kv, :]
    raw = raw.reshape(tokens, raw.shape[-1])
    spec = meta.spec
    if spec is None:
        return raw.astype(dtype), None
    scale_ref = refs[1]
    if meta.column_scale:
        col = scale_ref[ids, :, kv, :].reshape(tokens).astype(jnp.float32)
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

    x = codes * expand(scale_ref)
    if not spec.symmetric:
        x = x + expand(refs[2])
    return x.astype(dtype), None


def _dot_t(a, b):
    """``a [M, K] · b [N, K]ᵀ`` → float32 ``[M, N]``."""
    return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _main_kernel(*refs, k_meta, v_meta, pe_meta, ppb, page_size, num_splits, hb, window_left, sink_tokens,
                 recent_tokens, scale, soft_cap, finalize, has_sinks, dtype):
    it = iter(refs)
    kv_len_ref, tables_ref, rowpos_ref, q_ref = next(it), next(it), next(it), next(it)
    qpe_ref = next(it) if pe_meta is not None else None
    k_refs = [next(it) for _ in range(k_meta.n_refs)]
    v_refs = [next(it) for _ in range(v_meta.n_refs)] if v_meta is not None else None
    pe_refs = [next(it) for _ in range(pe_meta.n_refs)] if pe_meta is not None else None
    sink_ref = next(it) if (finalize and has_sinks) else None
    outs = list(it)

    b, c, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    kv = c // hb
    tokens = ppb * page_size
    kv_len = kv_len_ref[b]
    row_pos = rowpos_ref[...]                                                  # [R]
    rows = row_pos.shape[0]
    valid = row_pos >= 0
    hi = jnp.minimum(kv_len - recent_tokens, jnp.max(jnp.where(valid, row_pos, -1)) + 1)
    lo = jnp.int32(sink_tokens)
    if window_left is not None:
        lo = jnp.maximum(lo, jnp.min(jnp.where(valid, row_pos, 2**30)) - window_left)
    lo = jnp.maximum(lo, 0)
    hi = jnp.maximum(hi, lo)
    blk_lo = lo // tokens
    blk_hi = (hi + tokens - 1) // tokens
    per_split = (blk_hi - blk_lo + num_splits - 1) // num_splits
    start = blk_lo + split * per_split
    end = jnp.minimum(start + per_split, blk_hi)

    q = q_ref[...]
    q_pe = qpe_ref[...] if qpe_ref is not None else None
    hv = outs[0].shape[-1]
    rp = row_pos[:, None]

    def body(j, carry):
        o, m, l = carry
        ids = tables_ref[b, pl.ds(j * ppb, ppb)]
        load = functools.partial(_load_tile, ids=ids, kv=kv, ppb=ppb, page_size=page_size, dtype=dtype)
        k_tile, k_col = load(k_refs, k_meta)
        s = _dot_t(q, k_tile)
        if k_col is not None:
            s = s * k_col[None, :]
        if pe_meta is not None:
            pe_tile, pe_col = load(pe_refs, pe_meta)
            s_pe = _dot_t(q_pe, pe_tile)
            s = s + (s_pe * pe_col[None, :] if pe_col is not None else s_pe)
        s = s * scale
        if soft_cap is not None:
            s = soft_cap * jnp.tanh(s / soft_cap)
        pos = j * tokens + jax.lax.broadcasted_iota(jnp.int32, (1, tokens), 1)
        mask = plan_mod.visible(pos, rp, kv_len, window_left=window_left, sink_tokens=sink_tokens,
                                recent_tokens=recent_tokens)
        s = jnp.where(mask, s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp(m - m_safe)
        p = jnp.exp(s - m_safe[:, None])
        l = alpha * l + jnp.sum(p, axis=1)
        if v_meta is None:
            v_tile, v_col = k_tile, k_col
        else:
            v_tile, v_col = load(v_refs, v_meta)
        if v_col is not None:
            p = p * v_col[None, :]
        o = alpha[:, None] * o + _dot(p.astype(dtype), v_tile)
        return o, m_new, l

    init = (jnp.zeros((rows, hv), jnp.float32), jnp.full((rows,), -jnp.inf, jnp.float32),
            jnp.zeros((rows,), jnp.float32))
    o, m, l = jax.lax.fori_loop(start, end, body, init)
    if finalize:
        if sink_ref is not None:
            sink = sink_ref[...]
            m_all = jnp.maximum(m, sink)
            m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
            w = jnp.exp(m - m_safe)
            o = o * w[:, None]
            l = l * w + jnp.exp(sink - m_safe)
        safe = jnp.where(l > 0, l, 1.0)
        outs[0][...] = jnp.where((l > 0)[:, None], o / safe[:, None], 0.0)
    else:
        o_ref, m_ref, l_ref = outs
        o_ref[...] = o
        m_ref[...] = m
        l_ref[...] = l


def _merge_kernel(*refs, num_splits, has_sinks, has_window):
    it = iter(refs)
    o_ref, m_ref, l_ref = next(it), next(it), next(it)
    sink_ref = next(it) if has_sinks else None
    if has_window:
        ow_ref, mw_ref, lw_ref = next(it), next(it), next(it)
    out_ref = next(it)
    m_all = m_ref[...]                                                          # [S, R]
    big = jnp.max(m_all, axis=0)
    if has_window:
        mw = mw_ref[...]
        big = jnp.maximum(big, mw)
    if has_sinks:
        sink = sink_ref[...]
        big = jnp.maximum(big, sink)
    big_safe = jnp.where(big == -jnp.inf, 0.0, big)
    denom = jnp.sum(jnp.exp(m_all - big_safe[None, :]) * l_ref[...], axis=0)
    acc = jnp.zeros(out_ref.shape, jnp.float32)
    if has_window:
        ww = jnp.exp(mw - big_safe)
        acc = acc + ow_ref[...] * ww[:, None]
        denom = denom + lw_ref[...] * ww
    if has_sinks:
        denom = denom + jnp.exp(sink - big_safe)

    def body(s, acc):
        w = jnp.exp(m_ref[s, :] - big_safe)
        return acc + o_ref[s, :, :] * w[:, None]

    acc = jax.lax.fori_loop(0, num_splits, body, acc)
    safe = jnp.where(denom > 0, denom, 1.0)
    out_ref[...] = jnp.where((denom > 0)[:, None], acc / safe[:, None], 0.0)


def _pad_rows(x, rows: int, value=0):
    pad = rows - x.shape[2]
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def attention_rows(problem: Problem, config: PagedConfig):
    """Normalized float32 output rows ``[Bp, K, Rt, Hv]`` of a problem."""
    bp, kv_heads, rt, hq = problem.q.shape
    hv = problem.value_dim
    ppb, splits = config.pages_per_block, config.num_splits
    ps = problem.page_size
    if ppb * ps < 16:
        raise ValueError(f"config.pages_per_block: {ppb} pages of {ps} tokens give a {ppb * ps}-token step; "
                         "the Triton kernel needs at least 16")
    r = min(config.block_rows, max(16, next_power_of_two(rt)))
    hb = -(-rt // r)
    rp = hb * r
    programs = kv_heads * hb

    def to_blocks(x, value=0):  # [Bp, K, Rt, ...] → [Bp, K·hb, R, ...]
        x = _pad_rows(x, rp, value)
        return x.reshape(bp, programs, r, *x.shape[3:])

    q = to_blocks(problem.q)
    q_pe = None if problem.q_pe is None else to_blocks(problem.q_pe)
    row_pos = jnp.pad(problem.row_pos, ((0, 0), (0, rp - rt)), constant_values=-1).reshape(bp, hb, r)
    tables = problem.tables
    width = -(-tables.shape[1] // ppb) * ppb
    tables = jnp.pad(tables, ((0, 0), (0, width - tables.shape[1])))
    finalize = splits == 1 and not problem.has_windows
    has_sinks = problem.sinks is not None
    sinks = None
    if has_sinks:
        sinks = jnp.pad(problem.sinks, ((0, 0), (0, rp - rt))).reshape(programs, r)

    k_meta, k_arrays = _src_arrays(problem.k)
    v_meta, v_arrays = (None, []) if problem.v is None else _src_arrays(problem.v)
    pe_meta, pe_arrays = (None, []) if problem.pe is None else _src_arrays(problem.pe)
    full = pl.no_block_spec
    inputs = [problem.kv_len, tables, row_pos, q]
    in_specs = [full, full, pl.BlockSpec((None, None, r), lambda b, c, s: (b, c % hb, 0)),
                pl.BlockSpec((None, None, r, hq), lambda b, c, s: (b, c, 0, 0))]
    if q_pe is not None:
        inputs.append(q_pe)
        in_specs.append(pl.BlockSpec((None, None, r, q_pe.shape[-1]), lambda b, c, s: (b, c, 0, 0)))
    for arr in (*k_arrays, *v_arrays, *pe_arrays):
        inputs.append(arr)
        in_specs.append(full)
    if finalize and has_sinks:
        inputs.append(sinks)
        in_specs.append(pl.BlockSpec((None, r), lambda b, c, s: (c, 0)))
    if finalize:
        out_shape = jax.ShapeDtypeStruct((bp, programs, r, hv), jnp.float32)
        out_specs = pl.BlockSpec((None, None, r, hv), lambda b, c, s: (b, c, 0, 0))
    else:
        out_shape = [jax.ShapeDtypeStruct((bp, programs, splits, r, hv), jnp.float32),
                     jax.ShapeDtypeStruct((bp, programs, splits, r), jnp.float32),
                     jax.ShapeDtypeStruct((bp, programs, splits, r), jnp.float32)]
        out_specs = [pl.BlockSpec((None, None, None, r, hv), lambda b, c, s: (b, c, s, 0, 0)),
                     pl.BlockSpec((None, None, None, r), lambda b, c, s: (b, c, s, 0)),
                     pl.BlockSpec((None, None, None, r), lambda b, c, s: (b, c, s, 0))]
    kernel = functools.partial(
        _main_kernel, k_meta=k_meta, v_meta=v_meta, pe_meta=pe_meta, ppb=ppb, page_size=ps, num_splits=splits,
        hb=hb, window_left=problem.window_left, sink_tokens=problem.sink_tokens,
        recent_tokens=problem.recent_tokens, scale=problem.scale, soft_cap=problem.soft_cap, finalize=finalize,
        has_sinks=has_sinks, dtype=problem.q.dtype)
    result = triton_call(kernel, out_shape=out_shape, grid=(bp, programs, splits), in_specs=in_specs,
                         out_specs=out_specs, num_warps=config.num_warps, num_stages=config.num_stages,
                         name="stellax_paged_attention")(*inputs)
    if not finalize:
        o_part, m_part, l_part = result
        inputs = [o_part, m_part, l_part]
        in_specs = [pl.BlockSpec((None, None, splits, r, hv), lambda b, c: (b, c, 0, 0, 0)),
                    pl.BlockSpec((None, None, splits, r), lambda b, c: (b, c, 0, 0)),
                    pl.BlockSpec((None, None, splits, r), lambda b, c: (b, c, 0, 0))]
        if has_sinks:
            inputs.append(sinks)
            in_specs.append(pl.BlockSpec((None, r), lambda b, c: (c, 0)))
        extra = window_partial(problem)
        if extra is not None:
            ow, mw, lw = extra
            inputs += [to_blocks(ow), to_blocks(mw[..., None], -jnp.inf)[..., 0], to_blocks(lw[..., None])[..., 0]]
            in_specs += [pl.BlockSpec((None, None, r, hv), lambda b, c: (b, c, 0, 0)),
                         pl.BlockSpec((None, None, r), lambda b, c: (b, c, 0)),
                         pl.BlockSpec((None, None, r), lambda b, c: (b, c, 0))]
        merge = functools.partial(_merge_kernel, num_splits=splits, has_sinks=has_sinks, has_window=extra is not None)
        result = triton_call(merge, out_shape=jax.ShapeDtypeStruct((bp, programs, r, hv), jnp.float32),
                             grid=(bp, programs), in_specs=in_specs,
                             out_specs=pl.BlockSpec((None, None, r, hv), lambda b, c: (b, c, 0, 0)),
                             num_warps=4, num_stages=1, name="stellax_paged_attention_merge")(*inputs)
    out = result.reshape(bp, kv_heads, rp, hv)
    return out[:, :, :rt]


def run_paged(call, config: PagedConfig):
    problem, finish = plan_mod.paged_problem(call)
    return finish(attention_rows(problem, config))


def run_ragged(call, config: RaggedConfig):
    problem, finish = plan_mod.ragged_problem(call, block_q=config.block_q)
    return finish(attention_rows(problem, config))


def run_mla(call, config: MlaConfig):
    problem, finish = plan_mod.mla_problem(call)
    return finish(attention_rows(problem, config))
