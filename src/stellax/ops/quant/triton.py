"""Pallas Triton kernels: blocked Hadamard transform and quantized matmul.

Hadamard: the input is viewed as rows of one block ``[R, b]`` (16 ≤ b ≤ 256);
each program multiplies ``block_rows`` rows by the ±1 matrix ``M`` (``b×b``,
the Sylvester Hadamard matrix with the random signs folded in: ``diag(d)·H``
forward, ``H·diag(d)`` inverse) on the tensor cores and scales by ``1/√b``.
For b ≤ 256 this is memory-bound, like the butterfly form, with simpler code.

Quantized matmul ``y[M, N] = x[M, K] @ w[K, N]``: one program per output tile
``block_m × block_n``; the K loop steps ``block_k`` logical elements, which
divides every operand's K block, so each step reads one scale row:

    acc += dot(decode(x_k), decode(w_k)) · sx[:, kb] · sw[kb, :]     (in-loop scales)
    y    = acc · sx · sw · tensor_scale                                (epilogue scales)

``decode`` turns codes into the dot's input type in registers: int8/fp8
codes are used as is (int8×int8 accumulates in int32; fp8×fp8 feeds the fp8
tensor cores); weight-only decodes to the activation dtype (int4/e2m1
nibbles unpacked with a join+reshape, minus zero points). Scales stay in
their stored dtypes in memory (E8M0 codes decoded by bit construction).
The dequantized weights never exist in memory.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import F32, HIGHEST, cdiv, dot, dot_nt, operand, output, triton_kernel_call, triton_precision
from ...core.platform import interpret_enabled
from . import formats as F
from . import kernel as K
from .hadamard import hadamard_matrix

_ANY = pl.BlockSpec(memory_space=pl.ANY)


def _zero(ref):
    return jnp.zeros((), ref.dtype)


def _precision(precision, dtype):
    """The in-kernel precision of a resolved ``precision`` (`stellax.core.precision`): float32
    dots as `triton_precision` says (one TF32 pass at ``DEFAULT``, three otherwise), narrower
    ones at the tensor core's native precision."""
    return triton_precision(precision) if jnp.dtype(dtype) == F32 else None


def _tile_spec(rows: int, cols: int) -> pl.BlockSpec:
    """The ``[rows, cols]`` block of program ``(i, j)``."""
    return pl.BlockSpec((rows, cols), lambda i, j: (i, j))


# -- Hadamard ----------------------------------------------------------------------


def _hadamard_kernel(*, x, m, y, rows, block, scale, precision):
    """``y = (x_rows · M) · scale`` for the program's ``[br, block]`` rows
    (rows past ``rows`` read as zero); ``M`` is ±1, so bf16/f16 are exact."""
    br = y.shape[0]
    i = pl.program_id(0)
    row = i * br + jax.lax.broadcasted_iota(jnp.int32, (br, block), 0)
    xt = plgpu.load(x.at[pl.ds(i * br, br), :], mask=row < rows, other=_zero(x))
    mt = m[...]
    if xt.dtype == F32:
        out = dot(xt, mt, precision=_precision(precision, F32))
    else:
        out = dot(xt, mt.astype(xt.dtype), precision=None)
    y[...] = (out * scale).astype(y.dtype)


def hadamard(x, signs, *, block: int, inverse: bool, config, precision=HIGHEST):
    """Normalized (randomized) WHT over blocks of the last axis.

    ``x [..., n]`` (``block`` divides ``n``), ``signs [block]`` float or
    ``None`` → like ``x``: each block ``v`` becomes ``H·D·v / √block``
    (forward) or ``D·H·v / √block`` (inverse), ``D = diag(signs)``.
    """
    shape = x.shape
    rows = int(np.prod(shape)) // block
    x2 = x.reshape(rows, block)
    h = jnp.asarray(hadamard_matrix(block, np.float32) * math.sqrt(block))  # ±1
    if signs is not None:
        s = signs.astype(jnp.float32)
        h = h * s[None, :] if inverse else s[:, None] * h
    # Row-vector form: forward y = H·D·v ⇒ y_row = v_row·(D·H) (H symmetric);
    # inverse y = D·H·w ⇒ y_row = w_row·(H·D). ``h`` is that right factor.
    br = config.block_rows
    out = triton_kernel_call(
        functools.partial(_hadamard_kernel, rows=rows, block=block, scale=1.0 / math.sqrt(block),
                          precision=precision),
        grid=(pl.cdiv(rows, br),),
        inputs=dict(x=operand(x2, _ANY), m=operand(h, pl.BlockSpec((block, block), lambda i: (0, 0)))),
        outputs=dict(y=output((rows, block), x.dtype, pl.BlockSpec((br, block), lambda i: (i, 0)))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_hadamard",
    )
    return out.y.reshape(shape)


# -- quantized matmul -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Qmm:
    """Static geometry of one quantized-matmul launch (see `quantized_matmul`)."""

    m: int
    n: int
    k: int
    bm: int
    bn: int
    bk: int
    x_kind: str            # "float" (weight-only), "int" (int8 codes) or "fp8" (fp8 codes)
    w_format: str
    x_in_loop: bool        # x scaled per K block inside the loop (else in the epilogue)
    w_in_loop: bool
    gx: int                # K block of x's / w's scales
    gw: int
    compute_dtype: Any     # the weight-only dot's input dtype
    acc_dtype: Any         # int32 for int8 × int8 with epilogue scales, else float32
    precision: Any = HIGHEST  # the call's resolved precision (float32 weight-only dots)

    @property
    def packed(self) -> bool:
        return F.get_format(self.w_format).packed


def _load_x(x, g: _Qmm, i, s):
    """K step ``s`` of row block ``i``'s ``[bm, bk]`` tile of ``x`` (zeros outside)."""
    rows = i * g.bm + jax.lax.broadcasted_iota(jnp.int32, (g.bm, g.bk), 0)
    kcols = s * g.bk + jax.lax.broadcasted_iota(jnp.int32, (g.bm, g.bk), 1)
    return plgpu.load(x.at[pl.ds(i * g.bm, g.bm), pl.ds(s * g.bk, g.bk)], mask=(rows < g.m) & (kcols < g.k),
                      other=_zero(x))


def _load_w(w, g: _Qmm, j, s):
    """K step ``s`` of column block ``j``'s ``[bk, bn]`` weight codes (``[bk/2, bn]`` bytes when packed)."""
    bk, limit = (g.bk // 2, (g.k + 1) // 2) if g.packed else (g.bk, g.k)
    krow = s * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, g.bn), 0)
    ncol = j * g.bn + jax.lax.broadcasted_iota(jnp.int32, (bk, g.bn), 1)
    return plgpu.load(w.at[pl.ds(s * bk, bk), pl.ds(j * g.bn, g.bn)], mask=(krow < limit) & (ncol < g.n),
                      other=_zero(w))


def _w_row(ref, g: _Qmm, j, kb):
    """Row ``kb`` of a per-(K block, column) array (scales, zero points), column block ``j``: ``[1, bn]``."""
    cols_n = j * g.bn + jax.lax.broadcasted_iota(jnp.int32, (1, g.bn), 1)
    return plgpu.load(ref.at[pl.ds(kb, 1), pl.ds(j * g.bn, g.bn)], mask=cols_n < g.n, other=_zero(ref))


def _x_col(ref, g: _Qmm, i, kb):
    """Column ``kb`` of x's per-(row, K block) scales, row block ``i``: ``[bm, 1]``."""
    row_ok = (i * g.bm + jax.lax.broadcasted_iota(jnp.int32, (g.bm, 1), 0)) < g.m
    return plgpu.load(ref.at[pl.ds(i * g.bm, g.bm), pl.ds(kb, 1)], mask=row_ok, other=_zero(ref))


def _weight_only_product(xt, wt, w_zero, g: _Qmm, j, s):
    """``x_tile · decode(w_tile)`` with the weights decoded into the activation dtype."""
    zp = None if w_zero is None else _w_row(w_zero, g, j, (s * g.bk) // g.gw).astype(jnp.float32)
    precision = _precision(g.precision, g.compute_dtype)
    if g.packed:
        wd = K.decode_packed_pairs(wt.T, g.w_format)  # [bn, bk], K interleaved back
        if zp is not None:
            wd = wd - zp.T
        return dot_nt(xt.astype(g.compute_dtype), wd.astype(g.compute_dtype), precision=precision)
    wd = K.decode_codes(wt, g.w_format)
    if zp is not None:
        wd = wd - zp
    return dot(xt.astype(g.compute_dtype), wd.astype(g.compute_dtype), precision=precision)


def _step_product(x, w, w_zero, g: _Qmm, i, j, s):
    """Tile ``(i, j)``'s unscaled partial product ``[bm, bn]`` of K step ``s`` (int32 for int8 × int8)."""
    xt = _load_x(x, g, i, s)
    wt = _load_w(w, g, j, s)
    if g.x_kind == "float":
        return _weight_only_product(xt, wt, w_zero, g, j, s)
    if g.x_kind == "int":
        return dot(xt, wt, precision=None, out_dtype=jnp.int32)
    if xt.dtype == wt.dtype:
        return dot(xt, wt, precision=None)
    return dot(xt.astype(jnp.bfloat16), wt.astype(jnp.bfloat16), precision=None)


def _qmm_kernel(*, x, x_scale, w, w_scale, w_zero, tensor_scale, y, g: _Qmm):
    """One ``[bm, bn]`` output tile: the K loop, in-loop scales, epilogue scales.

    ``acc += dot(decode(x_k), decode(w_k)) · sx[:, kb] · sw[kb, :]`` (in-loop
    scales), then ``y = acc · sx · sw · tensor_scale`` (epilogue scales).
    """
    i, j = pl.program_id(0), pl.program_id(1)  # outside the loop: the interpreter needs them at the top level

    def body(s, acc):
        part = _step_product(x, w, w_zero, g, i, j, s)
        if g.x_in_loop or g.w_in_loop:
            part = part.astype(jnp.float32)
            if g.x_in_loop:
                part = part * K.decode_scale(_x_col(x_scale, g, i, (s * g.bk) // g.gx))
            if g.w_in_loop:
                part = part * K.decode_scale(_w_row(w_scale, g, j, (s * g.bk) // g.gw))
        return acc + part.astype(acc.dtype)

    acc = jax.lax.fori_loop(0, pl.cdiv(g.k, g.bk), body, jnp.zeros((g.bm, g.bn), g.acc_dtype))
    out = acc.astype(jnp.float32)
    if x_scale is not None and not g.x_in_loop:
        out = out * K.decode_scale(_x_col(x_scale, g, i, 0))
    if not g.w_in_loop:
        out = out * K.decode_scale(_w_row(w_scale, g, j, 0))
    if tensor_scale is not None:
        out = out * plgpu.load(tensor_scale.at[pl.ds(0, 1)]).reshape(1, 1)
    y[...] = out.astype(y.dtype)


def quantized_matmul(x, sx, w, sw, zp, ts, *, m, n, k, x_kind, w_format, gx, gw, x_in_loop, w_in_loop, out_dtype,
                     config, precision=HIGHEST):
    """``y [M, N] = decode(x) @ decode(w)`` in ``out_dtype``.

    Args:
      x: ``[M, K]`` float activations (``x_kind="float"``, weight-only) or
        int8 / fp8 codes (``x_kind="int"`` / ``"fp8"``).
      sx: x's scales ``[M, ceil(K / gx)]`` or ``None`` (weight-only).
      w: ``[K, N]`` codes (``[ceil(K/2), N]`` bytes for 4-bit ``w_format``).
      sw: w's scales ``[ceil(K / gw), N]``; ``zp``: zero points like ``sw``
        or ``None``; ``ts``: float32 ``[1]`` tensor scale or ``None``. E8M0
        scales as their uint8 codes.
      gx, gw: the K blocks of the scales; ``x_in_loop`` / ``w_in_loop``:
        apply them per K step (else once, in the epilogue).
      config: a `QMatmulConfig` (``block_k`` divides the in-loop K blocks).
      precision: the resolved precision of float32 weight-only dots (`stellax.core.precision`).
    """
    compute_dtype = x.dtype if x_kind == "float" else jnp.float32
    acc_dtype = jnp.int32 if (x_kind == "int" and not (x_in_loop or w_in_loop)) else jnp.float32
    bm, bn = config.block_m, config.block_n
    g = _Qmm(m=m, n=n, k=k, bm=bm, bn=bn, bk=config.block_k, x_kind=x_kind, w_format=w_format,
             x_in_loop=x_in_loop, w_in_loop=w_in_loop, gx=gx, gw=gw, compute_dtype=compute_dtype,
             acc_dtype=acc_dtype, precision=precision)
    out = triton_kernel_call(
        functools.partial(_qmm_kernel, g=g), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        inputs=dict(x=operand(x, _ANY), x_scale=operand(sx, _ANY), w=operand(w, _ANY), w_scale=operand(sw, _ANY),
                    w_zero=operand(zp, _ANY), tensor_scale=operand(ts, _ANY)),
        outputs=dict(y=output((m, n), out_dtype, _tile_spec(bm, bn))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_quantized_matmul",
    )
    return out.y


# -- dequantize --------------------------------------------------------------------


def _dequant_codes(values, *, rows, k, br, bk, packed, fmt):
    """The program's ``[br, bk]`` elements decoded to float32 (4-bit codes unpacked)."""
    i, j = pl.program_id(0), pl.program_id(1)
    row_ok = (i * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)) < rows
    if packed:
        bkp = bk // 2
        col = j * bkp + jax.lax.broadcasted_iota(jnp.int32, (br, bkp), 1)
        codes = plgpu.load(values.at[pl.ds(i * br, br), pl.ds(j * bkp, bkp)], mask=row_ok & (col < (k + 1) // 2),
                           other=_zero(values))
        return K.decode_packed_pairs(codes, fmt)
    col = j * bk + jax.lax.broadcasted_iota(jnp.int32, (br, bk), 1)
    codes = plgpu.load(values.at[pl.ds(i * br, br), pl.ds(j * bk, bk)], mask=row_ok & (col < k),
                       other=_zero(values))
    return K.decode_codes(codes, fmt)


def _dequant_kernel(*, values, scales, zero_points, tensor_scale, y, rows, k, br, bk, group, one_block, packed, fmt):
    """``y = (codes - zero_point) · (scale · tensor_scale)`` on the program's
    ``[br, bk]`` tile; per-block scales / zero points loaded once per block and
    broadcast over its ``group`` elements."""
    vals = _dequant_codes(values, rows=rows, k=k, br=br, bk=bk, packed=packed, fmt=fmt)
    i, j = pl.program_id(0), pl.program_id(1)
    row_ok = (i * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)) < rows
    nbk = scales.shape[1]
    wide = one_block or group >= bk  # one scale column covers the whole tile
    nb = 1 if wide else bk // group

    def per_block(ref):
        if wide:
            c = 0 if one_block else (j * bk) // group
            return plgpu.load(ref.at[pl.ds(i * br, br), pl.ds(c, 1)], mask=row_ok, other=_zero(ref))
        c = j * nb + jax.lax.broadcasted_iota(jnp.int32, (br, nb), 1)
        return plgpu.load(ref.at[pl.ds(i * br, br), pl.ds(j * nb, nb)], mask=row_ok & (c < nbk), other=_zero(ref))

    def expand(t):
        return t if wide else jnp.broadcast_to(t.reshape(br, nb, 1), (br, nb, group)).reshape(br, bk)

    s = K.decode_scale(per_block(scales))
    if tensor_scale is not None:  # (scale · tensor_scale) first, as `dequantize_reference` does: bitwise equal
        s = s * plgpu.load(tensor_scale.at[pl.ds(0, 1)]).reshape(1, 1)
    if zero_points is not None:
        vals = vals - expand(per_block(zero_points).astype(jnp.float32))
    y[...] = (vals * expand(s)).astype(y.dtype)


def dequantize(values, scales, zero_points, tensor_scale, *, rows, k, group, one_block, fmt, out_dtype, config):
    """Rows ``[R, K]`` of a `QArray` quantized along K → ``out_dtype`` values.

    ``values [R, K]`` codes (``[R, ceil(K/2)]`` bytes for 4-bit), ``scales``
    (and ``zero_points`` or ``None``) ``[R, ceil(K / group)]``,
    ``tensor_scale`` float32 ``[1]`` or ``None``; ``one_block``: a single
    scale column (per channel / per tensor).
    """
    br, bk = config.block_rows, config.block_k
    kernel = functools.partial(_dequant_kernel, rows=rows, k=k, br=br, bk=bk, group=group, one_block=one_block,
                               packed=F.get_format(fmt).packed, fmt=fmt)
    out = triton_kernel_call(
        kernel, grid=(pl.cdiv(rows, br), pl.cdiv(k, bk)),
        inputs=dict(values=operand(values, _ANY), scales=operand(scales, _ANY),
                    zero_points=operand(zero_points, _ANY), tensor_scale=operand(tensor_scale, _ANY)),
        outputs=dict(y=output((rows, k), out_dtype, _tile_spec(br, bk))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_dequantize",
    )
    return out.y


# -- MX quantize -----------------------------------------------------------------------


def _load_tile(x, rows: int, k: int, br: int, bk: int):
    """Program ``(i, j)``'s ``[br, bk]`` tile of ``x [rows, k]`` in float32,
    zeros outside the array."""
    i, j = pl.program_id(0), pl.program_id(1)
    row = i * br + jax.lax.broadcasted_iota(jnp.int32, (br, bk), 0)
    col = j * bk + jax.lax.broadcasted_iota(jnp.int32, (br, bk), 1)
    return plgpu.load(x.at[pl.ds(i * br, br), pl.ds(j * bk, bk)], mask=(row < rows) & (col < k),
                      other=_zero(x)).astype(jnp.float32)


def _pack_nibbles(codes, br: int, bk: int):
    """int32 4-bit codes ``[br, bk]`` → bytes ``[br, bk/2]`` (even index in the low nibble)."""
    pairs = codes.reshape(br, bk // 2, 2)
    weight = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (br, bk // 2, 2), 2) == 0, 1, 16)
    return jnp.sum(pairs * weight, axis=2).astype(jnp.uint8)


def _mx_quantize_kernel(*, x, codes, scales, rows, k, br, bk, fmt):
    """One ``br × bk`` tile: per block of 32 the OCP MX scale from the amax
    bits, elements ``sat(x · 2^-e)``; exact arithmetic only (no division)."""
    el = F.get_format(fmt).element
    nb = bk // 32
    xb = _load_tile(x, rows, k, br, bk).reshape(br, nb, 32)
    finite = jnp.isfinite(xb)
    amax = jnp.max(jnp.where(finite, jnp.abs(xb), 0.0), axis=2)
    bad = jnp.max(jnp.where(finite, 0, 1), axis=2) > 0
    e = jnp.clip(jnp.where(amax > 0, F.floor_log2(amax) - el.emax, -127), -127, 127)
    scales[...] = jnp.where(bad, 255, e + 127).astype(jnp.uint8)
    inv = F.exp2_int(jnp.clip(-e, -126, 127))
    v = jnp.where(bad[:, :, None], 0.0, xb * inv[:, :, None]).reshape(br, bk)
    r = F.round_to_element(v, el)
    if el.bits == 4:
        codes[...] = _pack_nibbles(F.e2m1_encode(jnp.where(jnp.isnan(r), 0.0, r)).astype(jnp.int32), br, bk)
    else:
        bits = jax.lax.bitcast_convert_type(r.astype(el.dtype), jnp.uint8)
        codes[...] = jnp.where(jnp.isnan(r), jnp.uint8(F.NAN_CODE), bits)


def mx_quantize(x, *, fmt, config):
    """Rows ``x [R, K]`` → ``(codes, e8m0 codes [R, ceil(K/32)])`` (uint8;
    4-bit codes packed two per byte)."""
    rows, k = x.shape
    br, bk = config.block_rows, config.block_k
    packed = F.get_format(fmt).packed
    vk = (k + 1) // 2 if packed else k
    vbk = bk // 2 if packed else bk
    out = triton_kernel_call(
        functools.partial(_mx_quantize_kernel, rows=rows, k=k, br=br, bk=bk, fmt=fmt),
        grid=(pl.cdiv(rows, br), pl.cdiv(k, bk)), inputs=dict(x=operand(x, _ANY)),
        outputs=dict(codes=output((rows, vk), jnp.uint8, _tile_spec(br, vbk)),
                     scales=output((rows, cdiv(k, 32)), jnp.uint8, _tile_spec(br, bk // 32))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_mx_quantize",
    )
    return out.codes, out.scales


# -- block quantize (int8 / int4 / fp8 with float32 scales) -------------------------


def _div_rn(a, b):
    """Correctly rounded float32 ``a / b`` (same shapes). Triton's ``/`` is an
    approximate division on NVIDIA GPUs, so the kernel uses ``div.rn.f32``;
    interpreted (XLA), the divisor is made data-dependent (``b + 0·a``, ``a``
    finite) so XLA keeps a true division instead of a reciprocal multiply."""
    if interpret_enabled():
        return a / (b + a * 0.0)
    return plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])[0]


def _block_quantize_kernel(*, x, codes, scales, rows, k, br, bk, group, fmt):
    """One ``br × bk`` tile, blocks of ``group``: ``s = amax / max_code``
    (1 for an all-zero block; NaN for int blocks holding a NaN), elements
    ``round(x · (1/s))`` (int: clipped; fp8: saturated, NaN kept)."""
    el = F.get_format(fmt).element
    nb = bk // group
    xb = _load_tile(x, rows, k, br, bk).reshape(br, nb, group)
    amax = jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0.0), axis=2)
    nan_block = jnp.max(jnp.where(jnp.isnan(xb), 1, 0), axis=2) > 0
    top = float(el.max_value)
    s = jnp.where(amax > 0, _div_rn(amax, jnp.full(amax.shape, top, jnp.float32)), 1.0)
    r = _div_rn(jnp.ones(s.shape, jnp.float32), s)
    t = (xb * r.reshape(br, nb, 1)).reshape(br, bk)
    if el.kind == "int":
        q = F.rne(jnp.clip(t, -top, top))
        ints = jnp.where(jnp.isnan(t), 0.0, q).astype(jnp.int32)
        s = jnp.where(nan_block, jnp.float32(np.nan), s)
        codes[...] = _pack_nibbles(ints & 0xF, br, bk) if el.bits == 4 else ints.astype(jnp.int8)
    else:
        rr = F.round_to_element(t, el)
        bits = jax.lax.bitcast_convert_type(rr.astype(el.dtype), jnp.uint8)
        codes[...] = jnp.where(jnp.isnan(rr), jnp.uint8(F.NAN_CODE), bits)
    scales[...] = s


def block_quantize(x, *, fmt, group, config):
    """Rows ``x [R, K]`` → ``(codes, float32 scales [R, ceil(K/group)])``;
    int8 codes, uint8 packed int4 codes or uint8 fp8 bits."""
    rows, k = x.shape
    br, bk = config.block_rows, config.block_k
    f = F.get_format(fmt)
    vk, vbk = ((k + 1) // 2, bk // 2) if f.packed else (k, bk)
    vdtype = jnp.int8 if (f.element.kind == "int" and not f.packed) else jnp.uint8
    out = triton_kernel_call(
        functools.partial(_block_quantize_kernel, rows=rows, k=k, br=br, bk=bk, group=group, fmt=fmt),
        grid=(pl.cdiv(rows, br), pl.cdiv(k, bk)), inputs=dict(x=operand(x, _ANY)),
        outputs=dict(codes=output((rows, vk), vdtype, _tile_spec(br, vbk)),
                     scales=output((rows, cdiv(k, group)), jnp.float32, _tile_spec(br, bk // group))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_block_quantize",
    )
    return out.codes, out.scales
