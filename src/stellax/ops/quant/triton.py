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

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import triton_call
from ...core.platform import interpret_enabled
from . import formats as F
from . import kernel as K
from .hadamard import hadamard_matrix

_ANY = pl.BlockSpec(memory_space=pl.ANY)


# -- Hadamard ----------------------------------------------------------------------


def _hadamard_kernel(x_ref, m_ref, o_ref, *, rows, block, scale):
    br = o_ref.shape[0]
    i = pl.program_id(0)
    row = i * br + jax.lax.broadcasted_iota(jnp.int32, (br, block), 0)
    x = plgpu.load(x_ref.at[pl.ds(i * br, br), :], mask=row < rows, other=jnp.zeros((), x_ref.dtype))
    m = m_ref[...]
    if x.dtype == jnp.float32:
        y = jnp.dot(x, m, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32)
    else:
        y = jnp.dot(x, m.astype(x.dtype), preferred_element_type=jnp.float32)
    o_ref[...] = (y * scale).astype(o_ref.dtype)


def hadamard(x, signs, *, block: int, inverse: bool, config):
    """Normalized (randomized) WHT over blocks of the last axis."""
    shape = x.shape
    rows = int(np.prod(shape)) // block
    x2 = x.reshape(rows, block)
    h = jnp.asarray(hadamard_matrix(block, np.float32) * math.sqrt(block))  # ±1
    if signs is not None:
        s = signs.astype(jnp.float32)
        h = h * s[None, :] if inverse else s[:, None] * h
    # Row-vector form: forward y = H·D·v ⇒ y_row = v_row·(D·H) (H symmetric);
    # inverse y = D·H·w ⇒ y_row = w_row·(H·D). ``h`` is that right factor.
    m = h
    br = config.block_rows
    out = triton_call(
        functools.partial(_hadamard_kernel, rows=rows, block=block, scale=1.0 / math.sqrt(block)),
        out_shape=jax.ShapeDtypeStruct((rows, block), x.dtype), grid=(pl.cdiv(rows, br),),
        in_specs=[_ANY, pl.BlockSpec((block, block), lambda i: (0, 0))],
        out_specs=pl.BlockSpec((br, block), lambda i: (i, 0)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_hadamard",
    )(x2, m)
    return out.reshape(shape)


# -- quantized matmul -----------------------------------------------------------------


def _decode_scale(s, kind):
    del kind  # the dtype says it: uint8 tiles are E8M0 codes
    return K.decode_scale(s)


def _zero(ref):
    return jnp.zeros((), ref.dtype)


def _qmm_kernel(*refs, m, n, k, bm, bn, bk, x_kind, w_format, x_scale_kind, w_scale_kind, x_in_loop,
                w_in_loop, gx, gw, has_x_scale, has_zp, has_ts, compute_dtype, acc_dtype):
    refs = list(refs)
    x_ref = refs.pop(0)
    sx_ref = refs.pop(0) if has_x_scale else None
    w_ref = refs.pop(0)
    sw_ref = refs.pop(0)
    zp_ref = refs.pop(0) if has_zp else None
    ts_ref = refs.pop(0) if has_ts else None
    o_ref = refs.pop(0)

    fmt = F.get_format(w_format)
    packed = fmt.packed
    i, j = pl.program_id(0), pl.program_id(1)
    rows = i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 0)
    cols_n = j * bn + jax.lax.broadcasted_iota(jnp.int32, (1, bn), 1)
    row_ok = (i * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)) < m
    kp = (k + 1) // 2
    bkp = bk // 2

    def load_x(s):
        kcols = s * bk + jax.lax.broadcasted_iota(jnp.int32, (bm, bk), 1)
        return plgpu.load(x_ref.at[pl.ds(i * bm, bm), pl.ds(s * bk, bk)], mask=(rows < m) & (kcols < k),
                          other=_zero(x_ref))

    def load_w(s):
        if packed:
            krow = s * bkp + jax.lax.broadcasted_iota(jnp.int32, (bkp, bn), 0)
            ncol = j * bn + jax.lax.broadcasted_iota(jnp.int32, (bkp, bn), 1)
            return plgpu.load(w_ref.at[pl.ds(s * bkp, bkp), pl.ds(j * bn, bn)], mask=(krow < kp) & (ncol < n),
                              other=_zero(w_ref))
        krow = s * bk + jax.lax.broadcasted_iota(jnp.int32, (bk, bn), 0)
        ncol = j * bn + jax.lax.broadcasted_iota(jnp.int32, (bk, bn), 1)
        return plgpu.load(w_ref.at[pl.ds(s * bk, bk), pl.ds(j * bn, bn)], mask=(krow < k) & (ncol < n),
                          other=_zero(w_ref))

    def w_scale_row(kb):
        return plgpu.load(sw_ref.at[pl.ds(kb, 1), pl.ds(j * bn, bn)], mask=cols_n < n, other=_zero(sw_ref))

    def x_scale_col(kb):
        return plgpu.load(sx_ref.at[pl.ds(i * bm, bm), pl.ds(kb, 1)], mask=row_ok, other=_zero(sx_ref))

    def step_product(s):
        xt = load_x(s)
        wt = load_w(s)
        if x_kind == "float":  # weight-only: decode the weights into the activation dtype
            zp = None
            if has_zp:
                kb = (s * bk) // gw
                zp = plgpu.load(zp_ref.at[pl.ds(kb, 1), pl.ds(j * bn, bn)], mask=cols_n < n,
                                other=_zero(zp_ref)).astype(jnp.float32)
            if packed:
                wd = K.decode_packed_pairs(wt.T, w_format)  # [bn, bk], K interleaved back
                if zp is not None:
                    wd = wd - zp.T
                return jax.lax.dot_general(xt.astype(compute_dtype), wd.astype(compute_dtype),
                                           (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32,
                                           precision=_precision(compute_dtype))
            wd = K.decode_codes(wt, w_format)
            if zp is not None:
                wd = wd - zp
            return jnp.dot(xt.astype(compute_dtype), wd.astype(compute_dtype), preferred_element_type=jnp.float32,
                           precision=_precision(compute_dtype))
        if x_kind == "int":
            return jnp.dot(xt, wt, preferred_element_type=jnp.int32)
        if xt.dtype == wt.dtype:
            return jnp.dot(xt, wt, preferred_element_type=jnp.float32)
        return jnp.dot(xt.astype(jnp.bfloat16), wt.astype(jnp.bfloat16), preferred_element_type=jnp.float32)

    def body(s, acc):
        part = step_product(s)
        if x_in_loop or w_in_loop:
            part = part.astype(jnp.float32)
            if x_in_loop:
                part = part * _decode_scale(x_scale_col((s * bk) // gx), x_scale_kind)
            if w_in_loop:
                part = part * _decode_scale(w_scale_row((s * bk) // gw), w_scale_kind)
        return acc + part.astype(acc.dtype)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros((bm, bn), acc_dtype))
    out = acc.astype(jnp.float32)
    if has_x_scale and not x_in_loop:
        out = out * _decode_scale(x_scale_col(0), x_scale_kind)
    if not w_in_loop:
        out = out * _decode_scale(w_scale_row(0), w_scale_kind)
    if has_ts:
        out = out * plgpu.load(ts_ref.at[pl.ds(0, 1)]).reshape(1, 1)
    o_ref[...] = out.astype(o_ref.dtype)


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def quantized_matmul(x, sx, w, sw, zp, ts, *, m, n, k, x_kind, w_format, x_scale_kind, w_scale_kind, gx, gw,
                     x_in_loop, w_in_loop, out_dtype, config):
    """Launch the kernel. ``x [M, K]`` (float, or int8/fp8 codes), ``sx [M, KBx]``
    or None, ``w [K or ceil(K/2), N]`` codes, ``sw [KBw, N]``, ``zp [KBw, N]`` or
    None, ``ts [1]`` float32 or None; E8M0 scales as uint8 codes."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    # x_kind: "float" (activations, weight-only), "int" (int8 codes), "fp8" (fp8 codes).
    compute_dtype = x.dtype if x_kind == "float" else jnp.float32
    acc_dtype = jnp.int32 if (x_kind == "int" and not (x_in_loop or w_in_loop)) else jnp.float32
    inputs = [x] + ([sx] if sx is not None else []) + [w, sw] + ([zp] if zp is not None else []) + (
        [ts] if ts is not None else [])
    kernel = functools.partial(
        _qmm_kernel, m=m, n=n, k=k, bm=bm, bn=bn, bk=bk, x_kind=x_kind, w_format=w_format,
        x_scale_kind=x_scale_kind, w_scale_kind=w_scale_kind, x_in_loop=x_in_loop, w_in_loop=w_in_loop,
        gx=gx, gw=gw, has_x_scale=sx is not None, has_zp=zp is not None, has_ts=ts is not None,
        compute_dtype=compute_dtype, acc_dtype=acc_dtype)
    return triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), grid=(pl.cdiv(m, bm), pl.cdiv(n, bn)),
        in_specs=[_ANY] * len(inputs), out_specs=pl.BlockSpec((bm, bn), lambda i, j: (i, j)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_quantized_matmul",
    )(*inputs)


# -- dequantize --------------------------------------------------------------------


def _dequant_kernel(*refs, rows, k, br, bk, group, one_block, packed, fmt, has_zp, has_ts):
    refs = list(refs)
    v_ref, s_ref = refs.pop(0), refs.pop(0)
    zp_ref = refs.pop(0) if has_zp else None
    ts_ref = refs.pop(0) if has_ts else None
    o_ref = refs.pop(0)
    i, j = pl.program_id(0), pl.program_id(1)
    row_ok = (i * br + jax.lax.broadcasted_iota(jnp.int32, (br, 1), 0)) < rows
    if packed:
        bkp = bk // 2
        col = j * bkp + jax.lax.broadcasted_iota(jnp.int32, (br, bkp), 1)
        codes = plgpu.load(v_ref.at[pl.ds(i * br, br), pl.ds(j * bkp, bkp)], mask=row_ok & (col < (k + 1) // 2),
                           other=_zero(v_ref))
        vals = K.decode_packed_pairs(codes, fmt)
    else:
        col = j * bk + jax.lax.broadcasted_iota(jnp.int32, (br, bk), 1)
        codes = plgpu.load(v_ref.at[pl.ds(i * br, br), pl.ds(j * bk, bk)], mask=row_ok & (col < k),
                           other=_zero(v_ref))
        vals = K.decode_codes(codes, fmt)
    nbk = s_ref.shape[1]

    def per_element(ref):
        if one_block or group >= bk:
            c = 0 if one_block else (j * bk) // group
            return plgpu.load(ref.at[pl.ds(i * br, br), pl.ds(c, 1)], mask=row_ok, other=_zero(ref))
        nb = bk // group
        c = j * nb + jax.lax.broadcasted_iota(jnp.int32, (br, nb), 1)
        t = plgpu.load(ref.at[pl.ds(i * br, br), pl.ds(j * nb, nb)], mask=row_ok & (c < nbk), other=_zero(ref))
        return t

    def expand(t):
        if one_block or group >= bk:
            return t
        nb = bk // group
        return jnp.broadcast_to(t.reshape(br, nb, 1), (br, nb, group)).reshape(br, bk)

    s = K.decode_scale(per_element(s_ref))
    if has_ts:  # (scale · tensor_scale) first, as `dequantize_reference` does: bitwise equal results
        s = s * plgpu.load(ts_ref.at[pl.ds(0, 1)]).reshape(1, 1)
    if has_zp:
        vals = vals - expand(per_element(zp_ref).astype(jnp.float32))
    o_ref[...] = (vals * expand(s)).astype(o_ref.dtype)


def dequantize(values, scales, zero_points, tensor_scale, *, rows, k, group, one_block, fmt, out_dtype, config):
    """Rows ``[R, K]`` (values packed along K for 4-bit), scales ``[R, ceil(K/group)]``."""
    br, bk = config.block_rows, config.block_k
    inputs = [values, scales] + ([zero_points] if zero_points is not None else []) + (
        [tensor_scale] if tensor_scale is not None else [])
    kernel = functools.partial(
        _dequant_kernel, rows=rows, k=k, br=br, bk=bk, group=group, one_block=one_block,
        packed=F.get_format(fmt).packed, fmt=fmt, has_zp=zero_points is not None, has_ts=tensor_scale is not None)
    return triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((rows, k), out_dtype), grid=(pl.cdiv(rows, br), pl.cdiv(k, bk)),
        in_specs=[_ANY] * len(inputs), out_specs=pl.BlockSpec((br, bk), lambda i, j: (i, j)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_dequantize",
    )(*inputs)


# -- MX quantize -----------------------------------------------------------------------


def _load_tile(x_ref, rows: int, k: int, br: int, bk: int):
    """Program ``(i, j)``'s ``[br, bk]`` tile of ``x [rows, k]`` in float32,
    zeros outside the array."""
    i, j = pl.program_id(0), pl.program_id(1)
    row = i * br + jax.lax.broadcasted_iota(jnp.int32, (br, bk), 0)
    col = j * bk + jax.lax.broadcasted_iota(jnp.int32, (br, bk), 1)
    return plgpu.load(x_ref.at[pl.ds(i * br, br), pl.ds(j * bk, bk)], mask=(row < rows) & (col < k),
                      other=_zero(x_ref)).astype(jnp.float32)


def _mx_quantize_kernel(x_ref, v_ref, s_ref, *, rows, k, br, bk, fmt):
    """One ``br × bk`` tile: per block of 32 the OCP MX scale from the amax
    bits, elements ``sat(x · 2^-e)``; exact arithmetic only (no division)."""
    f = F.get_format(fmt)
    el = f.element
    x = _load_tile(x_ref, rows, k, br, bk)
    nb = bk // 32
    xb = x.reshape(br, nb, 32)
    finite = jnp.isfinite(xb)
    amax = jnp.max(jnp.where(finite, jnp.abs(xb), 0.0), axis=2)
    bad = jnp.max(jnp.where(finite, 0, 1), axis=2) > 0
    e = jnp.clip(jnp.where(amax > 0, F.floor_log2(amax) - el.emax, -127), -127, 127)
    s_ref[...] = jnp.where(bad, 255, e + 127).astype(jnp.uint8)
    inv = F.exp2_int(jnp.clip(-e, -126, 127))
    v = jnp.where(bad[:, :, None], 0.0, xb * inv[:, :, None]).reshape(br, bk)
    r = F.round_to_element(v, el)
    if el.bits == 4:
        codes = F.e2m1_encode(jnp.where(jnp.isnan(r), 0.0, r)).astype(jnp.int32)
        pairs = codes.reshape(br, bk // 2, 2)
        weight = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (br, bk // 2, 2), 2) == 0, 1, 16)
        v_ref[...] = jnp.sum(pairs * weight, axis=2).astype(jnp.uint8)
    else:
        bits = jax.lax.bitcast_convert_type(r.astype(el.dtype), jnp.uint8)
        v_ref[...] = jnp.where(jnp.isnan(r), jnp.uint8(F.NAN_CODE), bits)


def mx_quantize(x, *, fmt, config):
    """Rows ``x [R, K]`` → ``(codes, e8m0 codes [R, ceil(K/32)])`` (uint8;
    4-bit codes packed two per byte)."""
    rows, k = x.shape
    br, bk = config.block_rows, config.block_k
    packed = F.get_format(fmt).packed
    vk = (k + 1) // 2 if packed else k
    vbk = bk // 2 if packed else bk
    nbk = -(-k // 32)
    kernel = functools.partial(_mx_quantize_kernel, rows=rows, k=k, br=br, bk=bk, fmt=fmt)
    return triton_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, vk), jnp.uint8), jax.ShapeDtypeStruct((rows, nbk), jnp.uint8)],
        grid=(pl.cdiv(rows, br), pl.cdiv(k, bk)), in_specs=[_ANY],
        out_specs=[pl.BlockSpec((br, vbk), lambda i, j: (i, j)), pl.BlockSpec((br, bk // 32), lambda i, j: (i, j))],
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_mx_quantize",
    )(x)


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


def _block_quantize_kernel(x_ref, v_ref, s_ref, *, rows, k, br, bk, group, fmt):
    f = F.get_format(fmt)
    el = f.element
    x = _load_tile(x_ref, rows, k, br, bk)
    nb = bk // group
    xb = x.reshape(br, nb, group)
    amax = jnp.max(jnp.where(jnp.isfinite(xb), jnp.abs(xb), 0.0), axis=2)
    nan_block = jnp.max(jnp.where(jnp.isnan(xb), 1, 0), axis=2) > 0
    top = float(el.max_value)
    s = jnp.where(amax > 0, _div_rn(amax, jnp.full(amax.shape, top, jnp.float32)), 1.0)
    r = _div_rn(jnp.ones(s.shape, jnp.float32), s)
    t = (xb * r.reshape(br, nb, 1)).reshape(br, bk)
    if el.kind == "int":
        q = F.rne(jnp.clip(t, -top, top))
        codes = jnp.where(jnp.isnan(t), 0.0, q).astype(jnp.int32)
        s = jnp.where(nan_block, jnp.float32(np.nan), s)
        if el.bits == 4:
            pairs = (codes & 0xF).reshape(br, bk // 2, 2)
            weight = jnp.where(jax.lax.broadcasted_iota(jnp.int32, (br, bk // 2, 2), 2) == 0, 1, 16)
            v_ref[...] = jnp.sum(pairs * weight, axis=2).astype(jnp.uint8)
        else:
            v_ref[...] = codes.astype(jnp.int8)
    else:
        rr = F.round_to_element(t, el)
        bits = jax.lax.bitcast_convert_type(rr.astype(el.dtype), jnp.uint8)
        v_ref[...] = jnp.where(jnp.isnan(rr), jnp.uint8(F.NAN_CODE), bits)
    s_ref[...] = s


def block_quantize(x, *, fmt, group, config):
    """Rows ``x [R, K]`` → ``(codes, float32 scales [R, ceil(K/group)])``;
    int8 codes, uint8 packed int4 codes or uint8 fp8 bits."""
    rows, k = x.shape
    br, bk = config.block_rows, config.block_k
    f = F.get_format(fmt)
    vk, vbk = ((k + 1) // 2, bk // 2) if f.packed else (k, bk)
    vdtype = jnp.int8 if (f.element.kind == "int" and not f.packed) else jnp.uint8
    kernel = functools.partial(_block_quantize_kernel, rows=rows, k=k, br=br, bk=bk, group=group, fmt=fmt)
    return triton_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((rows, vk), vdtype), jax.ShapeDtypeStruct((rows, -(-k // group)), jnp.float32)],
        grid=(pl.cdiv(rows, br), pl.cdiv(k, bk)), in_specs=[_ANY],
        out_specs=[pl.BlockSpec((br, vbk), lambda i, j: (i, j)),
                   pl.BlockSpec((br, bk // group), lambda i, j: (i, j))],
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_block_quantize",
    )(x)
