"""Golden quantize / dequantize (plain jnp, float32 math) — the spec in code.

Blocks: ``block_shape`` has one size per dimension; the scale of element
``idx`` is ``scales[idx // block_shape]``. A trailing partial block is
treated as zero-padded (zeros never change a block's amax).

Per format, for one block ``B`` with ``amax = max |x|`` over its finite
elements (all arithmetic float32, ``round`` = round half to even, ``sat`` =
round-to-nearest-even onto the element grid with saturation to ±max):

Elements are scaled by multiplying with the per-block reciprocal ``r = 1/s``
(float32, correctly rounded): ``x / s`` below means ``x · r``. Scale
formulas (``amax / qmax`` ...) are true float32 divisions.

* ``int8`` / ``int4`` (symmetric, ``qmax`` = 127 / 7):
  ``s = amax / qmax`` (1 if amax = 0), ``q = clip(round(x / s), -qmax, qmax)``.
* ``int8_asym`` / ``int4_asym`` (codes [-128, 127] / [-8, 7]):
  ``lo = min(min x, 0)``, ``hi = max(max x, 0)``, ``s = (hi - lo) / (qmax -
  qmin)`` (1 if 0), ``zp = clip(round(qmin - lo / s), qmin, qmax)``,
  ``q = clip(round(x / s) + zp, qmin, qmax)``; value ``(q - zp) * s``.
* ``fp8_e4m3`` / ``fp8_e5m2``: ``s = amax / fmax`` (448 / 57344; 1 if amax = 0),
  ``q = sat(x / s)``.
* ``mxfp8_*`` / ``mxfp4`` (OCP MX v1.0, blocks of 32): ``e = floor(log2(amax))
  - emax_elem`` (emax_elem: e4m3 8, e5m2 15, e2m1 2), clamped to [-127, 127]
  (-127 when amax = 0), scale ``X = 2^e`` stored as E8M0 (code ``e + 127``),
  ``q = sat(x / X)``. A block holding any NaN or ±Inf gets the NaN scale
  (E8M0 ``0xFF``) and zero element codes: it dequantizes to all-NaN.
* ``nvfp4`` (blocks of 16 or 16×16): tensor scale ``t = amax_tensor / (6 ·
  448)`` (1 if 0); block scale ``S = e4m3(amax_block / 6 / t)`` (RNE,
  saturating); ``q = sat(x / (S · t))`` (0 where ``S = 0``); value ``q · (S · t)``.

Non-finite inputs for the non-MX formats: scales come from the finite values;
±Inf saturates to ±max; NaN becomes the NaN code for fp8 elements, and for
elements without a NaN code (int8, int4, e2m1 of nvfp4) the block's scale is
set to NaN (code 0), so the whole block dequantizes to NaN — a NaN never
turns silently into a number.

Stochastic rounding (``noise`` uniform in [0, 1)) replaces ``round``/``sat``
by rounding up with probability equal to the fractional distance to the
lower grid point (unbiased); scales are unchanged.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import formats as F
from .qarray import QArray, scale_shape


# -- exact arithmetic ------------------------------------------------------------


def div(a, b):
    """IEEE ``a / b`` in float32 for small (per-block) arrays. XLA rewrites a
    division by a broadcast or constant into a multiply by its reciprocal
    (1 ulp off); an optimization barrier on the full-shape divisor keeps the
    true division."""
    a = jnp.asarray(a, jnp.float32)
    b = jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape)
    return a / jax.lax.optimization_barrier(b)


def reciprocal(s):
    """Per-block ``1 / s`` (float32, IEEE division). Elements are scaled by
    multiplying with it: ``v = x · (1/s)`` is the spec, identical in XLA, in
    kernels and in numpy (a true ``x / s`` would be rewritten by XLA anyway)."""
    return div(jnp.ones(s.shape, jnp.float32), s)


# -- block helpers ----------------------------------------------------------------


def _padded(x, block_shape, fill=0.0):
    pads = [(0, (-s) % b) for s, b in zip(x.shape, block_shape)]
    if any(p for _, p in pads):
        x = jnp.pad(x, pads, constant_values=fill)
    return x


def block_view(x, block_shape, fill=0.0):
    """``x`` zero-padded to whole blocks, as ``[n0, b0, n1, b1, ...]``."""
    xp = _padded(x, block_shape, fill)
    dims = []
    for s, b in zip(xp.shape, block_shape):
        dims += [s // b, b]
    return xp.reshape(dims)


def block_reduce(x, block_shape, op, fill=0.0):
    """Reduce each block with ``op`` (jnp.max, jnp.min, jnp.any, ...) → the scales' shape."""
    v = block_view(x, block_shape, fill)
    return op(v, axis=tuple(range(1, v.ndim, 2)))


def expand_blocks(s, block_shape, shape):
    """Per-block array (shape ``ceil(shape / block_shape)``) → per element."""
    for d, b in enumerate(block_shape):
        if b > 1:
            s = jnp.repeat(s, b, axis=d, total_repeat_length=s.shape[d] * b)
    return s[tuple(slice(0, n) for n in shape)]


# -- quantize -----------------------------------------------------------------------


def _finite_amax(x, block_shape):
    a = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
    return block_reduce(a, block_shape, jnp.max)


def _any(mask, block_shape):
    return block_reduce(mask, block_shape, jnp.any, fill=False)


def _cast_scale(s, scale_dtype):
    """A float32 scale → ``scale_dtype`` (e8m0: the power of two ≥ s)."""
    if scale_dtype is None or np.dtype(scale_dtype) == np.dtype(jnp.float32):
        return s
    if np.dtype(scale_dtype) == np.dtype(jnp.float8_e8m0fnu):
        e = F.floor_log2(s)
        e = e + (F.exp2_int(jnp.clip(e, -126, 127)) < s).astype(jnp.int32)
        return F.e8m0_from_exponent(e)
    return s.astype(scale_dtype)


def _elements(v, fmt: F.Format, noise):
    """Scaled float32 values → stored element codes (unpacked for 4-bit)."""
    el = fmt.element
    r = F.round_to_element(v, el, noise)
    if el.kind == "int":
        return jnp.where(jnp.isnan(v), 0, r).astype(jnp.int32)
    if el.bits == 4:
        return F.e2m1_encode(jnp.where(jnp.isnan(r), 0.0, r))
    return F.to_float8(r, el)


def _store(codes, fmt: F.Format, axis: int):
    if fmt.packed:
        return F.pack_nibbles(codes, axis)
    return codes.astype(fmt.storage_dtype)


def quantize_reference(x, fmt: F.Format, block_shape, axis: int, *, scale_dtype=None, noise=None,
                       rotation=None) -> QArray:
    """Quantize ``x`` (any float dtype) into a `QArray` (see the module docstring)."""
    fmt = F.get_format(fmt)
    shape = tuple(x.shape)
    block_shape = tuple(block_shape)
    x = x.astype(jnp.float32)
    el = fmt.element
    expand = lambda s: expand_blocks(s, block_shape, shape)
    zero_points = tensor_scale = None

    if fmt.is_mx:
        bad = _any(~jnp.isfinite(x), block_shape)
        amax = _finite_amax(x, block_shape)
        e = jnp.where(amax > 0, F.floor_log2(amax) - el.emax, -127)
        e = jnp.clip(e, -127, 127)
        scales = F.e8m0_from_exponent(e, bad)
        # x / 2^e computed as x * 2^-e: exact, and 2^-e stays a normal float32.
        v = x * expand(F.exp2_int(jnp.clip(-e, -126, 127)))
        v = jnp.where(expand(bad), 0.0, v)
        codes = _elements(v, fmt, noise)
    elif fmt.scale == "e4m3":  # nvfp4
        finite = jnp.where(jnp.isfinite(x), jnp.abs(x), 0.0)
        gmax = jnp.max(finite)
        tensor_scale = jnp.where(gmax > 0, div(gmax, 6.0 * 448.0), jnp.float32(1.0))
        bamax = _finite_amax(x, block_shape)
        sb = F.round_to_element(div(div(bamax, 6.0), tensor_scale), F.E4M3)
        nan_block = _any(jnp.isnan(x), block_shape)
        denom = sb * tensor_scale
        inv = expand(jnp.where(denom == 0, 0.0, reciprocal(jnp.where(denom == 0, 1.0, denom))))
        v = x * inv
        v = jnp.where(jnp.isnan(x), 0.0, v)
        codes = _elements(v, fmt, noise)
        scales = F.to_float8(jnp.where(nan_block, jnp.float32(np.nan), sb), F.E4M3)
    elif el.kind == "int":
        nan_block = _any(jnp.isnan(x), block_shape)
        finite_x = jnp.where(jnp.isfinite(x), x, 0.0)
        qmin, qmax = el.min_code, el.max_value
        if fmt.zero_point:
            lo = jnp.minimum(block_reduce(finite_x, block_shape, jnp.min), 0.0)
            hi = jnp.maximum(block_reduce(finite_x, block_shape, jnp.max), 0.0)
            s = div(hi - lo, qmax - qmin)
            s = jnp.where(s > 0, s, jnp.float32(1.0))
            s = _cast_scale(s, scale_dtype)
            s32 = s.astype(jnp.float32)
            zp = jnp.clip(jnp.round(jnp.float32(qmin) - div(lo, s32)), qmin, qmax)
            zero_points = zp.astype(jnp.int8)
            zp_e = expand(zp)
        else:
            amax = _finite_amax(x, block_shape)
            s = jnp.where(amax > 0, div(amax, qmax), jnp.float32(1.0))
            s = _cast_scale(s, scale_dtype)
            s32 = s.astype(jnp.float32)
            zp_e = 0.0
        t = x * expand(reciprocal(s32))
        if noise is None:
            r = jnp.round(t)
        else:
            r = jnp.floor(t + noise)
        r = jnp.where(jnp.isnan(t), 0.0, r)
        codes = jnp.clip(r + zp_e, qmin, qmax).astype(jnp.int32)
        scales = jnp.where(nan_block, jnp.asarray(np.nan, s.dtype), s) if np.dtype(s.dtype) != np.dtype(
            jnp.float8_e8m0fnu) else F.e8m0_from_exponent(F.floor_log2(s.astype(jnp.float32)), nan_block)
    else:  # fp8 with float scales
        amax = _finite_amax(x, block_shape)
        s = jnp.where(amax > 0, div(amax, el.max_value), jnp.float32(1.0))
        s = _cast_scale(s, scale_dtype)
        v = x * expand(reciprocal(s.astype(jnp.float32)))
        codes = _elements(v, fmt, noise)
        scales = s
    values = _store(codes, fmt, axis)
    return QArray(values, scales, zero_points, tensor_scale, format=fmt.name, shape=shape,
                  block_shape=block_shape, axis=axis, rotation=rotation)


# -- dequantize ----------------------------------------------------------------------


def decode_elements(q: QArray):
    """float32 element values (before scaling), logical shape."""
    fmt = q.spec
    v = q.values
    if fmt.packed:
        nib = F.unpack_nibbles(v, q.axis, q.shape[q.axis])
        if fmt.element.kind == "int":
            return F.int4_decode(nib).astype(jnp.float32)
        return F.e2m1_decode(nib)
    return v.astype(jnp.float32)


def dequantize_reference(q: QArray, dtype=jnp.float32):
    """``(code - zero_point) * scale * tensor_scale`` in float32, cast to ``dtype``."""
    e = decode_elements(q)
    s = q.scales.astype(jnp.float32)
    if q.tensor_scale is not None:
        s = s * q.tensor_scale.astype(jnp.float32)
    if q.zero_points is not None:
        e = e - expand_blocks(q.zero_points.astype(jnp.float32), q.block_shape, q.shape)
    return (e * expand_blocks(s, q.block_shape, q.shape)).astype(dtype)


def scales_per_element(q: QArray):
    """float32 scale of every element (``scale * tensor_scale``), logical shape."""
    s = q.scales.astype(jnp.float32)
    if q.tensor_scale is not None:
        s = s * q.tensor_scale.astype(jnp.float32)
    return expand_blocks(s, q.block_shape, q.shape)


__all__ = ["block_reduce", "block_view", "decode_elements", "dequantize_reference", "expand_blocks",
           "quantize_reference", "scale_shape", "scales_per_element"]
