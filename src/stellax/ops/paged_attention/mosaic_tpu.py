"""Pallas Mosaic TPU kernels of `paged_attention` and `ragged_paged_attention`.

Both ops become the same `plan.Problem` (the prologue and epilogue the XLA
and Triton paths use: query rotation, GQA row packing, ragged programs,
full-precision windows, output un-rotation), so one kernel runs both.

**Grid** ``(cores, per_core)``, ``("parallel", "arbitrary")``: step ``(c,
i)`` owns program ``b = c·per_core + i`` (a batch row, or a block of
``block_q`` tokens of one ragged sequence; ``cores`` is the target's
TensorCores per device, 2 on v5p, else 1) and all its kv heads. Ragged
calls have a static upper bound of programs (`plan.ragged_programs`): dead
ones see no key, copy nothing and write zeros, so one compilation serves
every number of sequences and tokens.

**KV head groups, one matmul each.** A page ``[page_size, K, H]`` holds a
token's ``K`` heads in one sublane tile, so a kv head alone is neither a DMA
(not a whole (8, 128) tile of the HBM layout) nor a cheap VMEM view (a
strided sublane gather, which Mosaic lowers to unpack/rotate/repack code
costing ~15x the block's matmuls and softmax). So a block is read as it
lies: the keys of ``hg`` heads (`configs.head_group`: all ``K`` up to 8, or
tile-aligned groups of 8) are one ``[T·hg, H]`` matrix, key row ``t·hg +
k``, a free reshape of the slot (pools with 1, 2 or 4 kv heads are passed
token-major ``[pages, page_size·K, H]``, a free reshape of their HBM tiles,
so their slots are whole tiles too). The group's query rows ``[hg·Rt, H]``
(row ``k·Rt + i``: every query token and head of kv head ``k``, `grouped`)
take all keys in one matmul, and each row keeps only its own head's
columns (``(column mod hg) == row's head``, the rest ``-inf``; ``p = 0``
there, so ``p V`` is one matmul too). The MXU work is the same as per head
(its cost is pushing the ``T·hg`` key and value rows, done once either way);
the softmax runs on ``hg``-times wider logits, which is cheap next to the
gather it replaces. Folded int4 pools of 8 kv heads are the exception
(`mosaic_tpu_pages.word_codes`): groups of 2 kv heads (``g`` and ``g + 4``,
two nibbles of the slot's int32 words), the query rows reordered to match.

**Scalar prefetch** (SMEM): the block tables (rows padded to whole blocks,
flattened), each program's table row ``seq``, its sequence length, the key
range ``[lo, hi)`` its rows can see (`plan.key_range`: causal end, local
window start, minus the full-precision windows) and the range every valid
row sees (`full_range`).

**Page pipeline**: `mosaic_tpu_pages` (two VMEM slots per pool array, the
next block's pages in flight during each block's compute, across programs
too; pages past the key range not copied).

**Compute** per block and head group, float32 online softmax in VMEM
scratch (``m``, ``l`` ``[K/hg, R, 128]`` lanes equal, ``acc [K/hg, parts,
R, Hv']``):

    K, V = dequantize(slot)        [T·hg, H'] views, or codes·scale (+ zero) in VMEM
    s    = scale · q Kᵀ → cap·tanh(s/cap) → -inf off the row's head (and, masked, where not visible)
    m'   = max(m, rowmax s);  α = e^{m - m'};  p = e^{s - m'}
    l'   = α l + rowsum p;    acc' = α acc + p V     (masked: V zeroed at positions >= hi)

and at the end ``out = acc / (l + e^{sink - m})`` (zeros when the
denominator is 0), or the partials ``(acc, m, l)`` when the cache has
full-precision windows, which `plan.window_partial` scores in XLA and
`plan.merge` merges (with the sinks).

**Quantized pools** are dequantized in VMEM, never in HBM (`mosaic_tpu_pages.dequantize`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import cdiv, mxu_dot, mxu_dot_nt, online_softmax_step, operand, output, pad_axis, tpu_kernel_call
from ...core.platform import target_generation
from ...core.precision import accurate_functions, float32_tanh_raw
from . import plan as plan_mod
from .configs import TpuPagedConfig, TpuRaggedConfig, can_split_heads, kernel_head_group
from .mosaic_tpu_pages import (
    WORD_PAIRS, dequantize, folded_scales, idiv, imod, merge_parts, pair_codes, pipeline_scratch,
    program_pipeline, run_pipeline, source_arrays, source_meta, split_parts, word_block, word_codes, word_offset,
    word_scales,
)
from .plan import Problem, key_range, visible, window_partial

F32 = jnp.float32
LANES = 128
HIGHEST = jax.lax.Precision.HIGHEST


# -- the online softmax --------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Softmax:
    """Static parameters of the block update: a block is ``tokens`` keys of
    ``heads`` kv heads (``T·hg`` key rows, `group_rows`) against the group's
    ``heads · rows`` query rows (row ``k·rows + i``: kv head ``k`` of the group)."""

    tokens: int
    heads: int
    rows: int
    scale: float
    soft_cap: float | None
    window_left: int | None
    sink_tokens: int
    recent_tokens: int
    dtype: Any
    precision: Any = HIGHEST   # the call's resolved precision (`core.precision`); float32 operands only

    def row_heads(self, row_pos):
        """``[R, 1]``: each query row's kv head within the group, ``-1`` for a
        padding row (``row_pos < 0``), which then matches no key."""
        r = jax.lax.broadcasted_iota(jnp.int32, row_pos.shape, 0)
        head = idiv(r, self.rows) if self.heads > 1 else jnp.zeros_like(r)
        return jnp.where(row_pos >= 0, head, -1)

    def key_pos(self, block, shape, axis: int):
        """Position of each key row of a block along ``axis`` of ``shape``."""
        c = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        return block * self.tokens + (idiv(c, self.heads) if self.heads > 1 else c)

    def logits(self, sources, block, row_pos, heads, kv_len, masked: bool):
        """``sources``: per key source (keys; MLA: latent and rope) its ``(q_i,
        k_i)`` part pairs and its ``fold`` (``None``, or the keys are codes and
        ``(scale row, zero row)`` their `folded_scales`) → ``Σ q_i k_iᵀ``,
        scaled and capped, ``[R, T·hg]``, ``-inf`` where a row's kv head is not
        the key's and, ``masked``, where the row does not see the key
        (`visible`); unmasked blocks are ones every valid row sees whole
        (`by_coverage`)."""
        s = None
        for qk_parts, fold in sources:
            d = None
            for q, k in qk_parts:
                x = mxu_dot_nt(q, k, self.precision)
                d = x if d is None else d + x
            if fold is None:
                d = d * F32(self.scale)
            else:                                     # the logit scale rides on the [1, T·hg] rows
                d = d * (fold[0] * F32(self.scale))
                if fold[1] is not None:
                    qsum = sum(jnp.sum(q.astype(F32), axis=1, keepdims=True) for q, _ in qk_parts)
                    d = d + qsum * (fold[1] * F32(self.scale))
            s = d if s is None else s + d
        if self.soft_cap is not None:
            tanh = float32_tanh_raw if accurate_functions(self.dtype, self.precision) else jnp.tanh
            s = F32(self.soft_cap) * tanh(s * F32(1.0 / self.soft_cap))
        cols = self.tokens * self.heads
        if self.heads > 1:
            ok = imod(jax.lax.broadcasted_iota(jnp.int32, (1, cols), 1), self.heads) == heads
        else:
            ok = heads >= 0
        if masked:
            ok = ok & visible(self.key_pos(block, (1, cols), 1), row_pos, kv_len, window_left=self.window_left,
                              sink_tokens=self.sink_tokens, recent_tokens=self.recent_tokens)
        return jnp.where(ok, s, -jnp.inf)

    def update(self, s, v_parts, block, key_hi, m_ref, l_ref, acc_ref, masked: bool, fold=None,
               finite: bool = False, offset: float = 0.0):
        """One online-softmax step. In a ``masked`` block, values at positions
        ``>= key_hi`` (the end of the program's key range, at most its
        ``kv_len``) are zeroed first: free slots may hold NaN, and so may the
        pages the pipeline did not copy (``0 · NaN = NaN``); unmasked blocks
        lie below ``key_hi``. ``fold``: the values are codes and ``(scale row,
        zero row)`` their `folded_scales`. ``finite``: the values are integer
        codes (never NaN) whose fold rows are zero past ``key_hi``: no zeroing.
        ``offset``: the values are ``offset + code`` (`mosaic_tpu_pages.pair_codes`), taken
        out as ``offset · Σ pd`` with the rounded ``pd`` the matmul used (exact cancellation)."""
        p, alpha = online_softmax_step(s, m_ref, l_ref)
        pd = (p if fold is None else p * fold[0]).astype(self.dtype)
        zsum = None if fold is None or fold[1] is None else jnp.sum(p * fold[1], axis=1, keepdims=True)
        if offset:
            zsum = zsum - F32(offset) * jnp.sum(pd.astype(F32), axis=1, keepdims=True)
        masked = masked and not finite
        pos = self.key_pos(block, (self.tokens * self.heads, 1), 0) if masked else None
        for i, v in enumerate(v_parts):
            if masked:
                v = jnp.where(pos < key_hi, v, jnp.zeros((), v.dtype))
            pv = mxu_dot(pd, v, self.precision)
            acc_ref[i] = alpha[:, :1] * acc_ref[i] + (pv if zsum is None else pv + zsum)


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


def by_coverage(body, full_lo, full_hi, tokens: int):
    """``compute(block, slot)`` running ``body(block, slot, masked)``: unmasked
    when the block lies inside ``[full_lo, full_hi)``, the keys every valid row
    of the program sees (`full_range`: all of a decode step's blocks but the
    last), so those blocks skip the visibility mask and the value zeroing."""
    def compute(block, slot):
        start = block * tokens
        full = (start >= full_lo) & (start + tokens <= full_hi)

        @pl.when(full)
        def _():
            body(block, slot, False)

        @pl.when(jnp.logical_not(full))
        def _():
            body(block, slot, True)

    return compute


# -- the kernel ------------------------------------------------------------------------------
def _kernel(tables, seq, kv_lens, key_lo, key_hi, full_lo, full_hi, *, row_pos, q, sinks, out, o_part, m_part,
            l_part, m_ref, l_ref, acc_ref, sems, next_slot, metas, sm: Softmax, ppb: int, width: int,
            per_core: int, **refs):
    """Step ``(c, i)``: for every kv head group, the online softmax of program
    ``b = c·per_core + i``'s rows over the blocks of its key range, pages
    double-buffered (`run_pipeline`)."""
    b, pipe, bufs, sched = program_pipeline(refs, tables=tables, seq=seq, key_lo=key_lo, key_hi=key_hi, sems=sems,
                                            metas=metas, tokens=sm.tokens, ppb=ppb, width=width, per_core=per_core)
    kv_len = kv_lens[b]
    rp = row_pos[...]                                                          # [R, 1]
    heads = sm.row_heads(rp)
    k_meta, v_meta = metas["k"], metas["v"]
    groups = q.shape[0]
    for j in range(groups):
        init_state(m_ref.at[j], l_ref.at[j], acc_ref.at[j])

    offset = word_offset(sm.dtype)

    def words_body(block, slot, masked):
        keys = (block, key_hi[b]) if masked else None
        scales = {n: word_scales(bufs, n, m, slot, ppb, keys) for n, m in (("k", k_meta), ("v", v_meta))}
        words = {n: word_block(bufs, n, slot) for n in ("k", "v")}
        logits = []
        for g in range(groups):                        # kv heads g and g + 4: a pair of nibbles
            kg = pair_codes(words["k"], g, sm.dtype)   # offset + code: the zero points take the offset out
            ks, kz = scales["k"][g]
            kz = kz - F32(offset) * ks if offset else kz
            logits.append(sm.logits([([(q[g, 0], kg)], (ks, kz))], block, rp, heads, kv_len, masked))
        for g, s in enumerate(logits):
            vg = pair_codes(words["v"], g, sm.dtype)
            sm.update(s, [vg], block, key_hi[b], m_ref.at[g], l_ref.at[g], acc_ref.at[g], masked, scales["v"][g],
                      finite=True, offset=offset)

    def body(block, slot, masked):
        keys = (block, key_hi[b]) if masked else None
        fold = {n: folded_scales(bufs, n, m, slot, sm.heads, ppb, keys) if m.fold else None
                for n, m in (("k", k_meta), ("v", v_meta))}
        for j in range(groups):
            k_parts = dequantize(bufs, "k", k_meta, slot, j, sm.heads, ppb, sm.dtype, keys)
            q_parts = [q[j, i] for i in range(k_meta.per_byte)]
            s = sm.logits([(list(zip(q_parts, k_parts)), fold["k"])], block, rp, heads, kv_len, masked)
            v_parts = dequantize(bufs, "v", v_meta, slot, j, sm.heads, ppb, sm.dtype, keys)
            sm.update(s, v_parts, block, key_hi[b], m_ref.at[j], l_ref.at[j], acc_ref.at[j], masked, fold["v"])

    run_pipeline(pipe, sched, next_slot,
                 by_coverage(words_body if k_meta.words else body, full_lo[b], full_hi[b], sm.tokens))
    write_results(groups, m_ref, l_ref, acc_ref, sinks=sinks, out=out, o_part=o_part, m_part=m_part,
                  l_part=l_part)


def write_results(groups: int, m_ref, l_ref, acc_ref, *, sinks, out, o_part, m_part, l_part):
    """`write_result` of every kv head group."""
    for j in range(groups):
        at = lambda ref: None if ref is None else ref.at[j]
        write_result(m_ref.at[j], l_ref.at[j], acc_ref.at[j], sinks=at(sinks), out=at(out),
                     o_part=at(o_part), m_part=at(m_part), l_part=at(l_part))


def full_range(row_pos, kv_len, *, window_left, sink_tokens, recent_tokens):
    """``[lo, hi)``: the key positions every valid row of a program sees in the
    main pass (the intersection of the rows' ranges; empty without valid rows)."""
    big = jnp.int32(2**30)
    valid = row_pos >= 0
    hi = jnp.minimum(kv_len - recent_tokens, jnp.min(jnp.where(valid, row_pos, big), axis=-1) + 1)
    lo = jnp.full_like(hi, sink_tokens)
    if window_left is not None:
        lo = jnp.maximum(lo, jnp.max(jnp.where(valid, row_pos, -big), axis=-1) - window_left)
    return lo, jnp.where(jnp.any(valid, axis=-1), hi, 0)


def table_width(tables, ppb: int) -> int:
    """Entries per block-table row in the kernel: whole blocks of ``ppb`` pages."""
    return cdiv(tables.shape[1], ppb) * ppb


def prefetch_operands(problem: Problem, tables, ppb: int, programs: int):
    """Scalar-prefetch operands: tables (rows padded to whole blocks, flattened),
    and per program (padded to ``programs`` with empty ones) ``seq``, ``kv_len``,
    the key range and the fully visible range."""
    kw = dict(window_left=problem.window_left, sink_tokens=problem.sink_tokens,
              recent_tokens=problem.recent_tokens)
    lo, hi = key_range(problem.row_pos, problem.kv_len, **kw)
    full_lo, full_hi = full_range(problem.row_pos, problem.kv_len, **kw)
    tables = pad_axis(tables.astype(jnp.int32), 1, table_width(tables, ppb)).reshape(-1)
    per_program = dict(seq=problem.seq_rows, kv_lens=problem.kv_len, key_lo=jnp.maximum(lo, 0), key_hi=hi,
                       full_lo=full_lo, full_hi=full_hi)
    return dict(tables=tables, **{k: pad_axis(v.astype(jnp.int32), 0, programs) for k, v in per_program.items()})


def padded_rows(rt: int) -> int:
    """Query rows per step padded to a multiple of 8 (the sublane count)."""
    return cdiv(rt, 8) * 8


def grouped(x, axis: int, hg: int, r: int, value=0):
    """Per-kv-head rows (kv heads on ``axis``, their rows on ``axis + 1``) →
    per-group rows ``[..., K/hg, R, ...]`` (row ``k·Rt + i`` of a group is row
    ``i`` of its kv head ``k``), padded to ``R`` rows with ``value``."""
    k, rt = x.shape[axis], x.shape[axis + 1]
    x = x.reshape(*x.shape[:axis], k // hg, hg * rt, *x.shape[axis + 2:])
    return pad_axis(x, axis + 1, r, value)


def ungrouped(x, heads: int, rt: int):
    """Inverse of `grouped` on ``[Bp, K/hg, R, *tail]`` → ``[Bp, K, Rt, *tail]``."""
    bp, groups = x.shape[:2]
    hg = heads // groups
    x = x[:, :, :hg * rt]
    return x.reshape(bp, heads, rt, *x.shape[3:])


def _rows_spec(per_core: int, *tail):
    """Program ``c·per_core + i``'s block of a per-program array at grid step ``(c, i)``."""
    return pl.BlockSpec((None, *tail), lambda c, i, *_: (c * per_core + i, *(0,) * len(tail)))


def _outputs(bp: int, per_core: int, groups: int, r: int, parts: int, hp: int, finalize: bool):
    """``out`` (finalized) or the partials ``o_part`` / ``m_part`` / ``l_part``."""
    o_spec, stat = _rows_spec(per_core, groups, parts, r, hp), _rows_spec(per_core, groups, r, LANES)
    if finalize:
        return dict(out=output((bp, groups, parts, r, hp), F32, o_spec), o_part=None, m_part=None, l_part=None)
    return dict(out=None, o_part=output((bp, groups, parts, r, hp), F32, o_spec),
                m_part=output((bp, groups, r, LANES), F32, stat), l_part=output((bp, groups, r, LANES), F32, stat))


def _collect(problem: Problem, res, rt: int, order=None):
    """Kernel results (padded programs dropped) → normalized float32 rows
    ``[Bp, K, Rt, Hv]`` (merging the full-precision windows' partial and the
    sinks when the kernel wrote partials); ``order``: the kernel's kv head ``i``
    is the problem's ``order[i]``."""
    heads, bp = problem.num_kv_heads, problem.num_programs
    back = None if order is None else jnp.asarray([order.index(h) for h in range(heads)])

    def rows(x):
        x = ungrouped(x, heads, rt)
        return x if back is None else x[:, back]

    if res.out is not None:
        return rows(merge_parts(res.out[:bp]))
    o = rows(merge_parts(res.o_part[:bp]))
    partials = [(o, rows(res.m_part[:bp, ..., 0]), rows(res.l_part[:bp, ..., 0]))]
    extra = window_partial(problem)
    if extra is not None:
        partials.append(extra)
    return plan_mod.merge(partials, None if problem.sinks is None else problem.sinks[None])


def launch_rows(kernel, problem: Problem, tables, *, sources: dict, queries: dict, values: str, ppb: int,
                name: str, cores: int | None = None, split_heads: bool = False, words: bool = False):
    """Launch a paged kernel over grid ``(cores, per_core)`` and return
    normalized float32 rows ``[Bp, K, Rt, Hv]``.

    Step ``(c, i)`` runs program ``c·per_core + i`` (``cores``: the target's
    TensorCores per device, the ``parallel`` axis; programs padded to a
    multiple of it are empty); a core's steps run in order, so each program's
    last block prefetches the next one's first (`run_pipeline`). The kv heads
    are taken ``hg`` at a time (`configs.kernel_head_group`; 1 with
    ``split_heads``): a step's query rows are
    grouped ``[K/hg, R, H]`` (`grouped`, ``R = hg·Rt`` padded to 8).
    ``sources``: name → `Source` (pools copied by the page pipeline);
    ``queries``: operand name → (query rows ``[Bp, K, Rt, H]``, source name),
    grouped and split into that source's parts; ``values``: the source whose
    parts the output accumulates. The kernel gets ``row_pos`` ``[R, 1]``, the
    queries ``[K/hg, parts, R, H']``, ``sinks``, the outputs, the ``m_ref`` /
    ``l_ref`` / ``acc_ref`` scratch, the pools ``hbm_*``, the slots ``buf_*``,
    ``sems``, ``next_slot``, ``metas``, ``sm`` (`Softmax`), ``ppb``, ``width``
    and ``per_core``. ``words``: the sources are read through
    `mosaic_tpu_pages.word_codes` (kv heads ``g`` and ``g + 4`` a group: the query rows, sinks and
    results are taken in the order of `WORD_PAIRS`)."""
    bp, heads, rt, _ = problem.q.shape
    order = [h for pair in WORD_PAIRS for h in pair] if words else None
    cores = max(1, min(cores or target_generation().cores_per_chip, bp))
    per_core = cdiv(bp, cores)
    programs = cores * per_core
    hg = 2 if words else kernel_head_group(heads, split_heads)
    groups = heads // hg
    r = padded_rows(hg * rt)
    metas = {n: source_meta(src, words) for n, src in sources.items()}
    finalize = not problem.has_windows
    sinks = None
    if finalize and problem.sinks is not None:
        sinks = problem.sinks if order is None else problem.sinks[jnp.asarray(order)]
        sinks = grouped(sinks, 0, hg, r)[:, :, None]                               # [K/hg, R, 1]
    row_pos = pad_axis(jnp.tile(problem.row_pos, (1, hg)), 1, r, -1)[:, :, None]   # [Bp, R, 1]
    row_pos = pad_axis(row_pos, 0, programs, -1)
    inputs = dict(row_pos=operand(row_pos, _rows_spec(per_core, r, 1)),
                  sinks=operand(sinks, pl.BlockSpec(tuple(sinks.shape), lambda c, i, *_: (0, 0, 0))
                                if sinks is not None else None))
    for qname, (rows, src_name) in queries.items():
        rows = rows if order is None else rows[:, jnp.asarray(order)]
        x = split_parts(grouped(rows, 1, hg, r), metas[src_name].per_byte)         # [Bp, K/hg, parts, R, H']
        inputs[qname] = operand(pad_axis(x, 0, programs), _rows_spec(per_core, *x.shape[1:]))
    for s, src in sources.items():
        for n, a in source_arrays(src, words).items():
            inputs[f"hbm_{s}_{n}"] = operand(a, pl.BlockSpec(memory_space=pl.ANY))
    vm = metas[values]
    scratch = dict(m_ref=pltpu.VMEM((groups, r, LANES), F32), l_ref=pltpu.VMEM((groups, r, LANES), F32),
                   acc_ref=pltpu.VMEM((groups, vm.per_byte, r, vm.part_dim), F32),
                   **pipeline_scratch(sources, ppb, words))
    sm = Softmax(ppb * problem.page_size, hg, rt, problem.scale, problem.soft_cap, problem.window_left,
                 problem.sink_tokens, problem.recent_tokens, problem.q.dtype, problem.precision)
    res = tpu_kernel_call(
        functools.partial(kernel, metas=metas, sm=sm, ppb=ppb, width=table_width(tables, ppb), per_core=per_core),
        grid=(cores, per_core), inputs=inputs, scratch=scratch,
        outputs=_outputs(programs, per_core, groups, r, vm.per_byte, vm.part_dim, finalize),
        scalar_prefetch=prefetch_operands(problem, tables, ppb, programs),
        dimension_semantics=("parallel", "arbitrary"), name=name)
    return _collect(problem, res, rt, order)


def attention_rows(problem: Problem, tables, *, pages_per_block: int, cores: int | None = None,
                   split_heads: bool = False):
    """Normalized float32 rows ``[Bp, K, Rt, Hv]`` of a `paged`/`ragged` problem
    (``tables``: the clamped block tables the programs' ``seq_rows`` index;
    ``cores``: the ``parallel`` grid axis, by default the target's TensorCores;
    ``split_heads``: one kv head per matmul, `configs.kernel_head_group`). Folded int4
    keys and values of 8 kv heads go through `mosaic_tpu_pages.word_codes`: a pair of kv
    heads per group, their codes two nibbles of the slot's int32 words."""
    sources = {"k": problem.k, "v": problem.values}
    words = all(word_codes(src) for src in sources.values())
    return launch_rows(_kernel, problem, tables, sources=sources,
                       queries={"q": (problem.q, "k")}, values="v", ppb=pages_per_block,
                       name="stellax_paged_attention_tpu", cores=cores, split_heads=split_heads, words=words)


def _tables(call, problem: Problem):
    return jnp.clip(call.block_tables.astype(jnp.int32), 0, problem.k.num_pages - 1)


def run_paged(call, config: TpuPagedConfig):
    """`paged_attention` on the Mosaic TPU kernel."""
    problem, finish = plan_mod.paged_problem(call)
    return finish(attention_rows(problem, _tables(call, problem), pages_per_block=config.pages_per_block))


def run_ragged(call, config: TpuRaggedConfig):
    """`ragged_paged_attention` on the Mosaic TPU kernel (programs of ``config.block_q`` tokens)."""
    problem, finish = plan_mod.ragged_problem(call, block_q=config.block_q)
    split = config.split_heads and can_split_heads(call)
    return finish(attention_rows(problem, _tables(call, problem), pages_per_block=config.pages_per_block,
                                 split_heads=split))

