"""Pallas Triton kernels: blocked Hadamard transform, dequantize and quantize (the
quantized matmul is in `triton_matmul`).

Hadamard: the input is viewed as rows of one block ``[R, b]`` (16 ≤ b ≤ 256);
each program multiplies ``block_rows`` rows by the ±1 matrix ``M`` (``b×b``,
the Sylvester Hadamard matrix with the random signs folded in: ``diag(d)·H``
forward, ``H·diag(d)`` inverse) on the tensor cores and scales by ``1/√b``.
For b ≤ 256 this is memory-bound, like the butterfly form, with simpler code.

Dequantize / quantize: rows of the last axis, ``block_rows × block_k`` elements per
program (1-D blocks along the last axis; MX formats with E8M0 scales, int8 / int4 / fp8
with float32 scales).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import F32, HIGHEST, cdiv, dot, operand, output, triton_kernel_call, triton_precision
from ...core.platform import interpret_enabled
from . import formats as F
from . import kernel as K
from .hadamard import hadamard_matrix
from .qarray import QArray, qarray_from_call

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


# -- op entry points and requirements (a row of api.BACKENDS) -------------------------------
#: The formats `block_quantize` writes (the MX formats go through `mx_quantize`).
BLOCK_KERNEL_FORMATS = ("int8", "int4", "fp8_e4m3", "fp8_e5m2")


def quantize_requirements(call) -> str | None:
    """Why the Triton quantize kernels cannot run ``call`` (None when they can)."""
    fmt = F.get_format(call.format)
    ndim = call.x.ndim
    if not fmt.is_mx and fmt.name not in BLOCK_KERNEL_FORMATS:
        return (f"the Triton quantize kernels cover the MX formats and {list(BLOCK_KERNEL_FORMATS)}; "
                f"got {fmt.name}")
    if not fmt.is_mx:
        g = call.block_shape[-1]
        if any(b != 1 for b in call.block_shape[:-1]) or g not in (32, 64, 128, 256):
            return (f"the Triton quantize kernel for {fmt.name} takes 1-D blocks of 32–256 (a power of two) along "
                    f"the last axis; got block_shape {call.block_shape}")
        if call.scale_dtype not in (None, "float32"):
            return f"the Triton quantize kernel writes float32 scales; got scale_dtype {call.scale_dtype}"
    if call.key is not None:
        return "the Triton quantize kernel rounds to nearest-even only (no stochastic_rounding_key)"
    if call.axis != ndim - 1:
        return f"the Triton quantize kernel quantizes along the last axis, got axis {call.axis} of rank {ndim}"
    if call.x.shape[-1] < 32:
        return f"the Triton quantize kernel needs at least one whole block of 32, got {call.x.shape[-1]}"
    return None


def quantize_writes_float8(call) -> bool:
    """Whether the Triton quantize kernel writes float8 codes for ``call`` (fp8 and MXFP8 formats)."""
    return np.dtype(F.get_format(call.format).storage_dtype).name.startswith("float8")


def quantize_run(call, config) -> QArray:
    """`quantize` of ``call``: rows of the last axis through `block_quantize` (int/fp8, float32
    scales) or `mx_quantize` (MX, E8M0 scales)."""
    fmt = F.get_format(call.format)
    shape = call.x.shape
    rows = int(np.prod(shape[:-1]))
    x = call.x.reshape(rows, shape[-1])
    if not fmt.is_mx:
        g = call.block_shape[-1]
        config = config if config.block_k % g == 0 else config.replace(block_k=max(g, config.block_k))
        values, scales = block_quantize(x, fmt=fmt.name, group=g, config=config)
        values = values.reshape(*shape[:-1], values.shape[-1])
        if fmt.element.kind == "float":
            values = jax.lax.bitcast_convert_type(values, fmt.element.dtype)
        scales = scales.reshape(*shape[:-1], scales.shape[-1])
    else:
        values, codes = mx_quantize(x, fmt=fmt.name, config=config)
        values = values.reshape(*shape[:-1], values.shape[-1])
        if not fmt.packed:
            values = jax.lax.bitcast_convert_type(values, fmt.element.dtype)
        scales = F.e8m0_from_codes(codes.reshape(*shape[:-1], codes.shape[-1]))
    return QArray(values, scales, format=fmt.name, shape=shape, block_shape=call.block_shape, axis=call.axis,
                  rotation=call.rotation, _validate=False)


def dequantize_requirements(call) -> str | None:
    """Why the Triton dequantize kernel cannot run ``call`` (None when it can)."""
    ndim = len(call.shape)
    if call.axis != ndim - 1 or any(b != 1 for b in call.block_shape[:-1]):
        return ("the Triton dequantize kernel takes 1-D blocks along the last axis (quantize with axis=-1); "
                f"got axis {call.axis}, block_shape {call.block_shape}")
    g = call.block_shape[-1]
    if cdiv(call.shape[-1], g) > 1 and (g & (g - 1)):
        return f"the Triton dequantize kernel needs a power-of-two block along the axis, got {g}"
    return None


def dequantize_run(call, config):
    """`dequantize` of ``call``: rows of the last axis through `dequantize`."""
    q = qarray_from_call(call)
    ops = K.kernel_operands(q)
    k = q.shape[-1]
    rows = int(np.prod(q.shape[:-1]))
    values = ops.values.reshape(rows, ops.values.shape[-1])
    scales = ops.scales.reshape(rows, ops.scales.shape[-1])
    zp = None if ops.zero_points is None else ops.zero_points.reshape(rows, -1)
    out = dequantize(values, scales, zp, ops.tensor_scale, rows=rows, k=k, group=ops.group,
                     one_block=scales.shape[-1] == 1, fmt=q.format, out_dtype=jnp.dtype(call.dtype), config=config)
    return out.reshape(*q.shape[:-1], k)


def hadamard_requirements(call) -> str | None:
    """Why the Triton Hadamard kernel cannot run ``call`` (None when it can)."""
    if not 16 <= call.block <= 256:
        return f"the Triton Hadamard kernel takes blocks of 16–256, got {call.block}"
    return None


def hadamard_run(call, config):
    """`hadamard_transform` of ``call`` through `hadamard`."""
    return hadamard(call.x, call.signs, block=call.block, inverse=call.inverse, config=config,
                    precision=call.precision)
