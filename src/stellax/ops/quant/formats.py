"""Quantization formats: element types, scale types and their exact casts.

Every function here is plain ``jnp`` on float32 values, so the same code runs
in XLA and inside Pallas Triton kernels (no lookup tables, no 4-bit dtypes).

Element types (value sets):

=========  ======  =====  ================  =============================
element    bits    max    smallest > 0      notes
=========  ======  =====  ================  =============================
int8       8       127    1                 symmetric codes [-127, 127]
int8_asym  8       127    1                 codes [-128, 127] + zero point
int4       4       7      1                 symmetric codes [-7, 7]
int4_asym  4       7      1                 codes [-8, 7] + zero point
e4m3       8       448    2^-9 (subnormal)  float8_e4m3fn: no Inf, NaN = S.1111.111
e5m2       8       57344  2^-16 (subn.)     float8_e5m2: IEEE-like, Inf and NaN
e2m1       4       6      0.5 (subnormal)   values 0, .5, 1, 1.5, 2, 3, 4, 6; no Inf/NaN
=========  ======  =====  ================  =============================

Casts to an element type are round-to-nearest-even with saturation: finite
values beyond the largest magnitude (and ±Inf) become ±max. NaN becomes the
canonical NaN code (``0x7F``) where the element type has one.

4-bit codes are packed two per byte along the quantized axis: byte ``j``
holds element ``2j`` in its low nibble and element ``2j+1`` in its high
nibble (an odd length leaves the last high nibble 0).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

# -- element types ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Element:
    """An element type: ``kind`` is ``"int"`` or ``"float"``."""

    name: str
    kind: str
    bits: int
    max_value: float
    #: float elements: exponent bits, mantissa bits, minimum normal exponent,
    #: OCP MX ``emax_elem`` (exponent of the largest normal).
    mantissa_bits: int = 0
    min_exponent: int = 0
    emax: int = 0
    #: int elements: smallest code.
    min_code: int = 0
    #: the storage dtype of an (unpacked) 8-bit element.
    dtype: object = None
    has_nan: bool = False


E4M3 = Element("e4m3", "float", 8, 448.0, mantissa_bits=3, min_exponent=-6, emax=8,
               dtype=jnp.float8_e4m3fn, has_nan=True)
E5M2 = Element("e5m2", "float", 8, 57344.0, mantissa_bits=2, min_exponent=-14, emax=15,
               dtype=jnp.float8_e5m2, has_nan=True)
E2M1 = Element("e2m1", "float", 4, 6.0, mantissa_bits=1, min_exponent=0, emax=2)
INT8 = Element("int8", "int", 8, 127.0, min_code=-127, dtype=jnp.int8)
INT8_ASYM = Element("int8_asym", "int", 8, 127.0, min_code=-128, dtype=jnp.int8)
INT4 = Element("int4", "int", 4, 7.0, min_code=-7)
INT4_ASYM = Element("int4_asym", "int", 4, 7.0, min_code=-8)

#: Canonical NaN code of the 8-bit float elements.
NAN_CODE = 0x7F


# -- formats -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Format:
    """A quantization format.

    Attributes:
      name: the public name (``quantize(x, name)``).
      element: the element type.
      scale: ``"float"`` (float32, or ``scale_dtype``), ``"e8m0"`` (OCP MX
        power-of-two scale) or ``"e4m3"`` (NVFP4 block scale).
      zero_point: asymmetric (int8 zero points stored per block).
      tensor_scale: carries one float32 per-tensor scale (NVFP4).
      default_block: ``"channel"``, or the block length along the axis.
      blocks: allowed ``block_size`` values (``None``: any).
    """

    name: str
    element: Element
    scale: str = "float"
    zero_point: bool = False
    tensor_scale: bool = False
    default_block: object = "channel"
    blocks: tuple | None = None

    @property
    def packed(self) -> bool:
        return self.element.bits == 4

    @property
    def storage_dtype(self):
        return jnp.uint8 if self.packed else self.element.dtype

    @property
    def scale_storage_dtype(self):
        return {"e8m0": jnp.float8_e8m0fnu, "e4m3": jnp.float8_e4m3fn}.get(self.scale, jnp.float32)

    @property
    def is_mx(self) -> bool:
        return self.scale == "e8m0"

    @property
    def bits_per_element(self) -> int:
        return self.element.bits


FORMATS: dict[str, Format] = {
    f.name: f for f in (
        Format("int8", INT8),
        Format("int8_asym", INT8_ASYM, zero_point=True),
        Format("int4", INT4, default_block=128),
        Format("int4_asym", INT4_ASYM, zero_point=True, default_block=128),
        Format("fp8_e4m3", E4M3),
        Format("fp8_e5m2", E5M2),
        Format("mxfp8_e4m3", E4M3, scale="e8m0", default_block=32, blocks=(32,)),
        Format("mxfp8_e5m2", E5M2, scale="e8m0", default_block=32, blocks=(32,)),
        Format("mxfp4", E2M1, scale="e8m0", default_block=32, blocks=(32,)),
        Format("nvfp4", E2M1, scale="e4m3", tensor_scale=True, default_block=16, blocks=(16, (16, 16))),
    )
}
#: Aliases accepted by `get_format`.
ALIASES = {"mxfp8": "mxfp8_e4m3", "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "e5m2": "fp8_e5m2"}


def get_format(name) -> Format:
    if isinstance(name, Format):
        return name
    if not isinstance(name, str):
        raise TypeError(f"format: expected a format name (str), got {type(name).__name__}")
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        raise ValueError(f"format: expected one of {sorted(FORMATS) + sorted(ALIASES)}, got {name!r}")
    return FORMATS[key]


# -- float element casts --------------------------------------------------------


def _float_bits(x):
    return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def floor_log2(x):
    """``floor(log2(x))`` for finite ``x > 0`` (float32), exact, from the
    exponent bits; float32 subnormals give -127 (they only occur where the
    result is clamped anyway). Returns int32."""
    biased = (_float_bits(x) >> 23) & 0xFF
    return jnp.where(biased == 0, -127, biased - 127)


def _quantum_exponent(a, element: Element):
    """Exponent of the spacing of ``element``'s value grid around magnitude
    ``a`` (float32): ``max(floor(log2 a), emin) - mantissa_bits`` (int32)."""
    e = jnp.maximum(floor_log2(jnp.maximum(a, jnp.float32(2.0 ** element.min_exponent))),
                    element.min_exponent)
    return e - element.mantissa_bits


def exp2_int(e):
    """``2^e`` as float32 for int32 ``e`` in [-126, 127] (exact, bit-built)."""
    return jax.lax.bitcast_convert_type(((e + 127) << 23).astype(jnp.int32), jnp.float32)


def rne(t):
    """Round half to even for float32 ``|t| < 2^22`` with floor only (Pallas
    Triton has no round): ``floor(t + 0.5)``, minus 1 on an exact tie that
    landed on an odd integer. ``t + 0.5`` is exact in that range."""
    up = t + 0.5
    r = jnp.floor(up)
    odd = (r - 2.0 * jnp.floor(r * 0.5)) == 1.0
    return jnp.where((up == r) & odd, r - 1.0, r)


def round_to_element(v, element: Element, noise=None):
    """Round float32 ``v`` onto ``element``'s value grid (float32 result).

    Round-to-nearest-even, or stochastic rounding when ``noise`` (uniform in
    [0, 1), same shape) is given: round up with probability equal to the
    distance from the lower grid point over the grid spacing, which is
    unbiased. Saturates to ±max (±Inf included); NaN stays NaN.
    """
    v = v.astype(jnp.float32)
    top = float(element.max_value)  # Python floats: a negated jnp constant does not lower in Triton
    if element.kind == "int":
        c = jnp.clip(v, float(element.min_code), top)
        if noise is None:
            r = jnp.round(c)  # half to even
        else:
            r = jnp.floor(c + noise)
        return jnp.clip(r, float(element.min_code), top)
    c = jnp.clip(v, -top, top)
    a = jnp.abs(c)
    qe = _quantum_exponent(a, element)
    q, inv_q = exp2_int(qe), exp2_int(-qe)  # powers of two: scaling by them is exact
    if noise is None:
        # a/q ≤ 2^(mantissa_bits + 1), so `rne` is exact; so is the rescale.
        r = rne(a * inv_q) * q
        # c's sign bit onto the magnitude, by bits: a negation can be lowered as 0 - r, which
        # makes -0.0 (a tiny negative value rounded to zero) +0.0 (seen in Mosaic on a v5e)
        sign = jax.lax.bitcast_convert_type(c, jnp.int32) & jnp.int32(-(2 ** 31))
        r = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(r, jnp.int32) | sign, jnp.float32)
    else:
        lo = jnp.floor(c * inv_q) * q
        r = lo + jnp.where(noise < (c - lo) * inv_q, q, jnp.float32(0))
    r = jnp.clip(r, -top, top)
    return jnp.where(jnp.isnan(v), v, r)


# -- e2m1 codes ------------------------------------------------------------------


def e2m1_encode(r):
    """Codes (uint8 in [0, 16)) of values already on the e2m1 grid (|r| ≤ 6)."""
    a = jnp.abs(r)
    mag = ((a >= 0.5).astype(jnp.int32) + (a >= 1.0) + (a >= 1.5) + (a >= 2.0) + (a >= 3.0)
           + (a >= 4.0) + (a >= 6.0))
    sign = jnp.signbit(r).astype(jnp.int32) << 3
    return (mag | sign).astype(jnp.uint8)


def e2m1_decode(code):
    """float32 values of e2m1 codes (integer array, low 4 bits used)."""
    code = code.astype(jnp.int32)
    e = (code >> 1) & 3
    m = (code & 1).astype(jnp.float32)
    mag = jnp.where(e == 0, 0.5 * m,
                    (1.0 + 0.5 * m) * jnp.where(e == 1, 1.0, jnp.where(e == 2, 2.0, 4.0)))
    return jnp.where((code & 8) != 0, -mag, mag)


def int4_decode(code):
    """Signed values of 4-bit two's-complement codes (low 4 bits used), int32."""
    code = code.astype(jnp.int32) & 0xF
    return (code ^ 8) - 8


def pack_nibbles(codes, axis: int):
    """Pack 4-bit codes (any int dtype, values in [0, 16) or [-8, 8)) two per
    byte along ``axis`` (low nibble = even index)."""
    codes = jnp.moveaxis(codes.astype(jnp.int32) & 0xF, axis, -1)
    n = codes.shape[-1]
    if n % 2:
        codes = jnp.pad(codes, [(0, 0)] * (codes.ndim - 1) + [(0, 1)])
    pairs = codes.reshape(*codes.shape[:-1], -1, 2)
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).astype(jnp.uint8)
    return jnp.moveaxis(packed, -1, axis)


def unpack_nibbles(packed, axis: int, length: int):
    """Inverse of `pack_nibbles`: int32 nibbles (0..15) of ``length`` along ``axis``."""
    p = jnp.moveaxis(packed.astype(jnp.int32), axis, -1)
    both = jnp.stack([p & 0xF, (p >> 4) & 0xF], axis=-1).reshape(*p.shape[:-1], -1)
    return jnp.moveaxis(both[..., :length], -1, axis)


# -- 8-bit float element codes ---------------------------------------------------


def to_float8(r, element: Element):
    """Values on the element grid (float32) → float8 array with canonical NaN."""
    out = r.astype(element.dtype)
    bits = jax.lax.bitcast_convert_type(out, jnp.uint8)
    bits = jnp.where(jnp.isnan(r), jnp.uint8(NAN_CODE), bits)
    return jax.lax.bitcast_convert_type(bits, element.dtype)


# -- scales -----------------------------------------------------------------------


def e8m0_from_codes(codes):
    """E8M0 scales from their codes (uint8 or int32 0..255), in ``codes``' shape.

    Shape the codes first, then call this: never reshape an ``float8_e8m0fnu``
    array. XLA on a TPU (libtpu 0.0.42) rewrites a reshape that drops a size-1
    dimension into an add-reduce whose initial value, zero, is NaN in E8M0 (the
    format has no zero): every scale came out NaN when the Mosaic quantize
    kernel's ``[rows·blocks, 1]`` codes were reshaped under `jax.jit`. The
    barrier keeps XLA from sinking an earlier integer reshape past the bitcast."""
    return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(codes.astype(jnp.uint8)), jnp.float8_e8m0fnu)


def e8m0_from_exponent(e, nan_mask=None):
    """E8M0 scales ``2^e`` (int32 ``e``, clamped to [-127, 127]); NaN (0xFF)
    where ``nan_mask``."""
    code = (jnp.clip(e, -127, 127) + 127).astype(jnp.uint8)
    if nan_mask is not None:
        code = jnp.where(nan_mask, jnp.uint8(0xFF), code)
    return e8m0_from_codes(code)


def e8m0_to_float(code):
    """float32 value of E8M0 codes (uint8 or int32): ``2^(code-127)``, 0xFF → NaN.
    Kernel-safe (bit construction, no exp2)."""
    c = code.astype(jnp.int32)
    normal = jax.lax.bitcast_convert_type(jnp.maximum(c, 1) << 23, jnp.float32)
    value = jnp.where(c == 0, jnp.float32(2.0 ** -127), normal)
    return jnp.where(c == 255, jnp.float32(np.nan), value)


def scale_to_float(scales):
    """Any stored scale array → float32 (E8M0, E4M3, bf16, f32)."""
    return scales.astype(jnp.float32)
