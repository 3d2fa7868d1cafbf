"""Pallas Mosaic TPU kernels of `paged_attention` and `ragged_paged_attention`.

Both ops become the same `plan.Problem` (the prologue and epilogue the XLA
and Triton paths use: query rotation, GQA row packing, ragged programs,
full-precision windows, output un-rotation), so one kernel runs both.

**Grid** ``(Bp,)``, ``parallel``: step ``b`` owns program ``b`` (a batch
row, or a block of ``block_q`` tokens of one ragged sequence) and loops over
the kv heads statically; each kv head has ``R = tokens · G`` query rows
(every query head of the group against one read of its pages: GQA packing).
Ragged calls have a static upper bound of programs (`plan.ragged_programs`):
dead ones see no key, copy nothing and write zeros, so one compilation
serves every number of sequences and tokens.

**Scalar prefetch** (SMEM): the block tables ``[S, P]`` (clamped), each
program's table row ``seq [Bp]``, its sequence length and the key range
``[lo, hi)`` its rows can see (`plan.key_range`: causal end, local window
start, minus the full-precision windows).

**Page pipeline** (`PagePipeline`). The pools stay in HBM
(``memory_space=ANY``); a step walks the blocks of ``pages_per_block`` pages
covering ``[lo, hi)`` with two VMEM slots per pool array (codes, scales,
zero points: each page ``[page_size, K, H']``, all kv heads, since one kv
head is not a whole (8, 128) tile of the HBM layout, is one
``pltpu.make_async_copy`` HBM → VMEM, all copies of a slot signalling the
slot's DMA semaphore):

    start(block 0 → slot 0)
    for i in 0 .. n-1:
        if i + 1 < n: start(block i+1 → slot (i+1) % 2)     # in flight ...
        wait(slot i % 2)
        compute(block i from slot i % 2, every kv head)     # ... during this

so the copy of block ``i+1`` overlaps the dequantization, the two matmuls
and the softmax update of block ``i``; only each grid step's block-0 copy is
exposed (issued at the start of the step).

**Compute** per block and kv head, float32 online softmax in VMEM scratch
(``m``, ``l`` ``[K, R, 128]`` lanes equal, ``acc [K, parts, R, Hv']``):

    K, V = dequantize(slot)        codes·scale (+ zero) in VMEM (see below)
    s    = scale · q Kᵀ → cap·tanh(s/cap) → -inf where not visible
    m'   = max(m, rowmax s);  α = e^{m - m'};  p = e^{s - m'}
    l'   = α l + rowsum p;    acc' = α acc + p V

and at the end ``out = acc / (l + e^{sink - m})`` (zeros when the
denominator is 0), or the partials ``(acc, m, l)`` when the cache has
full-precision windows, which `plan.window_partial` scores in XLA and
`plan.merge` merges (with the sinks).

**Quantized pools** are dequantized in VMEM, never in HBM. Packed int4/int2
codes are not interleaved back into channels (a lane shuffle): byte ``j``
holds channels ``per_byte·j + i`` in bit field ``i``, so the codes split
into ``per_byte`` *parts* ``[T, H/per_byte]`` by shifts and masks, the query
is split the same way outside the kernel (``s = Σ_i q_i · k_iᵀ``), values
accumulate per part and the wrapper interleaves the output. Group scales
(and zero points) are expanded onto the parts with exact 0/1 matmuls at
``HIGHEST`` precision (head-dim groups: ``[T, H/g] @ E_i``; token groups:
``E_t @ [T/g, H] @ S_i``). Mosaic loads neither uint8 nor float16 vectors
here, so packed bytes travel as int8 and float16 scales as their int16 bits
(same-width bitcasts), decoded in VMEM.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import (
    cdiv, dot, mxu_dot, mxu_dot_nt, online_softmax_step, operand, output, pad_axis, tpu_kernel_call,
)
from ...core.precision import accurate_functions, float32_tanh_raw
from . import plan as plan_mod
from .cache import Source
from .plan import Problem, key_range, visible, window_partial
from .configs import TpuPagedConfig, TpuRaggedConfig

F32 = jnp.float32
LANES = 128
HIGHEST = jax.lax.Precision.HIGHEST


# -- a paged source as the kernel sees it ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class SourceMeta:
    """Static description of one paged source (keys, values, MLA rope part)."""

    spec: Any               # KVQuant or None
    part: int | None        # combined kv_pages index
    head_dim: int
    page_size: int

    @property
    def per_byte(self) -> int:
        return 1 if self.spec is None else self.spec.per_byte

    @property
    def part_dim(self) -> int:
        """Channels per part (``H / per_byte``)."""
        return self.head_dim // self.per_byte

    @property
    def token_groups(self) -> bool:
        return self.spec is not None and self.spec.group_axis == "token"

    @property
    def group(self) -> int:
        return self.spec.group(self.head_dim)


def source_meta(src: Source) -> SourceMeta:
    return SourceMeta(src.spec, src.part, src.head_dim, src.page_size)


def source_arrays(src: Source) -> dict:
    """The HBM arrays of a source: ``data`` and, quantized, ``scale`` / ``zero``.
    Packed int4/int2 bytes are passed as int8 (a same-width bitcast: Mosaic
    cannot load the uint8 vectors; the kernel masks the bit fields, so the
    sign does not matter)."""
    data = src.data
    if jnp.dtype(data.dtype) == jnp.uint8:
        data = jax.lax.bitcast_convert_type(data, jnp.int8)
    arrays = {"data": data}
    if src.quantized:
        arrays["scale"] = _loadable(src.scale)
        if not src.spec.symmetric:
            arrays["zero"] = _loadable(src.zero)
    return arrays


def _loadable(x):
    """float16 scales / zero points as their int16 bits (Mosaic has no float16
    vectors on these generations; `_to_f32` decodes them in VMEM)."""
    if jnp.dtype(x.dtype) == jnp.float16:
        return jax.lax.bitcast_convert_type(x, jnp.int16)
    return x


def _to_f32(x):
    """A loaded scale block → float32; int16 holds float16 bits: ``(-1)^s ·
    2^(e-15) · (1 + m/1024)``, subnormals ``(-1)^s · m · 2^-24``, e = 31 inf/NaN."""
    if x.dtype != jnp.int16:
        return x.astype(F32)
    h = x.astype(jnp.int32) & 0xFFFF
    sign, exp, mant = (h >> 15) & 1, (h >> 10) & 0x1F, h & 0x3FF
    normal = jax.lax.bitcast_convert_type((sign << 31) | ((exp + 112) << 23) | (mant << 13), F32)
    special = jax.lax.bitcast_convert_type((sign << 31) | (255 << 23) | (mant << 13), F32)
    sub = jnp.where(sign == 1, -1.0, 1.0) * mant.astype(F32) * F32(2.0 ** -24)
    return jnp.where(exp == 0, sub, jnp.where(exp == 31, special, normal))


def _page_view(ref, meta: SourceMeta, page, name: str):
    """HBM view of page ``page``, every kv head: ``[rows, K, lanes]`` (a kv head
    alone is not a whole (8, 128) tile of the pool's HBM layout, so a DMA
    cannot address it)."""
    if name == "data" and meta.part is not None:
        return ref.at[page, :, meta.part]
    return ref.at[page]


# -- the double-buffered page pipeline ----------------------------------------------------
class PagePipeline:
    """Two VMEM slots per HBM pool array; ``start(block, slot)`` issues one
    async copy per page and array, ``wait(slot)`` waits for all of them."""

    def __init__(self, pools: dict, bufs: dict, sems, metas: dict, *, tables, seq, ppb: int):
        self.pools, self.bufs, self.sems, self.metas = pools, bufs, sems, metas
        self.tables, self.seq, self.ppb = tables, seq, ppb

    def _copies(self, block, slot):
        for (src, name), ref in self.pools.items():
            meta = self.metas[src]
            for i in range(self.ppb):
                page = self.tables[self.seq, block * self.ppb + i]
                yield pltpu.make_async_copy(_page_view(ref, meta, page, name),
                                            self.bufs[(src, name)].at[slot, i], self.sems.at[slot])

    def start(self, block, slot):
        for c in self._copies(block, slot):
            c.start()

    def wait(self, block, slot):
        for c in self._copies(block, slot):
            c.wait()


def pipeline_scratch(sources: dict, ppb: int) -> dict:
    """VMEM slots ``[2, ppb, rows, K, lanes]`` for every pool array of ``sources``
    (name → `Source`) and the two DMA semaphores."""
    scratch = {}
    for src_name, src in sources.items():
        for name, arr in source_arrays(src).items():
            rows, heads, lanes = arr.shape[1], arr.shape[-2], arr.shape[-1]
            scratch[f"buf_{src_name}_{name}"] = pltpu.VMEM((2, ppb, rows, heads, lanes), arr.dtype)
    scratch["sems"] = pltpu.SemaphoreType.DMA((2,))
    return scratch


def run_pipeline(pipe: PagePipeline, blk_lo, n, compute):
    """``compute(block, slot)`` for blocks ``blk_lo .. blk_lo + n - 1``, the copy of
    the next block in flight during each (see the module doc)."""

    @pl.when(n > 0)
    def _():
        pipe.start(blk_lo, 0)

    def body(i, carry):
        slot = jax.lax.rem(i, 2)

        @pl.when(i + 1 < n)
        def _():
            pipe.start(blk_lo + i + 1, 1 - slot)

        pipe.wait(blk_lo + i, slot)
        compute(blk_lo + i, slot)
        return carry

    jax.lax.fori_loop(0, n, body, 0)


# -- dequantization in VMEM ---------------------------------------------------------------
def _div(a, b: int):
    """``a // b`` of non-negative int32 values (`jax.lax.div` truncates; Mosaic
    lowers ``//`` through ``sign``, which needs a TPU to query)."""
    return jax.lax.div(a, jnp.int32(b))


def _select(rows: int, cols: int, fn):
    """A float32 0/1 matrix ``[rows, cols]``: ``fn(row_iota, col_iota)``."""
    r = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 0)
    c = jax.lax.broadcasted_iota(jnp.int32, (rows, cols), 1)
    return jnp.where(fn(r, c), 1.0, 0.0).astype(F32)


def _expand(a, meta: SourceMeta, part: int, ppb: int):
    """A block's float32 scales (or zero points) expanded onto part ``part``:
    head-dim groups ``a [T, H/g]``, token groups ``a [ppb·PS/g, H]`` → ``[T, H']``."""
    pb, hp, g, tokens = meta.per_byte, meta.part_dim, meta.group, ppb * meta.page_size
    if meta.token_groups:
        a = dot(_select(tokens, a.shape[0], lambda t, r: _div(t, g) == r), a, precision=HIGHEST)   # [T, H]
        if pb == 1:
            return a
        return dot(a, _select(meta.head_dim, hp, lambda ch, j: ch == pb * j + part), precision=HIGHEST)
    ng = a.shape[-1]
    if ng == 1:
        return a
    return dot(a, _select(ng, hp, lambda gi, j: _div(pb * j + part, g) == gi), precision=HIGHEST)


def _block(ref, slot, kv: int):
    """Slot ``slot`` of a ``[2, ppb, rows, K, lanes]`` buffer, kv head ``kv``, as
    float32 ``[ppb·rows, lanes]``."""
    x = _to_f32(ref[slot, :, :, kv, :])
    return x.reshape(x.shape[0] * x.shape[1], x.shape[2])


def dequantize(bufs: dict, src: str, meta: SourceMeta, slot, kv: int, ppb: int, dtype) -> list:
    """Block ``slot`` of source ``src``, kv head ``kv`` → ``per_byte`` parts
    ``[ppb·PS, H']`` in ``dtype``: ``codes · scale (+ zero)``."""
    data = bufs[(src, "data")]
    if meta.spec is None:
        return [_block(data, slot, kv).astype(dtype)]
    spec = meta.spec
    raw = data[slot, :, :, kv, :]
    if meta.per_byte == 1:
        codes = [raw.astype(F32)]
    else:
        ints = raw.astype(jnp.int32)
        mask = (1 << spec.bits) - 1
        codes = [((ints >> (spec.bits * p)) & mask).astype(F32) for p in range(meta.per_byte)]
    codes = [c.reshape(c.shape[0] * c.shape[1], c.shape[2]) for c in codes]
    scale = _block(bufs[(src, "scale")], slot, kv)
    zero = None if spec.symmetric else _block(bufs[(src, "zero")], slot, kv)
    parts = []
    for p, c in enumerate(codes):
        x = c * _expand(scale, meta, p, ppb)
        if zero is not None:
            x = x + _expand(zero, meta, p, ppb)
        parts.append(x.astype(dtype))
    return parts


def split_parts(x, per_byte: int):
    """``[..., R, H]`` → ``[..., per_byte, R, H / per_byte]`` (part ``i`` = channels ``per_byte·j + i``)."""
    *lead, r, h = x.shape
    return jnp.moveaxis(x.reshape(*lead, r, h // per_byte, per_byte), -1, -3)


def merge_parts(x):
    """Inverse of `split_parts` on ``[..., per_byte, R, H']`` → ``[..., R, H]``."""
    *lead, pb, r, hp = x.shape
    return jnp.moveaxis(x, -3, -1).reshape(*lead, r, hp * pb)


# -- the online softmax --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Softmax:
    """Static parameters of the block update."""

    tokens: int
    scale: float
    soft_cap: float | None
    window_left: int | None
    sink_tokens: int
    recent_tokens: int
    dtype: Any
    precision: Any = HIGHEST   # the call's resolved precision (`core.precision`); float32 operands only

    def logits(self, qk_parts, block, row_pos, kv_len):
        """``Σ_i q_i k_iᵀ`` pairs → masked, scaled, capped logits ``[R, T]``."""
        s = None
        for q, k in qk_parts:
            d = mxu_dot_nt(q, k, self.precision)
            s = d if s is None else s + d
        s = s * F32(self.scale)
        if self.soft_cap is not None:
            tanh = float32_tanh_raw if accurate_functions(self.dtype, self.precision) else jnp.tanh
            s = F32(self.soft_cap) * tanh(s * F32(1.0 / self.soft_cap))
        pos = block * self.tokens + jax.lax.broadcasted_iota(jnp.int32, (1, self.tokens), 1)
        mask = visible(pos, row_pos, kv_len, window_left=self.window_left, sink_tokens=self.sink_tokens,
                       recent_tokens=self.recent_tokens)
        return jnp.where(mask, s, -jnp.inf)

    def update(self, s, v_parts, block, kv_len, m_ref, l_ref, acc_ref):
        """One online-softmax step; values at positions ``>= kv_len`` are zeroed
        first (free slots may hold NaN, and ``0 · NaN = NaN``)."""
        pos = block * self.tokens + jax.lax.broadcasted_iota(jnp.int32, (self.tokens, 1), 0)
        p, alpha = online_softmax_step(s, m_ref, l_ref)
        pd = p.astype(self.dtype)
        for i, v in enumerate(v_parts):
            v = jnp.where(pos < kv_len, v, jnp.zeros((), v.dtype))
            acc_ref[i] = alpha[:, :1] * acc_ref[i] + mxu_dot(pd, v, self.precision)


def init_state(m_ref, l_ref, acc_ref):
    m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, F32)
    l_ref[...] = jnp.zeros(l_ref.shape, F32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, F32)


def write_result(m_ref, l_ref, acc_ref, *, sinks, out, o_part, m_part, l_part):
    """Normalized rows into ``out`` (with the sink logits ``[R, 1]``), or the partials."""
    if out is None:
        o_part[...] = acc_ref[...]
        m_part[...] = m_ref[...]
        l_part[...] = l_ref[...]
        return
    m, l = m_ref[:, :1], l_ref[:, :1]
    w = None
    if sinks is not None:
        sink = sinks[...]
        m_all = jnp.maximum(m, sink)
        m_safe = jnp.where(m_all == -jnp.inf, 0.0, m_all)
        w = jnp.exp(m - m_safe)
        l = l * w + jnp.exp(sink - m_safe)
    ok = l > 0
    inv = jnp.where(ok, 1.0 / jnp.where(ok, l, 1.0), 0.0)
    if w is not None:
        inv = inv * w
    for i in range(acc_ref.shape[0]):
        out[i] = acc_ref[i] * inv


def block_range(lo, hi, tokens: int):
    """Blocks of ``tokens`` keys covering ``[lo, hi)``: ``(first, count)``."""
    lo = jnp.maximum(lo, 0)
    hi = jnp.maximum(hi, lo)
    first = _div(lo, tokens)
    return first, jnp.where(hi > lo, _div(hi + tokens - 1, tokens) - first, 0)


# -- the kernel ------------------------------------------------------------------------------
def _kernel(tables, seq, kv_lens, key_lo, key_hi, *, row_pos, q, sinks, out, o_part, m_part, l_part, m_ref,
            l_ref, acc_ref, sems, metas, sm: Softmax, ppb: int, **refs):
    """Step ``b``: for every kv head, the online softmax of program ``b``'s rows
    over the blocks of its key range, pages double-buffered."""
    b = pl.program_id(0)
    pipe, bufs = pipeline(refs, sems, metas, tables=tables, seq=seq[b], ppb=ppb)
    kv_len = kv_lens[b]
    rp = row_pos[...]                                                          # [R, 1]
    k_meta, v_meta = metas["k"], metas["v"]
    heads = q.shape[0]
    for kv in range(heads):
        init_state(m_ref.at[kv], l_ref.at[kv], acc_ref.at[kv])

    def compute(block, slot):
        for kv in range(heads):
            k_parts = dequantize(bufs, "k", k_meta, slot, kv, ppb, sm.dtype)
            q_parts = [q[kv, i] for i in range(k_meta.per_byte)]
            s = sm.logits(list(zip(q_parts, k_parts)), block, rp, kv_len)
            v_parts = dequantize(bufs, "v", v_meta, slot, kv, ppb, sm.dtype)
            sm.update(s, v_parts, block, kv_len, m_ref.at[kv], l_ref.at[kv], acc_ref.at[kv])

    first, n = block_range(key_lo[b], key_hi[b], sm.tokens)
    run_pipeline(pipe, first, n, compute)
    write_results(heads, m_ref, l_ref, acc_ref, sinks=sinks, out=out, o_part=o_part, m_part=m_part, l_part=l_part)


def write_results(heads: int, m_ref, l_ref, acc_ref, *, sinks, out, o_part, m_part, l_part):
    """`write_result` of every kv head."""
    for kv in range(heads):
        at = lambda ref: None if ref is None else ref.at[kv]
        write_result(m_ref.at[kv], l_ref.at[kv], acc_ref.at[kv], sinks=at(sinks), out=at(out),
                     o_part=at(o_part), m_part=at(m_part), l_part=at(l_part))


def pipeline(refs: dict, sems, metas: dict, *, tables, seq, ppb: int):
    """The `PagePipeline` over a kernel's ``hbm_<source>_<array>`` pools and
    ``buf_<source>_<array>`` slots, and the slots by ``(source, array)``."""
    pools = {tuple(k[4:].split("_", 1)): r for k, r in refs.items() if k.startswith("hbm_")}
    bufs = {tuple(k[4:].split("_", 1)): r for k, r in refs.items() if k.startswith("buf_")}
    return PagePipeline(pools, bufs, sems, metas, tables=tables, seq=seq, ppb=ppb), bufs


def prefetch_operands(problem: Problem, tables, ppb: int):
    """Scalar-prefetch operands: tables (padded to whole blocks), ``seq``, ``kv_len``, key range."""
    lo, hi = key_range(problem.row_pos, problem.kv_len, window_left=problem.window_left,
                       sink_tokens=problem.sink_tokens, recent_tokens=problem.recent_tokens)
    tables = pad_axis(tables.astype(jnp.int32), 1, cdiv(tables.shape[1], ppb) * ppb)
    return dict(tables=tables, seq=problem.seq_rows.astype(jnp.int32), kv_lens=problem.kv_len.astype(jnp.int32),
                key_lo=jnp.maximum(lo, 0).astype(jnp.int32), key_hi=hi.astype(jnp.int32))


def padded_rows(rt: int) -> int:
    """Query rows per step padded to a multiple of 8 (the sublane count)."""
    return cdiv(rt, 8) * 8


def _rows_spec(*tail):
    return pl.BlockSpec((None, *tail), lambda b, *_: (b, *(0,) * len(tail)))


def _outputs(bp: int, heads: int, r: int, parts: int, hp: int, finalize: bool):
    """``out`` (finalized) or the partials ``o_part`` / ``m_part`` / ``l_part``."""
    o_spec, stat = _rows_spec(heads, parts, r, hp), _rows_spec(heads, r, LANES)
    if finalize:
        return dict(out=output((bp, heads, parts, r, hp), F32, o_spec), o_part=None, m_part=None, l_part=None)
    return dict(out=None, o_part=output((bp, heads, parts, r, hp), F32, o_spec),
                m_part=output((bp, heads, r, LANES), F32, stat), l_part=output((bp, heads, r, LANES), F32, stat))


def _collect(problem: Problem, res, rt: int):
    """Kernel results → normalized float32 rows ``[Bp, K, Rt, Hv]`` (merging the
    full-precision windows' partial and the sinks when the kernel wrote partials)."""
    if res.out is not None:
        return merge_parts(res.out)[:, :, :rt]
    o = merge_parts(res.o_part)[:, :, :rt]
    partials = [(o, res.m_part[:, :, :rt, 0], res.l_part[:, :, :rt, 0])]
    extra = window_partial(problem)
    if extra is not None:
        partials.append(extra)
    return plan_mod.merge(partials, None if problem.sinks is None else problem.sinks[None])


def launch_rows(kernel, problem: Problem, tables, *, sources: dict, queries: dict, values: str, ppb: int,
                name: str):
    """Launch a paged kernel over grid ``(Bp, K)`` and return normalized float32
    rows ``[Bp, K, Rt, Hv]``.

    ``sources``: name → `Source` (pools copied by the page pipeline);
    ``queries``: operand name → (query rows ``[Bp, K, Rt, H]``, source name),
    split into that source's parts; ``values``: the source whose parts the
    output accumulates. The kernel gets ``row_pos``, the queries, ``sinks``,
    the outputs, the ``m_ref`` / ``l_ref`` / ``acc_ref`` scratch, the pools
    ``hbm_*``, the slots ``buf_*``, ``sems`` and ``metas``."""
    bp, heads, rt, _ = problem.q.shape
    r = padded_rows(rt)
    metas = {n: source_meta(src) for n, src in sources.items()}
    finalize = not problem.has_windows
    sinks = None
    if finalize and problem.sinks is not None:
        sinks = pad_axis(problem.sinks, 1, r)[:, :, None]                      # [K, R, 1]
    row_pos = pad_axis(problem.row_pos, 1, r, -1)[:, :, None]                  # [Bp, R, 1]
    inputs = dict(row_pos=operand(row_pos, pl.BlockSpec((None, r, 1), lambda b, *_: (b, 0, 0))),
                  sinks=operand(sinks, pl.BlockSpec(tuple(sinks.shape), lambda b, *_: (0, 0, 0)) if sinks is not None
                                else None))
    for qname, (rows, src_name) in queries.items():
        x = split_parts(pad_axis(rows, 2, r), metas[src_name].per_byte)        # [Bp, K, parts, R, H']
        inputs[qname] = operand(x, _rows_spec(*x.shape[1:]))
    for s, src in sources.items():
        for n, a in source_arrays(src).items():
            inputs[f"hbm_{s}_{n}"] = operand(a, pl.BlockSpec(memory_space=pl.ANY))
    vm = metas[values]
    scratch = dict(m_ref=pltpu.VMEM((heads, r, LANES), F32), l_ref=pltpu.VMEM((heads, r, LANES), F32),
                   acc_ref=pltpu.VMEM((heads, vm.per_byte, r, vm.part_dim), F32), **pipeline_scratch(sources, ppb))
    sm = Softmax(ppb * problem.page_size, problem.scale, problem.soft_cap, problem.window_left,
                 problem.sink_tokens, problem.recent_tokens, problem.q.dtype, problem.precision)
    res = tpu_kernel_call(
        functools.partial(kernel, metas=metas, sm=sm, ppb=ppb), grid=(bp,), inputs=inputs,
        outputs=_outputs(bp, heads, r, vm.per_byte, vm.part_dim, finalize), scratch=scratch,
        scalar_prefetch=prefetch_operands(problem, tables, ppb), dimension_semantics=("parallel",),
        name=name)
    return _collect(problem, res, rt)


def attention_rows(problem: Problem, tables, *, pages_per_block: int):
    """Normalized float32 rows ``[Bp, K, Rt, Hv]`` of a `paged`/`ragged` problem
    (``tables``: the clamped block tables the programs' ``seq_rows`` index)."""
    return launch_rows(_kernel, problem, tables, sources={"k": problem.k, "v": problem.values},
                       queries={"q": (problem.q, "k")}, values="v", ppb=pages_per_block,
                       name="stellax_paged_attention_tpu")


def _tables(call, problem: Problem):
    return jnp.clip(call.block_tables.astype(jnp.int32), 0, problem.k.num_pages - 1)


def run_paged(call, config: TpuPagedConfig):
    """`paged_attention` on the Mosaic TPU kernel."""
    problem, finish = plan_mod.paged_problem(call)
    return finish(attention_rows(problem, _tables(call, problem), pages_per_block=config.pages_per_block))


def run_ragged(call, config: TpuRaggedConfig):
    """`ragged_paged_attention` on the Mosaic TPU kernel (programs of ``config.block_q`` tokens)."""
    problem, finish = plan_mod.ragged_problem(call, block_q=config.block_q)
    return finish(attention_rows(problem, _tables(call, problem), pages_per_block=config.pages_per_block))

