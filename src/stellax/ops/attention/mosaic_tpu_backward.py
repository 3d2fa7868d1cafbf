"""Pallas Mosaic TPU flash attention, backward kernels (FlashAttention-2 style).

Given the forward's ``out`` and ``lse``, in XLA first (one elementwise pass):

    delta = rowsum(dO·O) - dlse                 [B, N, T] float32
    dsinks = -Σ_{b,t} exp(σ - lse)·delta        (with sinks)

then, unfused (``config.fused`` False), two kernels, deterministic (no
atomics; each output block is owned by one grid point and accumulated over a
sequential "arbitrary" axis in VMEM):

1. dq, grid ``(b, kk, i, j)``: query block ``i`` (the ``G`` heads of kv head
   ``kk``, ``R = G·block_q`` rows) walks its row of the mask's block table
   (`mosaic_tpu.block_table`, the same schedule as the forward):

       s  = scale·q·kᵀ (soft cap), -inf where masked;  p = exp(s - lse)
            (in base 2: p = 2^(log2(e)·s - log2(e)·lse), the scale and log2 e one multiply)
       dp = dO·vᵀ;  ds = p·(dp - delta);  ds *= 1 - tanh² [soft cap]
       dq += ds·k;   last step: dq *= scale

2. dk/dv, grid ``(b, kk, j, i)``: key block ``j`` walks its column of the
   table (the transposed classes: only query blocks that see it):

       dv += pᵀ·dO;  dk += dsᵀ·q;   last step: dk *= scale

3. fused (``config.fused``), one kernel, grid ``(b, kk, j, i)`` as dk/dv, both
   ``j`` and ``i`` "arbitrary": per visited pair ``s``, ``dp``, ``dv``, ``dk``
   and ``dq`` (5 matmuls, against 3 + 4 above), with the dq of the whole
   sequence of the head group resident in VMEM (float32 ``[nq·R, H]``):

       dq[rows of block i] += ds·k;   after the last pair: dq *= scale

   computed keys first (as splash's): ``sᵀ = k·qᵀ`` ``[bk, R]``, so ``dv += pᵀ·dO`` and
   ``dk += dsᵀ·q`` are plain products of the tiles it holds and only ``dq`` transposes
   one (``dsᵀ``), with lse, delta and the query positions as rows ``[1, R]`` and the key
   positions as columns (`_keys_first_inputs`); rows first, the kernel transposed both
   ``p`` and ``ds`` and broadcast lse/delta across the lanes (static v5e schedule at
   1024×1024: 9511 bundles a step against 8836, docs/attention.md).

   and written to HBM once, as one output block per ``(b, kk)``. Against
   splash's fused kernel (a dq partial per kv block in HBM, summed in XLA:
   ``nk`` extra ``[T, H]`` arrays written and read per head) this adds no
   HBM traffic; its limit is VMEM (``T·G·H·(4 + 2·itemsize)`` bytes,
   `configs.fused_dq_bytes`), and ``j`` is sequential (megacore chips split
   only ``b`` and ``kk``).

A fully masked row has ``lse = -inf``; the kernels read ``+inf`` there (and in
padded rows), so ``p = 0`` and every gradient of the row is zero.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import operand, output, tpu_kernel_call
from .configs import fused_dq_bytes, fused_output_buffers
from .mosaic_tpu import (
    F32, LOG2E, Layout, Step, TileMath, Tiling, Tokens, batch_index, group_stats, schedule, token_inputs,
    ungroup_rows, vmem_limit,
)


def _tokens(mask, toks):
    """The token tiles ``(q_pos, kv_pos, q_seg, kv_seg)`` a masked block reads for ``mask`` (the
    part `mosaic_tpu.Step.visit` gives): the segments only when it tests them."""
    q_pos, kv_pos, q_seg, kv_seg = toks
    if not mask.segments:
        q_seg = kv_seg = None
    return tuple(None if r is None else r[...] for r in (q_pos, kv_pos, q_seg, kv_seg))


def _probabilities(math_: TileMath, q, k, lse2, mask, col, toks):
    """``(p, tanh)``: ``exp(s - lse) = 2^(t - lse2)`` ``[R, bk]`` (0 where ``mask``, the part of
    the mask `Step.visit` gives or None, hides a pair; ``t`` the base-2 logits of
    `TileMath.logits2`, ``lse2 = log2(e)·lse``) and the soft cap's tanh."""
    t, tanh = math_.logits2(q, k)
    if mask is not None:
        q_pos, kv_pos, q_seg, kv_seg = _tokens(mask, toks)
        ok = math_.visible(col, q_pos, kv_pos, q_seg, kv_seg, spec=mask)
        if ok is not None:
            t = jnp.where(ok, t, -jnp.inf)  # 2^(-inf - lse2) = 0 (lse2 is finite or +inf)
    return jnp.exp2(t - lse2), tanh


def _logit_grad(math_: TileMath, p, tanh, d_out, v, delta):
    """``ds = p·(dO·vᵀ - delta)`` (times ``1 - tanh²`` under a soft cap), float32."""
    ds = p * (math_.dot_nt(d_out, v) - delta)
    if tanh is not None:
        ds = ds * (1.0 - tanh * tanh)
    return ds


# -- 1. dq, q-block major ------------------------------------------------------------------
def _dq_kernel(*, table, q, k, v, d_out, lse, delta, q_pos, kv_pos, q_seg, kv_seg, dq, dq_scr,
               math_: TileMath, step: Step):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _init():
        dq_scr[...] = jnp.zeros(dq_scr.shape, F32)

    def update(mask):
        k_tile = k[...]
        p, tanh = _probabilities(math_, q[...], k_tile, lse[...], mask, step.block(table, b, i, j),
                                 (q_pos, kv_pos, q_seg, kv_seg))
        ds = _logit_grad(math_, p, tanh, d_out[...], v[...], delta[...])
        dq_scr[...] += math_.dot(ds.astype(k_tile.dtype), k_tile)

    step.visit(table, b, i, j, update)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq[...] = (dq_scr[...] * F32(math_.scale)).astype(dq.dtype)


# -- 2. dk/dv, kv-block major -----------------------------------------------------------------
def _dkdv_kernel(*, table, q, k, v, d_out, lse, delta, q_pos, kv_pos, q_seg, kv_seg, dk, dv, dk_scr, dv_scr,
                 math_: TileMath, step: Step):
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)

    @pl.when(i == 0)
    def _init():
        dk_scr[...] = jnp.zeros(dk_scr.shape, F32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, F32)

    def update(mask):
        q_tile, do = q[...], d_out[...]
        p, tanh = _probabilities(math_, q_tile, k[...], lse[...], mask, j, (q_pos, kv_pos, q_seg, kv_seg))
        dv_scr[...] += math_.dot_tn(p.astype(do.dtype), do)
        ds = _logit_grad(math_, p, tanh, do, v[...], delta[...])
        dk_scr[...] += math_.dot_tn(ds.astype(q_tile.dtype), q_tile)

    step.visit(table, b, j, i, update)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        dk[...] = (dk_scr[...] * F32(math_.scale)).astype(dk.dtype)
        dv[...] = dv_scr[...].astype(dv.dtype)


# -- 3. fused: dq, dk and dv in one kv-block-major pass -------------------------------------------
def _fused_kernel(*, table, q, k, v, d_out, lse, delta, q_pos, kv_pos, q_seg, kv_seg, dq, dk, dv, dq_scr,
                  dk_scr, dv_scr, math_: TileMath, step: Step, rows: int, n_row_blocks: int):
    """Step ``(b, kk, j, i)``: key block ``j`` with the ``i``-th query block of its table column.
    ``dq_scr [n_row_blocks·rows, H]`` float32 holds the head group's whole dq (module docstring);
    ``dq`` is its output block, written at the group's last step."""
    b, j, i = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    last_j, last_i = pl.num_programs(2) - 1, pl.num_programs(3) - 1

    @pl.when(jnp.logical_and(j == 0, i == 0))
    def _init_dq():
        dq_scr[...] = jnp.zeros(dq_scr.shape, F32)

    @pl.when(i == 0)
    def _init_dkdv():
        dk_scr[...] = jnp.zeros(dk_scr.shape, F32)
        dv_scr[...] = jnp.zeros(dv_scr.shape, F32)

    def update(mask):
        # keys first: sᵀ = k·qᵀ [bk, R], so dv = pᵀᵀ·dO and dk = dsᵀᵀ·q are plain products and
        # only dq = (dsᵀ)ᵀ·k transposes; lse/delta are rows [1, R] (broadcast down the sublanes)
        q_tile, k_tile, do = q[...], k[...], d_out[...]
        t, tanh = math_.logits2(k_tile, q_tile)
        if mask is not None:
            q_pos_, kv_pos_, q_seg_, kv_seg_ = _tokens(mask, (q_pos, kv_pos, q_seg, kv_seg))
            ok = math_.visible(j, q_pos_, kv_pos_, q_seg_, kv_seg_, keys_first=True, spec=mask)
            if ok is not None:
                t = jnp.where(ok, t, -jnp.inf)  # 2^(-inf - lse) = 0 (lse is finite or +inf)
        p = jnp.exp2(t - lse[...])
        dv_scr[...] += math_.dot(p.astype(do.dtype), do)
        ds = p * (math_.dot_nt(v[...], do) - delta[...])
        if tanh is not None:
            ds = ds * (1.0 - tanh * tanh)
        ds = ds.astype(q_tile.dtype)
        dk_scr[...] += math_.dot(ds, q_tile)
        at = pl.ds(pl.multiple_of(step.block(table, b, j, i) * rows, rows), rows)
        dq_scr[at, :] += math_.dot_tn(ds, k_tile)

    step.visit(table, b, j, i, update)

    @pl.when(i == last_i)
    def _finish_dkdv():
        dk[...] = (dk_scr[...] * F32(math_.scale)).astype(dk.dtype)
        dv[...] = dv_scr[...].astype(dv.dtype)

    @pl.when(jnp.logical_and(j == last_j, i == last_i))
    def _finish_dq():
        def write(r, carry):
            at = pl.ds(pl.multiple_of(r * rows, rows), rows)
            dq[at, :] = (dq_scr[at, :] * F32(math_.scale)).astype(dq.dtype)
            return carry

        jax.lax.fori_loop(0, n_row_blocks, write, 0)


# -- launches ------------------------------------------------------------------------------------
def _inputs(c, d_out, lse, delta, tiling: Tiling, layout: Layout, stats_spec, q_block, kv_block) -> dict:
    """Both kernels' operands: q, dO, k and v where ``layout`` puts them, lse
    (+inf for fully masked and padded rows) and delta in the grouped row
    layout of ``tiling`` (``stats_spec``), and the token arrays of query block
    ``q_block`` / key block ``kv_block`` (index maps of the grid step)."""
    lse_k = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)  # base 2 (`_probabilities`)
    return dict(q=layout.rows_in(c.q), d_out=layout.rows_in(d_out),
                lse=operand(group_stats(lse_k, tiling, jnp.inf), stats_spec),
                delta=operand(group_stats(delta, tiling), stats_spec),
                k=layout.keys_in(c.k), v=layout.keys_in(c.v),
                **token_inputs(Tokens.of(c, tiling), tiling, q_block, kv_block))


def _dq(c, d_out, lse, delta, block_q: int, block_kv: int):
    tiling = Tiling.of(c, block_q, block_kv)
    t_ = tiling
    table, step, width = schedule(c, tiling)
    col = lambda b, i, j, tab: step.block(tab, b, i, j)
    layout = Layout(tiling, lambda b, i, j, tab: i, col)
    stats = pl.BlockSpec((None, None, None, t_.rows, 1), lambda b, kk, i, j, tab: (b, kk, i, 0, 0))
    outs = tpu_kernel_call(
        functools.partial(_dq_kernel, math_=TileMath.of(c, tiling), step=step),
        grid=(t_.b, t_.kh, t_.nq, width),
        scalar_prefetch=dict(table=table),
        inputs=_inputs(c, d_out, lse, delta, tiling, layout, stats, lambda b, i, j, tab: i, col),
        outputs=dict(dq=layout.rows_out(t_.h, c.q.dtype)),
        scratch=dict(dq_scr=pltpu.VMEM((t_.rows, t_.h), F32)),
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(tiling, jnp.dtype(c.q.dtype).itemsize, backward=True),
        name="stellax_splash_attention_backward_dq",
    )
    return layout.rows_result(outs.dq)


def _kv_major(c, block_q: int, block_kv: int):
    """What the kv-block-major kernels (dk/dv and fused) share: ``(tiling, table, step, width,
    row_block, layout, stats)`` — the transposed block table, the visited query block of step
    ``(b, j, i)``, the operands' layout and the ``[rows, 1]`` lse/delta block spec."""
    tiling = Tiling.of(c, block_q, block_kv)
    table, step, width = schedule(c, tiling, kv_major=True)
    row_block = lambda b, j, i, tab: step.block(tab, b, j, i)
    layout = Layout(tiling, row_block, lambda b, j, i, tab: j)
    stats = pl.BlockSpec((None, None, None, tiling.rows, 1),
                         lambda b, kk, j, i, tab: (b, kk, row_block(b, j, i, tab), 0, 0))
    return tiling, table, step, width, row_block, layout, stats


def _dkdv(c, d_out, lse, delta, block_q: int, block_kv: int):
    tiling, table, step, width, row_block, layout, stats = _kv_major(c, block_q, block_kv)
    t_ = tiling
    outs = tpu_kernel_call(
        functools.partial(_dkdv_kernel, math_=TileMath.of(c, tiling), step=step),
        grid=(t_.b, t_.kh, t_.nk, width),
        scalar_prefetch=dict(table=table),
        inputs=_inputs(c, d_out, lse, delta, tiling, layout, stats, row_block, lambda b, j, i, tab: j),
        outputs=dict(dk=layout.keys_out(t_.h, c.k.dtype), dv=layout.keys_out(t_.hv, c.v.dtype)),
        scratch=dict(dk_scr=pltpu.VMEM((t_.bk, t_.h), F32), dv_scr=pltpu.VMEM((t_.bk, t_.hv), F32)),
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=vmem_limit(tiling, jnp.dtype(c.q.dtype).itemsize, backward=True),
        name="stellax_splash_attention_backward_dkdv",
    )
    return layout.keys_result(outs.dk), layout.keys_result(outs.dv)


def _resident_dq_output(tiling: Tiling, layout: Layout, dtype):
    """The fused kernel's dq: one output block per ``(b, kk)`` holding the group's whole
    sequence, ``[T, H]`` of ``[B, T, N·H]`` (direct layout) or ``[nq·R, H]`` of
    ``[B, K, nq·R, H]`` (grouped: `group_rows` with the block axes merged)."""
    t_ = tiling
    if layout.direct:
        spec = pl.BlockSpec((None, t_.tp, t_.h), lambda b, kk, j, i, tab: (b, 0, kk))
        return output((t_.b, t_.t, t_.n * t_.h), dtype, spec)
    spec = pl.BlockSpec((None, None, t_.nq * t_.rows, t_.h), lambda b, kk, j, i, tab: (b, kk, 0, 0))
    return output((t_.b, t_.kh, t_.nq * t_.rows, t_.h), dtype, spec)


def _keys_first_inputs(c, d_out, lse, delta, tiling: Tiling, layout: Layout, row_block) -> dict:
    """The fused kernel's operands (`_inputs`) with the per-query ones as rows: lse, delta and
    the query positions/segments ``[.., 1, R]``, the key positions/segments columns
    ``[Bx, Sp, 1]`` (its tiles are ``[bk, R]``, keys first)."""
    t_ = tiling
    lse_k = jnp.where(lse == -jnp.inf, jnp.inf, lse * LOG2E)  # base 2 (`_probabilities`)
    as_row = lambda x: x.reshape(*x.shape[:-2], 1, t_.rows)   # [.., R, 1] -> [.., 1, R]: same order
    stats = pl.BlockSpec((None, None, None, 1, t_.rows),
                         lambda b, kk, j, i, tab: (b, kk, row_block(b, j, i, tab), 0, 0))
    toks = Tokens.of(c, tiling)

    def rows(x):
        if x is None:
            return None
        fb = batch_index(x.shape[0])
        return operand(as_row(x), pl.BlockSpec((None, None, 1, t_.rows),
                                               lambda b, kk, j, i, tab: (fb(b), row_block(b, j, i, tab), 0, 0)))

    def cols(x):
        if x is None:
            return None
        fb = batch_index(x.shape[0])
        return operand(x.reshape(x.shape[0], t_.sp, 1),
                       pl.BlockSpec((None, t_.bk, 1), lambda b, kk, j, i, tab: (fb(b), j, 0)))

    return dict(q=layout.rows_in(c.q), d_out=layout.rows_in(d_out),
                lse=operand(as_row(group_stats(lse_k, tiling, jnp.inf)), stats),
                delta=operand(as_row(group_stats(delta, tiling)), stats),
                k=layout.keys_in(c.k), v=layout.keys_in(c.v),
                q_pos=rows(toks.q_pos), q_seg=rows(toks.q_seg), kv_pos=cols(toks.kv_pos), kv_seg=cols(toks.kv_seg))


def _fused(c, d_out, lse, delta, block_q: int, block_kv: int):
    """``(dq, dk, dv)`` from the fused kernel (module docstring, 3.)."""
    tiling, table, step, width, row_block, layout, _ = _kv_major(c, block_q, block_kv)
    t_ = tiling
    itemsize = jnp.dtype(c.q.dtype).itemsize
    outs = tpu_kernel_call(
        functools.partial(_fused_kernel, math_=TileMath.of(c, tiling), step=step, rows=t_.rows,
                          n_row_blocks=t_.nq),
        grid=(t_.b, t_.kh, t_.nk, width),
        scalar_prefetch=dict(table=table),
        inputs=_keys_first_inputs(c, d_out, lse, delta, tiling, layout, row_block),
        outputs=dict(dq=_resident_dq_output(tiling, layout, c.q.dtype),
                     dk=layout.keys_out(t_.h, c.k.dtype), dv=layout.keys_out(t_.hv, c.v.dtype)),
        scratch=dict(dq_scr=pltpu.VMEM((t_.nq * t_.rows, t_.h), F32),
                     dk_scr=pltpu.VMEM((t_.bk, t_.h), F32), dv_scr=pltpu.VMEM((t_.bk, t_.hv), F32)),
        dimension_semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
        vmem_limit_bytes=vmem_limit(tiling, itemsize, backward=True,
                                    resident=fused_dq_bytes(t_.t, t_.g, t_.h, itemsize, t_.bq,
                                                            output_buffers=fused_output_buffers(t_.b, t_.kh))),
        name="stellax_splash_attention_backward_fused",
    )
    dq = outs.dq
    if layout.direct:
        dq = dq.reshape(t_.b, t_.t, t_.n, t_.h)
    else:
        dq = ungroup_rows(dq.reshape(t_.b, t_.kh, t_.nq, t_.rows, t_.h), t_)
    return dq, layout.keys_result(outs.dk), layout.keys_result(outs.dv)


def backward(c, out, lse, d_out, d_lse, config):
    """``(dq, dk, dv, None, dsinks)`` of canonical operands ``c`` (no dense
    bias/mask) in the operands' dtypes, from the forward's ``out [B, T, N, Hv]``
    and ``lse [B, N, T]``: the fused kernel with ``config.fused`` (on the dk/dv blocks),
    else the dq and dk/dv kernels."""
    d_out = d_out.astype(out.dtype)
    delta = jnp.sum(out.astype(F32) * d_out.astype(F32), axis=-1)  # [B, T, N]
    delta = jnp.swapaxes(delta, 1, 2)
    if d_lse is not None:
        delta = delta - d_lse.astype(F32)
    dsinks = None
    if c.sinks is not None:
        weight = jnp.exp(c.sinks.astype(F32)[None, :, None] - lse)  # lse is finite with a sink
        dsinks = (-jnp.sum(weight * delta, axis=(0, 2))).astype(c.sinks.dtype)
    if config.fused:
        dq, dk, dv = _fused(c, d_out, lse, delta, config.block_q_dkv, config.block_kv_dkv)
    else:
        dq = _dq(c, d_out, lse, delta, config.block_q_dq, config.block_kv_dq)
        dk, dv = _dkdv(c, d_out, lse, delta, config.block_q_dkv, config.block_kv_dkv)
    return dq, dk, dv, None, dsinks
