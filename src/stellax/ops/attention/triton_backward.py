"""Pallas Triton flash attention, backward kernels (FlashAttention-2 style).

Three kernels, deterministic (no atomics; every sum runs in a fixed order):

1. preprocess, per (q block, b, n): ``delta = rowsum(dO·O) - dlse`` and,
   with sinks, the per-row sink gradient ``-exp(σ - lse)·delta`` (summed over
   rows in XLA: ``dsinks``).
2. dq, per (q block, b, n), over the q block's key-block schedule:

       p  = 2^(s₂ - lse₂);  dp = dO·vᵀ;  ds = p·(dp - delta)
       dbias tile = ds (written for every key block, zeros where skipped)
       ds *= 1 - tanh² [soft cap];  dq += ds·k;  dq *= scale

3. dk/dv, per (k block, b, kv head), over the G query heads of the group and
   the key block's query-block schedule (the transposed schedule):

       dv += pᵀ·dO;  dk += dsᵀ·q;  dk *= scale

``lse`` of a fully masked row is ``-inf``; the kernels use ``+inf`` there so
``p = 0`` and every gradient of the row is zero.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import operand, output, pad_axis, triton_kernel_call
from .triton import LOG2E, MaskOperands, QMajor, TileMath, Tiling, bcast_index, block_schedule


class KMajor:
    """Block specs of a launch over ``(j, b, kk)``: key block ``j``, batch
    ``b``, kv head ``kk``; the program sees every query row of the ``G``
    query heads of kv head ``kk``."""

    def __init__(self, tiling: Tiling):
        self.tiling = tiling

    def rows(self, d: int):
        """``[B, Tp, N, d]``: every row of the group's ``G`` query heads."""
        t = self.tiling
        return pl.BlockSpec((None, t.tp, t.g, d), lambda j, b, kk: (b, 0, kk, 0))

    def keys(self, d: int):
        """``[B, Sp, K, d]``: the key block of kv head ``kk``."""
        return pl.BlockSpec((None, self.tiling.bk, None, d), lambda j, b, kk: (b, j, kk, 0))

    def stats(self):
        """``[B, N, Tp]``: per-row statistics of the group's query heads."""
        t = self.tiling
        return pl.BlockSpec((None, t.g, t.tp), lambda j, b, kk: (b, kk, 0))

    def dense(self, x):
        """``[Bx, Nx, Tp, Sp]``: the key block's columns, for the group's heads
        (``Nx = N``) or the one broadcast head (``Nx = 1``)."""
        fb, per_head = bcast_index(x.shape[0]), x.shape[1] > 1
        t = self.tiling
        return pl.BlockSpec((None, t.g if per_head else 1, t.tp, t.bk),
                            lambda j, b, kk: (fb(b), kk if per_head else 0, 0, j))

    def q_tokens(self, x):
        """``[Bx, Tp]``: every query row's positions or segments."""
        fb = bcast_index(x.shape[0])
        return pl.BlockSpec((None, self.tiling.tp), lambda j, b, kk: (fb(b), 0))

    def kv_tokens(self, x):
        """``[Bx, Sp]``: the key block's positions or segments."""
        fb = bcast_index(x.shape[0])
        return pl.BlockSpec((None, self.tiling.bk), lambda j, b, kk: (fb(b), j))

    def schedule(self, x):
        """``[Bc, nk, 4]``: the key block's query-block schedule."""
        fb = bcast_index(x.shape[0])
        return pl.BlockSpec((None, None, 4), lambda j, b, kk: (fb(b), j, 0))


class Rows(NamedTuple):
    """The row operands of the dq and dk/dv kernels, padded: ``q``, ``k``,
    ``v``, ``d_out`` (in ``out``'s dtype), ``lse`` (``+inf`` for a fully
    masked row, so ``p = 0`` there) and ``delta``."""

    q: Any
    k: Any
    v: Any
    d_out: Any
    lse: Any
    delta: Any

    def inputs(self, layout, tiling: Tiling) -> dict:
        hp, hvp = tiling.hp, tiling.hvp
        return dict(q=operand(self.q, layout.rows(hp)), k=operand(self.k, layout.keys(hp)),
                    v=operand(self.v, layout.keys(hvp)), d_out=operand(self.d_out, layout.rows(hvp)),
                    lse=operand(self.lse, layout.stats()), delta=operand(self.delta, layout.stats()))


# -- 1. preprocess ------------------------------------------------------------------------
def _preprocess_kernel(*, out, d_out, d_lse, lse, sinks, delta, dsink, hv: int):
    vmask = (jnp.arange(out.shape[-1]) < hv)[None, :]
    o = plgpu.load(out, mask=vmask, other=0.0).astype(jnp.float32)
    do = plgpu.load(d_out, mask=vmask, other=0.0).astype(jnp.float32)
    row_delta = jnp.sum(o * do, axis=1)
    if d_lse is not None:
        row_delta = row_delta - d_lse[...]
    delta[...] = row_delta
    if sinks is not None:
        dsink[...] = -jnp.exp(sinks[0] - lse[...]) * row_delta


def _preprocess(c, out_p, d_out_p, lse, d_lse, tiling: Tiling):
    """``delta = rowsum(dO·O) - dlse`` ``[B, N, Tp]`` and ``dsinks`` (or None)."""
    at, tp = QMajor(tiling), tiling.tp
    with_sinks = c.sinks is not None
    pad_stat = lambda x, value=0.0: None if x is None else pad_axis(x.astype(jnp.float32), 2, tp, value)
    stat = output((tiling.b, tiling.n, tp), jnp.float32, at.stats())
    outs = triton_kernel_call(
        functools.partial(_preprocess_kernel, hv=tiling.hv),
        grid=(tiling.nq, tiling.b, tiling.n),
        inputs=dict(out=operand(out_p, at.rows(tiling.hvp)), d_out=operand(d_out_p, at.rows(tiling.hvp)),
                    d_lse=operand(pad_stat(d_lse), at.stats()),
                    lse=operand(pad_stat(lse) if with_sinks else None, at.stats()),
                    sinks=operand(c.sinks.astype(jnp.float32) if with_sinks else None, at.heads())),
        outputs=dict(delta=stat, dsink=stat if with_sinks else None),
        num_warps=4, num_stages=1, name="stellax_flash_attention_backward_preprocess",
    )
    dsinks = None
    if with_sinks:
        dsinks = jnp.sum(outs.dsink[:, :, :tiling.t], axis=(0, 2)).astype(c.sinks.dtype)
    return outs.delta, dsinks


# -- 2. dq (and dbias), q-block major ---------------------------------------------------------
def _dq_kernel(*, q, k, v, bias, mask, d_out, lse, delta, q_pos, kv_pos, q_seg, kv_seg, schedule, dq, dbias,
               math_: TileMath, block_k: int, nk: int, h: int, hv: int):
    hp, hvp = q.shape[-1], v.shape[-1]
    head_mask = (jnp.arange(hp) < h)[None, :]
    vhead_mask = (jnp.arange(hvp) < hv)[None, :]
    q_tile = plgpu.load(q, mask=head_mask, other=0.0)
    do = plgpu.load(d_out, mask=vhead_mask, other=0.0)
    lse2 = lse[...] * jnp.float32(LOG2E)
    row_delta = delta[...]
    q_pos_tile = q_pos[...]
    q_seg_tile = q_seg[...] if q_seg is not None else None
    lo, full_lo, full_hi, hi = schedule[0], schedule[1], schedule[2], schedule[3]

    def step(masked):
        def body(j, acc):
            ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
            k_tile = plgpu.load(k.at[ks, :], mask=head_mask, other=0.0)
            v_tile = plgpu.load(v.at[ks, :], mask=vhead_mask, other=0.0)
            s, tanh = math_.logits(q_tile, k_tile, bias[:, ks] if bias is not None else None)
            p = jnp.exp2(s * jnp.float32(LOG2E) - lse2[:, None])
            ok = math_.valid(masked, q_pos_tile, kv_pos[ks], q_seg_tile, kv_seg[ks] if kv_seg is not None else None,
                             j * block_k, block_k, mask[:, ks] if mask is not None else None)
            if ok is not None:
                p = jnp.where(ok, p, 0.0)
            ds = p * (math_.dot(do, v_tile, trans_b=True) - row_delta[:, None])
            if dbias is not None:
                dbias[:, ks] = ds
            if tanh is not None:
                ds = ds * (1.0 - tanh * tanh)
            return acc + math_.dot(ds.astype(k_tile.dtype), k_tile)
        return body

    acc = jnp.zeros((q.shape[0], hp), jnp.float32)
    acc = lax.fori_loop(lo, full_lo, step(True), acc)
    acc = lax.fori_loop(full_lo, full_hi, step(False), acc)
    acc = lax.fori_loop(full_hi, hi, step(True), acc)
    plgpu.store(dq, (acc * jnp.float32(math_.scale)).astype(dq.dtype), mask=head_mask)
    if dbias is not None:  # the key blocks the schedule skips: zero gradient
        zeros = jnp.zeros((q.shape[0], block_k), jnp.float32)

        def zero(j, carry):
            dbias[:, pl.ds(pl.multiple_of(j * block_k, block_k), block_k)] = zeros
            return carry

        lax.fori_loop(0, lo, zero, 0)
        lax.fori_loop(hi, nk, zero, 0)


def _dq(c, rows: Rows, masks: MaskOperands, math_: TileMath, tiling: Tiling, config):
    """``dq [B, Tp, N, H]`` and the per-head ``dbias [B, N, Tp, Sp]`` float32 (or None)."""
    at, b, n = QMajor(tiling), tiling.b, tiling.n
    dbias = None
    if masks.bias is not None:  # per head and row, reduced to bias's shape in XLA
        shape = jax.ShapeDtypeStruct((b, n, tiling.tp, tiling.sp), jnp.float32)
        dbias = output(shape.shape, shape.dtype, at.dense(shape))
    outs = triton_kernel_call(
        functools.partial(_dq_kernel, math_=math_, block_k=tiling.bk, nk=tiling.nk, h=tiling.h, hv=tiling.hv),
        grid=(tiling.nq, b, n),
        inputs=dict(**rows.inputs(at, tiling), **masks.inputs(at, block_schedule(c, tiling))),
        outputs=dict(dq=output((b, tiling.tp, n, tiling.h), c.q.dtype, at.rows(tiling.hp)),
                     dbias=dbias),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_flash_attention_backward_dq",
    )
    return outs.dq, outs.dbias


# -- 3. dk/dv, k-block major over the group's query heads -----------------------------------
def _dkdv_kernel(*, q, k, v, bias, mask, d_out, lse, delta, q_pos, kv_pos, q_seg, kv_seg, schedule, dk, dv,
                 math_: TileMath, block_q: int, block_k: int, h: int, hv: int):
    j = pl.program_id(0)
    hp, hvp = k.shape[-1], v.shape[-1]
    head_mask = (jnp.arange(hp) < h)[None, :]
    vhead_mask = (jnp.arange(hvp) < hv)[None, :]
    k_tile = plgpu.load(k, mask=head_mask, other=0.0)
    v_tile = plgpu.load(v, mask=vhead_mask, other=0.0)
    kv_pos_tile = kv_pos[...]
    kv_seg_tile = kv_seg[...] if kv_seg is not None else None
    lo, full_lo, full_hi, hi = schedule[0], schedule[1], schedule[2], schedule[3]
    dense_head = lambda ref, gi: gi if ref.shape[0] > 1 else 0  # per-head or broadcast bias/mask

    def head(gi, carry):
        def step(masked):
            def body(i, carry):
                dk_acc, dv_acc = carry
                qs = pl.ds(pl.multiple_of(i * block_q, block_q), block_q)
                q_tile = plgpu.load(q.at[qs, gi, :], mask=head_mask, other=0.0)
                do = plgpu.load(d_out.at[qs, gi, :], mask=vhead_mask, other=0.0)
                lse2 = lse[gi, qs] * jnp.float32(LOG2E)
                s, tanh = math_.logits(q_tile, k_tile, bias[dense_head(bias, gi), qs, :] if bias is not None else None)
                p = jnp.exp2(s * jnp.float32(LOG2E) - lse2[:, None])
                ok = math_.valid(masked, q_pos[qs], kv_pos_tile, q_seg[qs] if q_seg is not None else None,
                                 kv_seg_tile, j * block_k, block_k,
                                 mask[dense_head(mask, gi), qs, :] if mask is not None else None)
                if ok is not None:
                    p = jnp.where(ok, p, 0.0)
                dv_acc = dv_acc + math_.dot(p.astype(do.dtype), do, trans_a=True)
                ds = p * (math_.dot(do, v_tile, trans_b=True) - delta[gi, qs][:, None])
                if tanh is not None:
                    ds = ds * (1.0 - tanh * tanh)
                return dk_acc + math_.dot(ds.astype(q_tile.dtype), q_tile, trans_a=True), dv_acc
            return body

        carry = lax.fori_loop(lo, full_lo, step(True), carry)
        carry = lax.fori_loop(full_lo, full_hi, step(False), carry)
        return lax.fori_loop(full_hi, hi, step(True), carry)

    dk_acc, dv_acc = lax.fori_loop(0, q.shape[1], head, (jnp.zeros((k.shape[0], hp), jnp.float32),
                                                         jnp.zeros((k.shape[0], hvp), jnp.float32)))
    plgpu.store(dk, (dk_acc * jnp.float32(math_.scale)).astype(dk.dtype), mask=head_mask)
    plgpu.store(dv, dv_acc.astype(dv.dtype), mask=vhead_mask)


def _dkdv(c, rows: Rows, masks: MaskOperands, math_: TileMath, tiling: Tiling, config):
    """``dk [B, Sp, K, H]``, ``dv [B, Sp, K, Hv]``."""
    at, b, kh = KMajor(tiling), tiling.b, tiling.n // tiling.g
    outs = triton_kernel_call(
        functools.partial(_dkdv_kernel, math_=math_, block_q=tiling.bq, block_k=tiling.bk, h=tiling.h,
                          hv=tiling.hv),
        grid=(tiling.nk, b, kh),
        inputs=dict(**rows.inputs(at, tiling), **masks.inputs(at, block_schedule(c, tiling, kv_major=True))),
        outputs=dict(dk=output((b, tiling.sp, kh, tiling.h), c.k.dtype, at.keys(tiling.hp)),
                     dv=output((b, tiling.sp, kh, tiling.hv), c.v.dtype, at.keys(tiling.hvp))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_flash_attention_backward_dkdv",
    )
    return outs.dk, outs.dv


def _reduce_dbias(bias, dbias_full, t: int, s: int):
    """The per-head ``[B, N, Tp, Sp]`` bias gradient summed to ``bias``'s
    broadcast shape ``[Bx, Nx, T|1, S|1]``."""
    if bias is None:
        return None
    db = dbias_full[:, :, :t, :s]
    axes = tuple(a for a, (full, want) in enumerate(zip(db.shape, bias.shape)) if want == 1 and full > 1)
    if axes:
        db = jnp.sum(db, axis=axes, keepdims=True)
    return db.astype(bias.dtype)


def backward(c, out, lse, d_out, d_lse, config):
    """``(dq, dk, dv, dbias, dsinks)`` in the operands' dtypes."""
    tiling = Tiling.of(c, config)
    tp, sp = tiling.tp, tiling.sp
    math_ = TileMath(c.spec, c.scale, c.logits_soft_cap, tiling.s, c.bias is not None, c.mask is not None,
                     TileMath.precision_of(c, c.q.dtype != jnp.float32))
    out_p, d_out_p = pad_axis(out, 1, tp), pad_axis(d_out.astype(out.dtype), 1, tp)
    delta, dsinks = _preprocess(c, out_p, d_out_p, lse, d_lse, tiling)
    rows = Rows(pad_axis(c.q, 1, tp), pad_axis(c.k, 1, sp), pad_axis(c.v, 1, sp), d_out_p,
                pad_axis(jnp.where(lse == -jnp.inf, jnp.inf, lse), 2, tp), delta)
    masks = MaskOperands.of(c, tiling)
    dq, dbias_full = _dq(c, rows, masks, math_, tiling, config)
    dk, dv = _dkdv(c, rows, masks, math_, tiling, config)
    t, s = tiling.t, tiling.s
    return dq[:, :t], dk[:, :s], dv[:, :s], _reduce_dbias(c.bias, dbias_full, t, s), dsinks
