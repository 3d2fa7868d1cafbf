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
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import triton_call
from .masks import MaskSpec, classify_blocks, mask_fn, visit_schedule

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def padded_dim(d: int) -> int:
    return max(16, 1 << (int(d) - 1).bit_length())


def pad_axis(x, axis: int, length: int, value=0):
    extra = length - x.shape[axis]
    if extra <= 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


@dataclasses.dataclass(frozen=True)
class TileMath:
    """Static description of the logits tile math, shared by all kernels."""

    spec: MaskSpec
    scale: float
    cap: float | None
    s_len: int           # true key length (keys >= s_len are padding)
    has_bias: bool
    has_mask: bool
    allow_tf32: bool

    def dot(self, a, b, *, trans_a=False, trans_b=False):
        return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=self.allow_tf32)

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


def _schedule(spec, q_pos, kv_pos, q_seg, kv_seg, block_q, block_k, *, kv_major=False):
    classes = classify_blocks(spec, q_pos, kv_pos, q_seg, kv_seg, block_q=block_q, block_k=block_k)
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


def _forward_kernel(*refs, math_: TileMath, block_q, block_k, h, hv, segments, has_sinks, debug, reverse,
                    quantized=False):
    refs = list(refs)
    q_ref, k_ref, v_ref = refs.pop(0), refs.pop(0), refs.pop(0)
    # fp8 attention (see fp8.py): q/k/v tiles are codes, decoded to bf16 in
    # registers; per-row float32 scales multiply the logits (s_q·s_k) and p (s_v).
    qs_ref, ks_ref, vs_ref = (refs.pop(0), refs.pop(0), refs.pop(0)) if quantized else (None, None, None)
    decode = (lambda x: x.astype(jnp.float32).astype(jnp.bfloat16)) if quantized else (lambda x: x)
    bias_ref = refs.pop(0) if math_.has_bias else None
    mask_ref = refs.pop(0) if math_.has_mask else None
    sink_ref = refs.pop(0) if has_sinks else None
    qpos_ref, kvpos_ref = refs.pop(0), refs.pop(0)
    qseg_ref = refs.pop(0) if segments else None
    kvseg_ref = refs.pop(0) if segments else None
    sched_ref = refs.pop(0)
    o_ref, lse_ref = refs.pop(0), refs.pop(0)
    count_ref = refs.pop(0) if debug else None

    hp, hvp = q_ref.shape[-1], v_ref.shape[-1]
    head_mask = (jnp.arange(hp) < h)[None, :]
    vhead_mask = (jnp.arange(hvp) < hv)[None, :]
    q = decode(plgpu.load(q_ref, mask=head_mask, other=0.0))
    q_scale = qs_ref[...] if quantized else None
    q_pos = qpos_ref[...]
    q_seg = qseg_ref[...] if segments else None
    lo, full_lo, full_hi, hi = sched_ref[0], sched_ref[1], sched_ref[2], sched_ref[3]

    def step(masked):
        def body(j, carry):
            acc, m, l, visits = carry
            ks = pl.ds(pl.multiple_of(j * block_k, block_k), block_k)
            k = decode(plgpu.load(k_ref.at[ks, :], mask=head_mask, other=0.0))
            bias = bias_ref[:, ks] if bias_ref is not None else None
            qk_scale = q_scale[:, None] * ks_ref[ks][None, :] if quantized else None
            s, _ = math_.logits(q, k, bias, qk_scale)
            s = s * jnp.float32(LOG2E)
            ok = math_.valid(masked, q_pos, kvpos_ref[ks], q_seg, kvseg_ref[ks] if segments else None,
                             j * block_k, block_k, mask_ref[:, ks] if mask_ref is not None else None)
            if ok is not None:
                s = jnp.where(ok, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            m_use = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp2(s - m_use[:, None])
            alpha = jnp.exp2(m - m_use)
            v = decode(plgpu.load(v_ref.at[ks, :], mask=vhead_mask, other=0.0))
            pv = p * vs_ref[ks][None, :] if quantized else p
            acc = acc * alpha[:, None] + math_.dot(pv.astype(v.dtype), v)
            return acc, m_new, l * alpha + jnp.sum(p, axis=1), visits + 1
        return body

    carry = (jnp.zeros((block_q, hvp), jnp.float32), jnp.full((block_q,), -jnp.inf, jnp.float32),
             jnp.zeros((block_q,), jnp.float32), jnp.int32(0))
    carry = lax.fori_loop(lo, full_lo, step(True), carry)
    masked_visits = carry[3]
    carry = lax.fori_loop(full_lo, full_hi, step(False), carry)
    unmasked_visits = carry[3] - masked_visits
    acc, m, l, visits = lax.fori_loop(full_hi, hi, step(True), carry)
    if has_sinks:
        sink = sink_ref[0].astype(jnp.float32) * jnp.float32(LOG2E)
        m_new = jnp.maximum(m, sink)
        alpha = jnp.exp2(m - m_new)
        acc, l, m = acc * alpha[:, None], l * alpha + jnp.exp2(sink - m_new), m_new
    l_safe = jnp.where(l > 0, l, 1.0)
    out = acc / l_safe[:, None]
    lse = jnp.where(l > 0, (jnp.where(m == -jnp.inf, 0.0, m) + jnp.log2(l_safe)) * jnp.float32(LN2), -jnp.inf)
    plgpu.store(o_ref, out.astype(o_ref.dtype), mask=vhead_mask)
    lse_ref[...] = lse
    if debug:
        count_ref[...] = jnp.full((block_q,), visits * 65536 + unmasked_visits, jnp.int32)


def forward(c, config, *, debug: bool = False, scales=None, out_dtype=None):
    """``(out [B, T, N, Hv], lse [B, N, T])``; with ``debug`` also the per-row
    visit counts ``[B, N, T]`` int32 (``visited·65536 + unmasked``).

    fp8 attention (`fp8.py`): ``c.q/k/v`` hold fp8 codes (or floats) and
    ``scales = (s_q [B, T, N], s_k [B, S, K], s_v [B, S, K])`` float32 per-row
    scales; ``out_dtype`` is the output dtype (default ``q.dtype``)."""
    q, k, v = c.q, c.k, c.v
    b, t, n, h, s, g, hv, bq, bk, nq, nk, tp, sp, hp, hvp = Tiling.of(c, config)
    spec = c.spec
    segments = spec.segments
    sched = _schedule(spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, bq, bk)  # [Bc, nq, 4]
    quantized = scales is not None
    out_dtype = q.dtype if out_dtype is None else out_dtype
    math_ = TileMath(spec, c.scale, c.logits_soft_cap, s, c.bias is not None, c.mask is not None,
                     allow_tf32=quantized or q.dtype != jnp.float32)
    reverse = spec.causal  # heavy (late) query blocks first

    def qi(i):
        return nq - 1 - i if reverse else i

    inputs = [pad_axis(q, 1, tp), pad_axis(k, 1, sp), pad_axis(v, 1, sp)]
    in_specs = [
        pl.BlockSpec((None, bq, None, hp), lambda i, bb, nn: (bb, qi(i), nn, 0)),
        pl.BlockSpec((None, sp, None, hp), lambda i, bb, nn: (bb, 0, nn // g, 0)),
        pl.BlockSpec((None, sp, None, hvp), lambda i, bb, nn: (bb, 0, nn // g, 0)),
    ]
    if quantized:
        sq, sk, sv = (x.astype(jnp.float32) for x in scales)
        inputs += [pad_axis(sq, 1, tp, 1.0), pad_axis(sk, 1, sp, 1.0), pad_axis(sv, 1, sp, 1.0)]
        in_specs += [pl.BlockSpec((None, bq, None), lambda i, bb, nn: (bb, qi(i), nn)),
                     pl.BlockSpec((None, sp, None), lambda i, bb, nn: (bb, 0, nn // g)),
                     pl.BlockSpec((None, sp, None), lambda i, bb, nn: (bb, 0, nn // g))]
    for dense, dtype in ((c.bias, None), (c.mask, jnp.int8)):
        if dense is not None:
            x = prepare_dense(dense, tp, sp, dtype)
            fb, fn = bcast_index(x.shape[0]), bcast_index(x.shape[1])
            inputs.append(x)
            in_specs.append(pl.BlockSpec((None, None, bq, sp),
                                         lambda i, bb, nn, fb=fb, fn=fn: (fb(bb), fn(nn), qi(i), 0)))
    if c.sinks is not None:
        inputs.append(c.sinks.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((1,), lambda i, bb, nn: (nn,)))
    fp = bcast_index(c.q_pos.shape[0])
    inputs += [pad_axis(c.q_pos, 1, tp), pad_axis(c.kv_pos, 1, sp)]
    in_specs += [pl.BlockSpec((None, bq), lambda i, bb, nn: (fp(bb), qi(i))),
                 pl.BlockSpec((None, sp), lambda i, bb, nn: (fp(bb), 0))]
    if segments:
        fs = bcast_index(max(c.q_seg.shape[0], c.kv_seg.shape[0]))
        segb = max(c.q_seg.shape[0], c.kv_seg.shape[0])
        inputs += [pad_axis(jnp.broadcast_to(c.q_seg, (segb, t)), 1, tp),
                   pad_axis(jnp.broadcast_to(c.kv_seg, (segb, s)), 1, sp)]
        in_specs += [pl.BlockSpec((None, bq), lambda i, bb, nn: (fs(bb), qi(i))),
                     pl.BlockSpec((None, sp), lambda i, bb, nn: (fs(bb), 0))]
    fc = bcast_index(sched.shape[0])
    inputs.append(sched)
    in_specs.append(pl.BlockSpec((None, None, 4), lambda i, bb, nn: (fc(bb), qi(i), 0)))
    out_shape = [jax.ShapeDtypeStruct((b, tp, n, hv), out_dtype), jax.ShapeDtypeStruct((b, n, tp), jnp.float32)]
    out_specs = [pl.BlockSpec((None, bq, None, hvp), lambda i, bb, nn: (bb, qi(i), nn, 0)),
                 pl.BlockSpec((None, None, bq), lambda i, bb, nn: (bb, nn, qi(i)))]
    if debug:
        out_shape.append(jax.ShapeDtypeStruct((b, n, tp), jnp.int32))
        out_specs.append(pl.BlockSpec((None, None, bq), lambda i, bb, nn: (bb, nn, qi(i))))
    kernel = functools.partial(_forward_kernel, math_=math_, block_q=bq, block_k=bk, h=h, hv=hv,
                               segments=segments, has_sinks=c.sinks is not None, debug=debug, reverse=reverse,
                               quantized=quantized)
    outs = triton_call(kernel, out_shape=out_shape, grid=(nq, b, n), in_specs=in_specs, out_specs=out_specs,
                       num_warps=config.num_warps, num_stages=config.num_stages,
                       name="stellax_flash_attention_forward")(*inputs)
    out, lse = outs[0][:, :t], outs[1][:, :, :t]
    if debug:
        return out, lse, outs[2][:, :, :t]
    return out, lse
