"""Pallas Mosaic TPU kernels: quantize, dequantize and the blocked Hadamard transform.

Quantize / dequantize (1-D blocks of ``g`` along the last axis): the array
``[..., K]`` is viewed as *block rows* ``[R·nb, g]`` (``nb = ceil(K / g)``,
a partial last block zero-padded, as the golden treats it), so one
quantization block is one row of a tile and its scale / zero point is one
``[rows, 1]`` column — per-block reductions are lane reductions, no lane
reshapes. A grid step holds ``block_rows`` block rows (a ``parallel`` axis).
The per-format formulas are those of `reference` (the XLA path), written with
the same float32 operations in the same order, so codes and scales are
bit-identical; only elementwise ops, lane reductions and bit casts are used
(no fp8 or 4-bit vector dtypes: fp8 codes are built from and decoded to their
bit patterns, so every TPU generation runs them):

* fp8 element codes: the value ``r`` already on the e4m3 / e5m2 grid → its
  bits ``sign<<7 | (bits(r)>>(23-m)) - (126+emin)<<m`` (normal) or
  ``sign<<7 | r·2^(m-emin)`` (subnormal), NaN → ``0x7F``.
* 4-bit codes are packed two per byte (element ``2j`` low nibble) with an
  exact MXU product: ``codes [rows, g] @ P [g, g/2]`` with ``P[2j, j] = 1``,
  ``P[2j+1, j] = 16`` (integers < 256, exact in bfloat16 × bfloat16 → float32);
  unpacking interleaves the low/high nibbles' values with the one-hot
  ``E [g/2, g]`` / ``O [g/2, g]``: ``lo @ E + hi @ O`` (values ≤ 15, exact).

Divisions are true float32 divisions as in the golden (in interpret mode the
divisor goes through an optimization barrier so XLA keeps the division).

Hadamard: the input is viewed as rows of ``W`` lanes (``W`` a multiple of the
block, 128 or 256 when the size allows, `configs.hadamard_lanes`) and each
step multiplies ``block_rows`` rows by the block-diagonal ``W × W`` matrix
``I ⊗ (D·H)`` (forward) or ``I ⊗ (H·D)`` (inverse) held in VMEM, ±1 entries
scaled by ``1/√b`` after the product; float32 at the call's precision (`mxu_dot`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from ...core.pallas import F32, HIGHEST, dot, mxu_dot, operand, output, tpu_kernel_call
from ...core.platform import interpret_enabled
from ...core.platform import target_generation
from . import formats as F
from .hadamard import hadamard_matrix
from .qarray import QArray, qarray_from_call
from .reference import div
from .configs import hadamard_lanes, quant_block_geometry, quant_tpu_vmem

_EXP_MASK = 0x7F800000
_SEMANTICS = ("parallel",)


# -- exact elementwise helpers (kernel-safe: no is_finite / round / fp8 vectors) -------------
def true_div(a, b):
    """IEEE float32 ``a / b`` (``b`` broadcast to ``a``'s shape); interpreted, the
    divisor goes through an optimization barrier so XLA does not turn the
    division into a multiply by a reciprocal (1 ulp off)."""
    a, b = jnp.asarray(a, F32), jnp.asarray(b, F32)
    shape = jnp.broadcast_shapes(a.shape, b.shape)
    a, b = jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape)
    if interpret_enabled():
        b = jax.lax.optimization_barrier(b)
    return a / b


def _bits(x):
    return jax.lax.bitcast_convert_type(x, jnp.int32)


def is_finite(x):
    """``isfinite`` of float32 ``x`` from its exponent bits."""
    return (_bits(x) & _EXP_MASK) != _EXP_MASK


def _row_any(mask):
    return jnp.max(jnp.where(mask, 1.0, 0.0), axis=1, keepdims=True) > 0.0


def _row_finite_amax(x, finite):
    return jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=1, keepdims=True)


def float8_bits(r, element: F.Element):
    """int32 bit patterns (0..255) of float32 values ``r`` already on the
    ``element`` (e4m3 / e5m2) grid, within ±max; NaN → ``0x7F``."""
    m, emin = element.mantissa_bits, element.min_exponent
    bits = _bits(r)
    sign = (bits >> 31) & 1
    a = jnp.abs(r)
    normal = ((bits & 0x7FFFFFFF) >> (23 - m)) - ((126 + emin) << m)
    sub = (a * float(2.0 ** (m - emin))).astype(jnp.int32)
    mag = jnp.where(a >= float(2.0 ** emin), normal, sub)
    return jnp.where(r != r, F.NAN_CODE, (sign << 7) | mag)


def float8_values(code, element: F.Element):
    """float32 values of e4m3 / e5m2 bit patterns (int32 0..255); NaN codes → NaN, e5m2 Inf → ±Inf."""
    m, emin = element.mantissa_bits, element.min_exponent
    emask = (1 << (7 - m)) - 1
    sign = (code >> 7) & 1
    e = (code >> m) & emask
    mant = code & ((1 << m) - 1)
    normal = jax.lax.bitcast_convert_type((sign << 31) | ((e + 126 + emin) << 23) | (mant << (23 - m)), F32)
    sub = mant.astype(F32) * float(2.0 ** (emin - m))
    sub = jnp.where(sign == 1, -sub, sub)
    v = jnp.where(e == 0, sub, normal)
    if element.name == "e4m3":
        return jnp.where((code & 0x7F) == 0x7F, jnp.float32(np.nan), v)
    top = e == emask
    v = jnp.where(top & (mant == 0), jnp.where(sign == 1, -np.inf, np.inf).astype(F32), v)
    return jnp.where(top & (mant != 0), jnp.float32(np.nan), v)


def e2m1_code(r):
    """int32 e2m1 codes (0..15) of values on the e2m1 grid (NaN → 0), as `formats.e2m1_encode`."""
    r = jnp.where(r != r, 0.0, r)
    a = jnp.abs(r)
    mag = sum(jnp.where(a >= t, 1, 0) for t in (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0))
    return mag | (((_bits(r) >> 31) & 1) << 3)


def _to_int8(codes):
    """int32 codes in [-128, 256) → int8 storage (bytes ≥ 128 wrap to negative)."""
    return jnp.where(codes >= 128, codes - 256, codes).astype(jnp.int8)


def _iota2(shape, axis):
    return jax.lax.broadcasted_iota(jnp.int32, shape, axis)


def pack_pairs(nibbles):
    """int32 nibbles ``[rows, g]`` (0..15) → int32 bytes ``[rows, g/2]`` (element
    ``2j`` in the low nibble), by an exact MXU product with ``P [g, g/2]``."""
    g = nibbles.shape[1]
    i, j = _iota2((g, g // 2), 0), _iota2((g, g // 2), 1)
    p = jnp.where(i == 2 * j, 1.0, jnp.where(i == 2 * j + 1, 16.0, 0.0)).astype(jnp.bfloat16)
    packed = dot(nibbles.astype(F32).astype(jnp.bfloat16), p, precision=None)
    return packed.astype(jnp.int32)


def interleave_pairs(lo, hi):
    """float32 ``lo``, ``hi`` ``[rows, n]`` (values exact in bfloat16) → ``[rows, 2n]``
    with ``lo`` at even and ``hi`` at odd positions, by one-hot MXU products."""
    n = lo.shape[1]
    i, j = _iota2((n, 2 * n), 0), _iota2((n, 2 * n), 1)
    even = jnp.where(j == 2 * i, 1.0, 0.0).astype(jnp.bfloat16)
    odd = jnp.where(j == 2 * i + 1, 1.0, 0.0).astype(jnp.bfloat16)
    return (dot(lo.astype(jnp.bfloat16), even, precision=None)
            + dot(hi.astype(jnp.bfloat16), odd, precision=None))


def decode_nibbles(t, element: F.Element):
    """float32 values of 4-bit codes (int32, low 4 bits) of ``element`` (int4 or e2m1)."""
    t = t & 0xF
    if element.kind == "int":
        return ((t ^ 8) - 8).astype(F32)
    return F.e2m1_decode(t)


def _rne_bounded(t, bound: float):
    """Round half to even of ``t`` clipped to ±``bound`` (exact: ``bound`` < 2^22)."""
    return F.rne(jnp.clip(t, -bound, bound))


# -- quantize ----------------------------------------------------------------------------
def _elements(v, element: F.Element):
    """Scaled float32 values → int32 element codes (unpacked; fp8 as bits)."""
    r = F.round_to_element(v, element)
    if element.bits == 4:
        return e2m1_code(r)
    return float8_bits(r, element)


def _quantize_kernel(*, x, tensor_scale, codes, scales, zero_points, fmt: str):
    """One step of block rows ``x [br, g]`` → codes, per-row scales (float32, or
    int32 E8M0 / E4M3 bit codes), zero points; the formulas of `reference`."""
    f = F.get_format(fmt)
    el = f.element
    xv = x[...].astype(F32)
    finite = is_finite(xv)
    if f.is_mx:
        # rows with a non-finite value, from the bits directly rather than by negating `finite`: on a
        # v5e the `_row_any(~finite)` form was suspected of the all-NaN scales that turned out to be
        # XLA's E8M0 reshape (see `formats.e8m0_from_codes`); this form is exact on the chip
        bad = _row_any((_bits(xv) & _EXP_MASK) == _EXP_MASK)
        amax = _row_finite_amax(xv, finite)
        e = jnp.clip(jnp.where(amax > 0, F.floor_log2(amax) - el.emax, -127), -127, 127)
        scales[...] = jnp.where(bad, 255, e + 127)
        v = jnp.where(bad, 0.0, xv * F.exp2_int(jnp.clip(-e, -126, 127)))
        out = _elements(v, el)
    elif f.scale == "e4m3":  # nvfp4
        t = tensor_scale[...]
        sb = F.round_to_element(true_div(true_div(_row_finite_amax(xv, finite), 6.0), t), F.E4M3)
        denom = sb * t
        inv = jnp.where(denom == 0, 0.0, true_div(1.0, jnp.where(denom == 0, 1.0, denom)))
        v = jnp.where(xv != xv, 0.0, xv * inv)
        out = _elements(v, el)
        scales[...] = float8_bits(jnp.where(_row_any(xv != xv), jnp.float32(np.nan), sb), F.E4M3)
    elif el.kind == "int":
        qmin, qmax = float(el.min_code), float(el.max_value)
        if f.zero_point:
            fx = jnp.where(finite, xv, 0.0)
            lo = jnp.minimum(jnp.min(fx, axis=1, keepdims=True), 0.0)
            hi = jnp.maximum(jnp.max(fx, axis=1, keepdims=True), 0.0)
            s = true_div(hi - lo, qmax - qmin)
            s = jnp.where(s > 0, s, 1.0)
            zp = jnp.clip(_rne_bounded(qmin - true_div(lo, s), 1024.0), qmin, qmax)
            zero_points[...] = zp.astype(jnp.int32)
        else:
            amax = _row_finite_amax(xv, finite)
            s = jnp.where(amax > 0, true_div(amax, qmax), 1.0)
            zp = 0.0
        tv = xv * true_div(1.0, s)
        r = jnp.where(tv != tv, 0.0, _rne_bounded(tv, 1024.0))
        out = jnp.clip(r + zp, qmin, qmax).astype(jnp.int32)
        scales[...] = jnp.where(_row_any(xv != xv), jnp.float32(np.nan), s)
    else:  # fp8 elements, float32 scales
        amax = _row_finite_amax(xv, finite)
        s = jnp.where(amax > 0, true_div(amax, el.max_value), 1.0)
        out = _elements(xv * true_div(1.0, s), el)
        scales[...] = s
    codes[...] = _to_int8(pack_pairs(out & 0xF) if f.packed else out)


def block_rows_view(a, k: int, nb: int, width: int, pad_value=0):
    """``a [R, k]`` → ``[R·nb, width]``: rows of one block (the tail zero-padded)."""
    rows = a.shape[0]
    if nb * width != k:
        a = jnp.pad(a, ((0, 0), (0, nb * width - k)), constant_values=pad_value)
    return a.reshape(rows * nb, width)


def quantize(x, *, fmt: str, group: int, block_rows: int):
    """``x [R, K]`` quantized in 1-D blocks of ``group`` along K.

    Returns ``(values, scales, zero_points, tensor_scale)`` laid out as the
    golden's `QArray` fields for ``axis=-1`` (values int8 / uint8 packed /
    uint8 fp8 bits, to be bitcast by the caller; scales ``[R, nb]`` float32
    or uint8 codes; zero points int8 or ``None``; tensor scale ``[]`` float32
    or ``None``)."""
    f = F.get_format(fmt)
    rows, k = x.shape
    if x.dtype == jnp.float16:  # Mosaic has no float16 vectors; the upcast is exact (the golden's first step)
        x = x.astype(F32)
    _, nb, width = quant_block_geometry(x.shape, (1, group))
    xb = block_rows_view(x, k, nb, width)
    total = rows * nb
    br = min(block_rows, -(-total // 32) * 32)
    row_spec = pl.BlockSpec((br, width), lambda i: (i, 0))
    code_width = width // 2 if f.packed else width
    col_spec = pl.BlockSpec((br, 1), lambda i: (i, 0))
    tensor_scale = None
    if f.scale == "e4m3":
        xf = x.astype(F32)
        gmax = jnp.max(jnp.where(jnp.isfinite(xf), jnp.abs(xf), 0.0))
        tensor_scale = jnp.where(gmax > 0, div(gmax, 6.0 * 448.0), jnp.float32(1.0))
    scale_dtype = jnp.int32 if f.scale != "float" else F32
    need = quant_tpu_vmem(width, x.dtype.itemsize, 1, br)
    outs = tpu_kernel_call(
        functools.partial(_quantize_kernel, fmt=f.name), grid=(pl.cdiv(total, br),),
        dimension_semantics=_SEMANTICS, name="stellax_quantize_tpu",
        inputs=dict(x=operand(xb, row_spec),
                    tensor_scale=operand(None if tensor_scale is None else tensor_scale.reshape(1, 1),
                                         pl.BlockSpec((1, 1), lambda i: (0, 0)))),
        outputs=dict(codes=output((total, code_width), jnp.int8, pl.BlockSpec((br, code_width), lambda i: (i, 0))),
                     scales=output((total, 1), scale_dtype, col_spec),
                     zero_points=output((total, 1), jnp.int32, col_spec) if f.zero_point else None),
        vmem_limit_bytes=_vmem_limit(need),
    )
    kv = (k + 1) // 2 if f.packed else k
    values = outs.codes.reshape(rows, nb * code_width)[:, :kv]
    scales = outs.scales.reshape(rows, nb)
    if f.scale != "float":
        scales = scales.astype(jnp.uint8)
    zp = None if outs.zero_points is None else outs.zero_points.reshape(rows, nb).astype(jnp.int8)
    return values, scales, zp, tensor_scale


def _vmem_limit(need: int) -> int | None:
    """``vmem_limit_bytes`` for a step needing ``need`` bytes: ``None`` under the
    scoped default, else need + 25 % capped at the physical VMEM."""
    g = target_generation()
    if need + need // 4 <= g.scoped_vmem_bytes:
        return None
    return min(need + need // 4, g.vmem_bytes * 3 // 4)


# -- dequantize ------------------------------------------------------------------------
def decode_elements(codes, fmt: str):
    """Code tiles (int8; fp8 as bits; 4-bit packed pairs) → float32 element values
    (packed pairs interleaved back into element order)."""
    f = F.get_format(fmt)
    el = f.element
    c = codes.astype(jnp.int32)
    if f.packed:  # interleave the nibbles (exact integers), then decode: keeps e2m1's -0
        nibbles = interleave_pairs((c & 0xF).astype(F32), ((c >> 4) & 0xF).astype(F32))
        return decode_nibbles(nibbles.astype(jnp.int32), el)
    if el.kind == "int":
        return c.astype(F32)
    return float8_values(c & 0xFF, el)


def _dequantize_kernel(*, values, scales, zero_points, y, fmt: str):
    """``y = (code - zero_point) · scale`` on block rows (``scale`` already
    multiplied by the tensor scale, as the golden does)."""
    e = decode_elements(values[...], fmt)
    if zero_points is not None:
        e = e - zero_points[...]
    y[...] = (e * scales[...]).astype(y.dtype)


def dequantize(values, scales, zero_points, tensor_scale, *, fmt: str, k: int, group: int, out_dtype,
               block_rows: int):
    """Rows quantized along their last axis ``K`` in 1-D blocks of ``group``
    → ``[R, K]`` in ``out_dtype``: ``values [R, Kv]`` (int8 / uint8 / fp8),
    ``scales [R, nb]`` (any stored scale dtype), ``zero_points [R, nb]`` int8
    or ``None``, ``tensor_scale`` or ``None``."""
    f = F.get_format(fmt)
    rows = values.shape[0]
    final_dtype = jnp.dtype(out_dtype)
    if final_dtype == jnp.float16:  # no float16 vectors in Mosaic: float32 out, cast (the golden's last step)
        out_dtype = F32
    _, nb, width = quant_block_geometry((rows, k), (1, group))
    if np.dtype(values.dtype).itemsize == 1 and np.dtype(values.dtype) != np.dtype(jnp.int8):
        values = jax.lax.bitcast_convert_type(values, jnp.int8)
    code_width = width // 2 if f.packed else width
    kv = values.shape[1]
    vb = block_rows_view(values, kv, nb, code_width)
    s = scales.astype(F32)
    if tensor_scale is not None:
        s = s * tensor_scale.astype(F32)
    total = rows * nb
    br = min(block_rows, -(-total // 32) * 32)
    col_spec = pl.BlockSpec((br, 1), lambda i: (i, 0))
    need = quant_tpu_vmem(width, 1, np.dtype(out_dtype).itemsize, br)
    outs = tpu_kernel_call(
        functools.partial(_dequantize_kernel, fmt=f.name), grid=(pl.cdiv(total, br),),
        dimension_semantics=_SEMANTICS, name="stellax_dequantize_tpu",
        inputs=dict(values=operand(vb, pl.BlockSpec((br, code_width), lambda i: (i, 0))),
                    scales=operand(s.reshape(total, 1), col_spec),
                    zero_points=operand(None if zero_points is None else
                                        zero_points.astype(F32).reshape(total, 1), col_spec)),
        outputs=dict(y=output((total, width), out_dtype, pl.BlockSpec((br, width), lambda i: (i, 0)))),
        vmem_limit_bytes=_vmem_limit(need),
    )
    y = outs.y.reshape(rows, nb * width)
    y = y if nb * width == k else y[:, :k]
    return y.astype(final_dtype)


# -- Hadamard --------------------------------------------------------------------------
def _hadamard_kernel(*, x, m, y, scale: float, precision):
    """``y = (x_rows · M) · scale``: ``M`` ±1 (exact in any float dtype); float32 ``x`` at the
    resolved ``precision`` (`mxu_dot`), narrower ``x`` natively."""
    xt = x[...]
    out = mxu_dot(xt, m[...] if xt.dtype == F32 else m[...].astype(xt.dtype), precision)
    y[...] = (out * scale).astype(y.dtype)


def hadamard(x, signs, *, block: int, inverse: bool, block_rows: int, precision=HIGHEST):
    """Normalized (randomized) WHT over blocks of the last axis (the contract of
    `hadamard_transform`): ``x [..., n]``, ``signs [block]`` or ``None``."""
    if x.dtype == jnp.float16:  # no float16 vectors in Mosaic: float32 math (as the golden), float16 out
        return hadamard(x.astype(F32), signs, block=block, inverse=inverse, block_rows=block_rows,
                        precision=precision).astype(x.dtype)
    shape = x.shape
    total = int(np.prod(shape))
    width = hadamard_lanes(total, block)
    rows = total // width
    h = jnp.asarray(hadamard_matrix(block, np.float32) * math.sqrt(block))  # ±1
    if signs is not None:
        s = signs.astype(F32)
        h = h * s[None, :] if inverse else s[:, None] * h
    if width != block:
        h = jnp.kron(jnp.eye(width // block, dtype=F32), h)
    br = min(block_rows, -(-rows // 16) * 16)
    row_spec = pl.BlockSpec((br, width), lambda i: (i, 0))
    out = tpu_kernel_call(
        functools.partial(_hadamard_kernel, scale=1.0 / math.sqrt(block), precision=precision),
        grid=(pl.cdiv(rows, br),),
        dimension_semantics=_SEMANTICS, name="stellax_hadamard_tpu",
        inputs=dict(x=operand(x.reshape(rows, width), row_spec),
                    m=operand(h, pl.BlockSpec((width, width), lambda i: (0, 0)))),
        outputs=dict(y=output((rows, width), x.dtype, row_spec)),
    )
    return out.y.reshape(shape)


# -- op entry points and requirements (a row of api.BACKENDS) -------------------------------------
def _one_d_last_axis(shape, block_shape, axis) -> str | None:
    ndim = len(shape)
    if axis != ndim - 1 or any(b != 1 for b in block_shape[:-1]):
        return ("the Mosaic TPU quantize/dequantize kernels take 1-D blocks along the last axis; got axis "
                f"{axis}, block_shape {tuple(block_shape)} for shape {tuple(shape)}")
    return None


def _packing_ok(fmt: str, shape, block_shape) -> str | None:
    g = block_shape[-1]
    if F.get_format(fmt).packed and g % 2 and -(-shape[-1] // g) > 1:
        return f"the Mosaic TPU kernels pack 4-bit codes within a block: an even block is needed, got {g}"
    return None


def quantize_requirements(call) -> str | None:
    """Why the Mosaic TPU quantize kernel cannot run ``call`` (None when it can)."""
    reason = _one_d_last_axis(call.x.shape, call.block_shape, call.axis)
    if reason:
        return reason
    if call.key is not None:
        return "the Mosaic TPU quantize kernel rounds to nearest-even only (no stochastic_rounding_key)"
    if call.scale_dtype not in (None, "float32"):
        return f"the Mosaic TPU quantize kernel writes float32 scales; got scale_dtype {call.scale_dtype}"
    return _packing_ok(call.format, call.x.shape, call.block_shape)


def quantize_run(call, config) -> QArray:
    """`quantize` of ``call`` (rows of the last axis) → a `QArray` like the XLA path's
    (float16 inputs are upcast to float32 first: Mosaic has no float16 vectors)."""
    f = F.get_format(call.format)
    shape = call.x.shape
    rows = int(np.prod(shape[:-1]))
    values, scales, zp, ts = quantize(call.x.reshape(rows, shape[-1]), fmt=f.name, group=call.block_shape[-1],
                                      block_rows=config.block_rows)
    values = values.reshape(*shape[:-1], values.shape[-1])
    if f.packed:
        values = jax.lax.bitcast_convert_type(values, jnp.uint8)
    elif f.element.kind == "float":
        values = jax.lax.bitcast_convert_type(values, f.element.dtype)
    scales = scales.reshape(*shape[:-1], scales.shape[-1])
    if f.scale == "e8m0":
        scales = F.e8m0_from_codes(scales)
    elif f.scale != "float":
        scales = jax.lax.bitcast_convert_type(scales, f.scale_storage_dtype)
    if zp is not None:
        zp = zp.reshape(scales.shape)
    return QArray(values, scales, zp, ts, format=f.name, shape=shape, block_shape=call.block_shape,
                  axis=call.axis, rotation=call.rotation, _validate=False)


def dequantize_requirements(call) -> str | None:
    """Why the Mosaic TPU dequantize kernel cannot run ``call`` (None when it can)."""
    return (_one_d_last_axis(call.shape, call.block_shape, call.axis)
            or _packing_ok(call.format, call.shape, call.block_shape))


def dequantize_run(call, config):
    """`dequantize` of ``call``: rows of the last axis through `dequantize`."""
    q = qarray_from_call(call)
    shape = q.shape
    rows = int(np.prod(shape[:-1]))
    zp = None if q.zero_points is None else q.zero_points.reshape(rows, -1)
    scales = q.scales
    if np.dtype(scales.dtype) == np.dtype(jnp.float8_e8m0fnu):  # decoded before the reshape: see `e8m0_from_codes`
        scales = F.e8m0_to_float(jax.lax.bitcast_convert_type(scales, jnp.uint8))
    y = dequantize(q.values.reshape(rows, q.values.shape[-1]), scales.reshape(rows, -1), zp, q.tensor_scale,
                   fmt=q.format, k=shape[-1], group=q.block_shape[-1], out_dtype=jnp.dtype(call.dtype),
                   block_rows=config.block_rows)
    return y.reshape(shape)


def hadamard_requirements(call) -> str | None:
    if not 16 <= call.block <= 256:
        return f"the Mosaic TPU Hadamard kernel takes blocks of 16–256, got {call.block}"
    return None


def hadamard_run(call, config):
    return hadamard(call.x, call.signs, block=call.block, inverse=call.inverse, block_rows=config.block_rows,
                    precision=call.precision)
