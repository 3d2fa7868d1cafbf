"""Pallas Triton flash attention, forward kernel (SM80+).

One program per (query block ``i``, batch ``b``, query head ``n``); it reads
kv head ``n // G`` (GQA without repeating K/V) and walks only the key blocks
of its row of the mask's `visit_schedule`:

    [lo, full_lo)       partial blocks: evaluate the mask on the tile
    [full_lo, full_hi)  full blocks: no mask evaluation
    [full_hi, hi)       partial blocks
    (blocks outside [lo, hi) are empty and never loaded)

Online softmax in the log2 domain (``exp2``; ``LOG2E`` folded into the
logits), per key block ``j`` with ``s`` the float32 logits tile:

    s   = scale · q·k_jᵀ;  s = cap·tanh(s/cap);  s = s + bias;  s₂ = s·log2(e)
    m'  = max(m, rowmax(s₂));  α = 2^(m - m');  p = 2^(s₂ - m')
    l   = α·l + rowsum(p);  acc = α·acc + p·v_j
    end: sinks join l (σ₂ = σ·log2 e), out = acc / l, lse = (m + log2 l)·ln 2

A row with no visible key (and no sink) gets ``out = 0`` and ``lse = -inf``.
Head dims are padded to a power of two in-kernel (masked loads/stores);
sequence lengths are padded to block multiples by the wrapper (padded keys
are masked, padded query rows dropped).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import (
    cdiv, dot, dot_nt, dot_tn, operand, output, pad_axis, padded_dim, triton_kernel_call, triton_precision,
)
from .masks import MaskSpec, classify_blocks, mask_fn, visit_schedule

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


@dataclasses.dataclass(frozen=True)
class TileMath:
    """Static description of the logits tile math, shared by all kernels."""

    spec: MaskSpec
    scale: float
    cap: float | None
    s_len: int           # true key length (keys >= s_len are padding)
    has_bias: bool
    has_mask: bool
    precision: Any       # as Triton runs it (`core.pallas.triton_precision`); DEFAULT for non-float32 operands

    @staticmethod
    def precision_of(c, native: bool):
        """The kernel's dot precision: the call's resolved ``c.precision`` for
        float32 operands (`triton_precision`), ``DEFAULT`` when ``native``
        (bf16/f16/fp8 operands contract natively)."""
        return lax.Precision.DEFAULT if native else triton_precision(c.precision)

    def dot(self, a, b, *, trans_a=False, trans_b=False):
        assert not (trans_a and trans_b)
        if trans_a:
            return dot_tn(a, b, precision=self.precision)
        if trans_b:
            return dot_nt(a, b, precision=self.precision)
        return dot(a, b, precision=self.precision)

    def logits(self, q, k, bias, qk_scale=None):
        """Natural-log logits tile (float32) and the soft-cap tanh (or None).
        ``qk_scale``: an optional float32 tile multiplying ``q·kᵀ`` (fp8 scales)."""
        s = self.dot(q, k, trans_b=True)
        if qk_scale is not None:
            s = s * qk_scale
        s = s * jnp.float32(self.scale)
        tanh = None
        if self.cap is not None:
            tanh = jnp.tanh(s / jnp.float32(self.cap))
            s = jnp.float32(self.cap) * tanh
        if bias is not None:
            s = s + bias.astype(jnp.float32)
        return s, tanh

    def valid(self, masked: bool, q_pos, kv_pos, q_seg, kv_seg, k_start, block_k: int, dense):
        """Visibility of the tile (None = all visible)."""
        ok = None
        if masked:
            qs = None if q_seg is None else q_seg[:, None]
            ks = None if kv_seg is None else kv_seg[None, :]
            ok = mask_fn(self.spec, q_pos[:, None], kv_pos[None, :], qs, ks)
            in_range = (k_start + jnp.arange(block_k, dtype=jnp.int32) < self.s_len)[None, :]
            ok = in_range if ok is None else jnp.logical_and(ok, in_range)
        if dense is not None:
            d = dense != 0
            ok = d if ok is None else jnp.logical_and(ok, d)
        return ok


class Tiling(NamedTuple):
    """Sizes of a kernel launch: ``q [b, t, n, h]``, ``k [b, s, n/g, h]``,
    ``v [.., hv]``; ``block_q × block_k`` tiles, ``nq × nk`` of them over the
    padded lengths ``tp × sp``; head dims padded to ``hp``, ``hvp``."""

    b: int
    t: int
    n: int
    h: int
    s: int
    g: int
    hv: int
    bq: int
    bk: int
    nq: int
    nk: int
    tp: int
    sp: int
    hp: int
    hvp: int

    @classmethod
    def of(cls, c, config) -> "Tiling":
        b, t, n, h = c.q.shape
        s, kh = c.k.shape[1:3]
        hv = c.v.shape[-1]
        bq, bk = config.block_q, config.block_k
        nq, nk = cdiv(t, bq), cdiv(s, bk)
        return cls(b, t, n, h, s, n // kh, hv, bq, bk, nq, nk, nq * bq, nk * bk, padded_dim(h), padded_dim(hv))


def block_schedule(c, tiling: Tiling, *, kv_major: bool = False):
    """The `visit_schedule` of the mask's blocks: ``[Bc, nq, 4]`` per query
    block, or (``kv_major``) ``[Bc, nk, 4]`` per key block."""
    classes = classify_blocks(c.spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, block_q=tiling.bq, block_k=tiling.bk)
    if kv_major:
        classes = jnp.swapaxes(classes, 1, 2)
    return visit_schedule(classes)


def bcast_index(size: int):
    """Index-map helper: the batch/head index, or 0 for a broadcast (size-1) dim."""
    return (lambda x: x) if size > 1 else (lambda x: 0)


def prepare_dense(x, tp: int, sp: int, dtype=None):
    """``[Bx, Nx, T|1, S|1]`` → ``[Bx, Nx, Tp, Sp]`` (broadcast, padded) or None."""
    if x is None:
        return None
    bx, nx, tx, sx = x.shape
    t = tp if tx == 1 else tx
    s = sp if sx == 1 else sx
    x = jnp.broadcast_to(x, (bx, nx, t, s))
    if dtype is not None:
        x = x.astype(dtype)
    return pad_axis(pad_axis(x, 2, tp), 3, sp)


class MaskOperands(NamedTuple):
    """The mask inputs of every attention kernel, padded to the block
    multiples: ``bias``/``mask`` ``[Bx, Nx, Tp, Sp]`` (mask as int8),
    positions ``[Bp, Tp|Sp]``, segments ``[Bs, Tp|Sp]`` (None without)."""

    bias: Any
    mask: Any
    q_pos: Any
    kv_pos: Any
    q_seg: Any
    kv_seg: Any

    @classmethod
    def of(cls, c, tiling: Tiling) -> "MaskOperands":
        tp, sp = tiling.tp, tiling.sp
        q_seg = kv_seg = None
        if c.spec.segments:
            segb = max(c.q_seg.shape[0], c.kv_seg.shape[0])
            q_seg = pad_axis(jnp.broadcast_to(c.q_seg, (segb, tiling.t)), 1, tp)
            kv_seg = pad_axis(jnp.broadcast_to(c.kv_seg, (segb, tiling.s)), 1, sp)
        return cls(prepare_dense(c.bias, tp, sp), prepare_dense(c.mask, tp, sp, jnp.int8),
                   pad_axis(c.q_pos, 1, tp), pad_axis(c.kv_pos, 1, sp), q_seg, kv_seg)

    def inputs(self, layout, schedule) -> dict:
        """The named operands (block specs from ``layout``, `QMajor` or a
        kv-major layout), with the block ``schedule``."""
        def named(x, spec):
            return None if x is None else operand(x, spec(x))
        return dict(bias=named(self.bias, layout.dense), mask=named(self.mask, layout.dense),
                    q_pos=named(self.q_pos, layout.q_tokens), kv_pos=named(self.kv_pos, layout.kv_tokens),
                    q_seg=named(self.q_seg, layout.q_tokens), kv_seg=named(self.kv_seg, layout.kv_tokens),
                    schedule=named(schedule, layout.schedule))


class QMajor:
    """Block specs of a launch over ``(i, b, n)``: query block ``i`` (with
    ``reverse``, the last block first), batch ``b``, query head ``n``; the
    program sees every key of kv head ``n // G``."""

    def __init__(self, tiling: Tiling, *, reverse: bool = False):
        self.tiling = tiling
        self.reverse = reverse

    def qi(self, i):
        return self.tiling.nq - 1 - i if self.reverse else i

    def rows(self, d: int):
        """``[B, Tp, N, d]``: the query block's rows of head ``n``."""
        return pl.BlockSpec((None, self.tiling.bq, None, d), lambda i, b, n: (b, self.qi(i), n, 0))

    def keys(self, d: int):
        """``[B, Sp, K, d]``: every key of kv head ``n // G``."""
        g = self.tiling.g
        return pl.BlockSpec((None, self.tiling.sp, None, d), lambda i, b, n: (b, 0, n // g, 0))

    def stats(self):
        """``[B, N, Tp]``: per-row statistics (lse, delta) of the query block."""
        return pl.BlockSpec((None, None, self.tiling.bq), lambda i, b, n: (b, n, self.qi(i)))

    def q_scales(self):
        """``[B, Tp, N]``: fp8 per-row query scales."""
        return pl.BlockSpec((None, self.tiling.bq, None), lambda i, b, n: (b, self.qi(i), n))

    def kv_scales(self):
        """``[B, Sp, K]``: fp8 per-row key/value scales of kv head ``n // G``."""
        g = self.tiling.g
        return pl.BlockSpec((None, self.tiling.sp, None), lambda i, b, n: (b, 0, n // g))

    def heads(self):
        """``[N]``: one value per query head (sinks)."""
        return pl.BlockSpec((1,), lambda i, b, n: (n,))

    def dense(self, x):
        """``[Bx, Nx, Tp, Sp]``: the query block's rows (bias, mask)."""
        fb, fn = bcast_index(x.shape[0]), bcast_index(x.shape[1])
        return pl.BlockSpec((None, None, self.tiling.bq, self.tiling.sp),
                            lambda i, b, n: (fb(b), fn(n), self.qi(i), 0))

    def q_tokens(self, x):
        """``[Bx, Tp]``: the query block's positions or segments."""
        fb = bcast_index(x.shape[0])
        return pl.BlockSpec((None, self.tiling.bq), lambda i, b, n: (fb(b), self.qi(i)))

    def kv_tokens(self, x):
        """``[Bx, Sp]``: every key's positions or segments."""
        fb = bcast_index(x.shape[0])
        return pl.BlockSpec((None, self.tiling.sp), lambda i, b, n: (fb(b), 0))

    def schedule(self, x):
        """``[Bc, nq, 4]``: the query block's key-block schedule."""
        fb = bcast_index(x.shape[0])
        return pl.BlockSpec((None, None, 4), lambda i, b, n: (fb(b), self.qi(i), 0))


def _forward_kernel(*, q, k, v, q_scale, k_scale, v_scale, bias, mask, sinks, q_pos, kv_pos, q_seg, kv_seg,
                    schedule, out, lse, visits, math_: TileMath, block_k: int, h: int, hv: int):
    """One (query block, batch, head) program: online softmax over the key
    blocks of the schedule (module docstring). fp8 attention (``q_scale``
    given): q/k/v tiles are codes, decoded to bf16 in registers; per-row
    float32 scales multiply the logits (s_q·s_k) and p (s_v)."""
    quantized = q_scale is not None
    decode = (lambda x: x.astype(jnp.float32).astype(jnp.bfloat16)) if quantized else (lambda x: x)
    block_q, hp, hvp = q.shape[0], q.shape[-1], v.shape[-1]
    head_mask = (jnp.arange(hp) < h)[None, :]
    vhead_mask = (jnp.arange(hvp) < hv)[None, :]
    q_tile = decode(plgpu.load(q, mask=head_mask, other=0.0))
    q_rows = q_scale[...] if quantized else None
    q_pos_tile = q_pos[...]
    q_seg_tile = q_seg[...] if q_seg is not None else None
    lo, full_lo, full_hi, hi = schedule[0], schedule[1], schedule[2], schedule[3]

    def step(masked):
        def body(j, carry):
            acc, m, l, count = carry
            ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
            k_tile = decode(plgpu.load(k.at[ks, :], mask=head_mask, other=0.0))
            qk_scale = q_rows[:, None] * k_scale[ks][None, :] if quantized else None
            s, _ = math_.logits(q_tile, k_tile, bias[:, ks] if bias is not None else None, qk_scale)
            s = s * jnp.float32(LOG2E)
            ok = math_.valid(masked, q_pos_tile, kv_pos[ks], q_seg_tile, kv_seg[ks] if kv_seg is not None else None,
                             j * block_k, block_k, mask[:, ks] if mask is not None else None)
            if ok is not None:
                s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(s - m_use[:, None])
            alpha = jnp.exp2(m - m_use)
            v_tile = decode(plgpu.load(v.at[ks, :], mask=vhead_mask, other=0.0))
            pv = p * v_scale[ks][None, :] if quantized else p
            acc = acc * alpha[:, None] + math_.dot(pv.astype(v_tile.dtype), v_tile)
            return acc, m_new, l * alpha + jnp.sum(p, axis=1), count + 1
        return body

    carry = (jnp.zeros((block_q, hvp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32), jnp.int32(0))
    carry = lax.fori_loop(lo, full_lo, step(True), carry)
    masked_visits = carry[3]
    carry = lax.fori_loop(full_lo, full_hi, step(False), carry)
    unmasked_visits = carry[3] - masked_visits
    acc, m, l, count = lax.fori_loop(full_hi, hi, step(True), carry)
    if sinks is not None:
        sink = sinks[0].astype(jnp.float32) * jnp.float32(LOG2E)
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp2(m - m_new)
        acc, l, m = acc * alpha[:, None], l * alpha + jnp.exp2(sink - m_new), m_new
    l_safe = jnp.where(l > 0, l, 1.0)
    plgpu.store(out, (acc / l_safe[:, None]).astype(out.dtype), mask=vhead_mask)
    lse[...] = jnp.where(l > 0, (jnp.where(m == -jnp.inf, 0.0, m) + jnp.log2(l_safe)) * jnp.float32(LN2), -jnp.inf)
    if visits is not None:
        visits[...] = jnp.full((block_q,), count * 65536 + unmasked_visits, jnp.int32)


def _fp8_row_scales(c, tiling: Tiling):
    """fp8 attention: ``(s_q [B, Tp, N], s_k [B, Sp, K], s_v [B, Sp, K])`` float32,
    ones for a float operand; float attention: Nones."""
    if c.row_scales is None:
        return None, None, None
    padded = []
    for x, s, length in zip((c.q, c.k, c.v), c.row_scales, (tiling.tp, tiling.sp, tiling.sp)):
        s = jnp.ones(x.shape[:3], jnp.float32) if s is None else s.astype(jnp.float32)
        padded.append(pad_axis(s, 1, length, 1.0))
    return tuple(padded)


def forward(c, config, *, debug: bool = False):
    """``(out [B, T, N, Hv], lse [B, N, T])`` of canonical operands ``c``; with
    ``debug`` also the per-row visit counts ``[B, N, T]`` int32
    (``visited·65536 + unmasked``).

    fp8 attention (`fp8.py`): ``c.q/k/v`` hold fp8 codes (or floats) with
    ``c.row_scales``; the output is in ``c.out_dtype``."""
    tiling = Tiling.of(c, config)
    b, t, n, s, hv, tp, sp = tiling.b, tiling.t, tiling.n, tiling.s, tiling.hv, tiling.tp, tiling.sp
    quantized = c.row_scales is not None
    math_ = TileMath(c.spec, c.scale, c.logits_soft_cap, s, c.bias is not None, c.mask is not None,
                     TileMath.precision_of(c, quantized or c.q.dtype != jnp.float32))
    at = QMajor(tiling, reverse=c.spec.causal)  # causal: heavy (late) query blocks first
    sq, sk, sv = _fp8_row_scales(c, tiling)
    outs = triton_kernel_call(
        functools.partial(_forward_kernel, math_=math_, block_k=tiling.bk, h=tiling.h, hv=hv),
        grid=(tiling.nq, b, n),
        inputs=dict(q=operand(pad_axis(c.q, 1, tp), at.rows(tiling.hp)),
                    k=operand(pad_axis(c.k, 1, sp), at.keys(tiling.hp)),
                    v=operand(pad_axis(c.v, 1, sp), at.keys(tiling.hvp)),
                    q_scale=operand(sq, at.q_scales()), k_scale=operand(sk, at.kv_scales()),
                    v_scale=operand(sv, at.kv_scales()),
                    sinks=operand(None if c.sinks is None else c.sinks.astype(jnp.float32), at.heads()),
                    **MaskOperands.of(c, tiling).inputs(at, block_schedule(c, tiling))),
        outputs=dict(out=output((b, tp, n, hv), c.out_dtype or c.q.dtype, at.rows(tiling.hvp)),
                     lse=output((b, n, tp), jnp.float32, at.stats()),
                     visits=output((b, n, tp), jnp.int32, at.stats()) if debug else None),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_flash_attention_forward",
    )
    out, lse = outs.out[:, :t], outs.lse[:, :, :t]
    if debug:
        return out, lse, outs.visits[:, :, :t]
    return out, lse
