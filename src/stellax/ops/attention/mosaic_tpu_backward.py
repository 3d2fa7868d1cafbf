"""Pallas Mosaic TPU flash attention, backward kernels (FlashAttention-2 style).

Given the forward's ``out`` and ``lse``, in XLA first (one elementwise pass):

    delta = rowsum(dO·O) - dlse                 [B, N, T] float32
    dsinks = -Σ_{b,t} exp(σ - lse)·delta        (with sinks)

then two kernels, deterministic (no atomics; each output block is owned by
one grid point and accumulated over a sequential "arbitrary" axis in VMEM):

1. dq, grid ``(b, kk, i, j)``: query block ``i`` (the ``G`` heads of kv head
   ``kk``, ``R = G·block_q`` rows) walks its row of the mask's block table
   (`mosaic_tpu.block_table`, the same schedule as the forward):

       s  = scale·q·kᵀ (soft cap);  p = exp(s - lse), 0 where masked
       dp = dO·vᵀ;  ds = p·(dp - delta);  ds *= 1 - tanh² [soft cap]
       dq += ds·k;   last step: dq *= scale

2. dk/dv, grid ``(b, kk, j, i)``: key block ``j`` walks its column of the
   table (the transposed classes: only query blocks that see it):

       dv += pᵀ·dO;  dk += dsᵀ·q;   last step: dk *= scale

A fully masked row has ``lse = -inf``; the kernels read ``+inf`` there (and in
padded rows), so ``p = 0`` and every gradient of the row is zero.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import operand, tpu_kernel_call
from .mosaic_tpu import F32, Layout, Step, TileMath, Tiling, Tokens, group_stats, schedule, token_inputs, vmem_limit


def _probabilities(math_: TileMath, q, k, lse, masked: bool, col, toks):
    """``(p, tanh)``: ``exp(s - lse)`` ``[R, bk]`` (0 where masked) and the soft cap's tanh."""
    s, tanh = math_.logits(q, k)
    p = jnp.exp(s - lse)
    if masked:
        q_pos, kv_pos, q_seg, kv_seg = (None if r is None else r[...] for r in toks)
        ok = math_.visible(col, q_pos, kv_pos, q_seg, kv_seg)
        if ok is not None:
            p = jnp.where(ok, p, 0.0)
    return p, tanh


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

    def update(masked: bool):
        k_tile = k[...]
        p, tanh = _probabilities(math_, q[...], k_tile, lse[...], masked, step.block(table, b, i, j),
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

    def update(masked: bool):
        q_tile, do = q[...], d_out[...]
        p, tanh = _probabilities(math_, q_tile, k[...], lse[...], masked, j, (q_pos, kv_pos, q_seg, kv_seg))
        dv_scr[...] += math_.dot_tn(p.astype(do.dtype), do)
        ds = _logit_grad(math_, p, tanh, do, v[...], delta[...])
        dk_scr[...] += math_.dot_tn(ds.astype(q_tile.dtype), q_tile)

    step.visit(table, b, j, i, update)

    @pl.when(i == pl.num_programs(3) - 1)
    def _finish():
        dk[...] = (dk_scr[...] * F32(math_.scale)).astype(dk.dtype)
        dv[...] = dv_scr[...].astype(dv.dtype)


# -- launches ------------------------------------------------------------------------------------
def _inputs(c, d_out, lse, delta, tiling: Tiling, layout: Layout, stats_spec, q_block, kv_block) -> dict:
    """Both kernels' operands: q, dO, k and v where ``layout`` puts them, lse
    (+inf for fully masked and padded rows) and delta in the grouped row
    layout of ``tiling`` (``stats_spec``), and the token arrays of query block
    ``q_block`` / key block ``kv_block`` (index maps of the grid step)."""
    lse_k = jnp.where(lse == -jnp.inf, jnp.inf, lse)
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


def _dkdv(c, d_out, lse, delta, block_q: int, block_kv: int):
    tiling = Tiling.of(c, block_q, block_kv)
    t_ = tiling
    table, step, width = schedule(c, tiling, kv_major=True)
    row_block = lambda b, j, i, tab: step.block(tab, b, j, i)
    layout = Layout(tiling, row_block, lambda b, j, i, tab: j)
    stats = pl.BlockSpec((None, None, None, t_.rows, 1),
                         lambda b, kk, j, i, tab: (b, kk, row_block(b, j, i, tab), 0, 0))
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


def backward(c, out, lse, d_out, d_lse, config):
    """``(dq, dk, dv, None, dsinks)`` of canonical operands ``c`` (no dense
    bias/mask) in the operands' dtypes, from the forward's ``out [B, T, N, Hv]``
    and ``lse [B, N, T]``."""
    d_out = d_out.astype(out.dtype)
    delta = jnp.sum(out.astype(F32) * d_out.astype(F32), axis=-1)  # [B, T, N]
    delta = jnp.swapaxes(delta, 1, 2)
    if d_lse is not None:
        delta = delta - d_lse.astype(F32)
    dsinks = None
    if c.sinks is not None:
        weight = jnp.exp(c.sinks.astype(F32)[None, :, None] - lse)  # lse is finite with a sink
        dsinks = (-jnp.sum(weight * delta, axis=(0, 2))).astype(c.sinks.dtype)
    dq = _dq(c, d_out, lse, delta, config.block_q_dq, config.block_kv_dq)
    dk, dv = _dkdv(c, d_out, lse, delta, config.block_q_dkv, config.block_kv_dkv)
    return dq, dk, dv, None, dsinks
