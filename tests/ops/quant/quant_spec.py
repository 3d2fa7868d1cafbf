"""An independent numpy implementation of the quantization formats, written
from the format definitions (bit fields → value tables, nearest-even by table
search). Nothing here imports stellax: the tests compare the library against
this code.

Definitions used:
* e4m3 (OCP FP8 E4M3, "fn"): bias 7, no Inf; S.1111.111 is NaN, so the largest
  normal is S.1111.110 = 1.75·2^8 = 448; subnormals 0.mmm·2^-6.
* e5m2 (OCP FP8 E5M2): bias 15, IEEE-like; exponent 11111 is Inf (m = 0) or
  NaN; largest normal 1.75·2^15 = 57344; subnormals 0.mm·2^-14.
* e2m1 (OCP MX FP4): bias 1, no Inf/NaN; values 0, 0.5 (subnormal), 1, 1.5, 2,
  3, 4, 6.
* E8M0 (OCP MX scale): unsigned, value 2^(code−127), code 255 = NaN.
* Scaling: elements are multiplied by the float32 reciprocal of their scale
  (the library's documented spec); scales are true float32 quotients.
* OCP MX v1.0 conversion: X = 2^(floor(log2(max|V|)) − emax_elem), emax_elem =
  8 (e4m3), 15 (e5m2), 2 (e2m1); P_i = V_i / X cast to the element with
  round-to-nearest-even and clamping to ±max normal.
* NVFP4: blocks of 16 with an E4M3 scale; a float32 per-tensor scale
  amax/(6·448) so that block scales amax_b/6/t land within E4M3's range.
"""

from __future__ import annotations

import numpy as np

f32 = np.float32


def _minifloat_table(exp_bits: int, man_bits: int, bias: int, kind: str):
    """Value of every code (sign in the top bit), NaN where the code is NaN."""
    n = 1 << (1 + exp_bits + man_bits)
    values = np.zeros(n, np.float64)
    for code in range(n):
        sign = -1.0 if code >> (exp_bits + man_bits) else 1.0
        e = (code >> man_bits) & ((1 << exp_bits) - 1)
        m = code & ((1 << man_bits) - 1)
        if kind == "fn" and e == (1 << exp_bits) - 1 and m == (1 << man_bits) - 1:
            values[code] = np.nan
            continue
        if kind == "ieee" and e == (1 << exp_bits) - 1:
            values[code] = sign * np.inf if m == 0 else np.nan
            continue
        if e == 0:
            mag = (m / (1 << man_bits)) * 2.0 ** (1 - bias)
        else:
            mag = (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)
        values[code] = sign * mag
    return values


E4M3_TABLE = _minifloat_table(4, 3, 7, "fn")
E5M2_TABLE = _minifloat_table(5, 2, 15, "ieee")
E2M1_TABLE = _minifloat_table(2, 1, 1, "none")
TABLES = {"e4m3": E4M3_TABLE, "e5m2": E5M2_TABLE, "e2m1": E2M1_TABLE}
EMAX = {"e4m3": 8, "e5m2": 15, "e2m1": 2}
SIGN_BIT = {"e4m3": 0x80, "e5m2": 0x80, "e2m1": 0x8}


def max_finite(name):
    t = TABLES[name]
    return float(np.nanmax(t[np.isfinite(t)]))


def encode_rne(v, name):
    """Round float values to the nearest code (ties to the even code),
    saturating to ±max; NaN → 0x7F (8-bit) or None-defined (4-bit: 0).
    Returns int codes."""
    table = TABLES[name]
    half = len(table) // 2
    mags = table[:half]  # codes 0..half-1 are the non-negative values
    finite = np.isfinite(mags)
    pos_codes = np.arange(half)[finite]
    pos_vals = mags[finite]
    order = np.argsort(pos_vals, kind="stable")
    pos_codes, pos_vals = pos_codes[order], pos_vals[order]
    v = np.asarray(v, np.float64)
    a = np.minimum(np.abs(np.where(np.isnan(v), 0, v)), pos_vals[-1])
    hi = np.searchsorted(pos_vals, a, side="left")  # first value >= a
    hi = np.minimum(hi, len(pos_vals) - 1)
    lo = np.maximum(hi - 1, 0)
    exact = pos_vals[hi] == a
    dlo = a - pos_vals[lo]
    dhi = pos_vals[hi] - a
    pick_hi = (dhi < dlo) | ((dhi == dlo) & (pos_codes[hi] % 2 == 0))
    idx = np.where(exact, hi, np.where(pick_hi, hi, lo))
    codes = pos_codes[idx]
    neg = np.signbit(v)
    codes = np.where(neg, codes | SIGN_BIT[name], codes)
    if name in ("e4m3", "e5m2"):
        codes = np.where(np.isnan(v), 0x7F, codes)
    else:
        codes = np.where(np.isnan(v), 0, codes)
    return codes.astype(np.int64)


def decode(codes, name):
    return TABLES[name][np.asarray(codes, np.int64)]


def e8m0_value(code):
    code = np.asarray(code, np.int64)
    return np.where(code == 255, np.nan, np.ldexp(1.0, code - 127))


def floor_log2(a):
    """floor(log2(a)) of positive float values (exact, via frexp)."""
    _, e = np.frexp(np.asarray(a, np.float64))
    return e - 1


# -- per-format quantizers over 1-D blocks along the last axis -----------------


def blocks_last(x, block):
    """[..., n] → [..., nb, block] zero-padded."""
    n = x.shape[-1]
    nb = -(-n // block)
    pad = nb * block - n
    xp = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), x.dtype)], axis=-1) if pad else x
    return xp.reshape(x.shape[:-1] + (nb, block)), n


def finite_amax(b):
    return np.max(np.where(np.isfinite(b), np.abs(b), 0), axis=-1)


def quantize_int_sym(x, block, qmax):
    b, n = blocks_last(np.asarray(x, f32), block)
    amax = finite_amax(b).astype(f32)
    s = np.where(amax > 0, amax / f32(qmax), f32(1)).astype(f32)
    t = (b * (f32(1) / s)[..., None]).astype(f32)
    q = np.clip(np.rint(np.where(np.isnan(t), 0, t)), -qmax, qmax)
    nan_block = np.isnan(b).any(-1)
    s = np.where(nan_block, np.nan, s).astype(f32)
    return q.reshape(x.shape[:-1] + (-1,))[..., :n].astype(np.int64), s


def quantize_int_asym(x, block, qmin, qmax):
    b, n = blocks_last(np.asarray(x, f32), block)
    fin = np.where(np.isfinite(b), b, 0).astype(f32)
    lo = np.minimum(fin.min(-1), 0).astype(f32)
    hi = np.maximum(fin.max(-1), 0).astype(f32)
    s = ((hi - lo) / f32(qmax - qmin)).astype(f32)
    s = np.where(s > 0, s, f32(1)).astype(f32)
    zp = np.clip(np.rint(f32(qmin) - (lo / s).astype(f32)), qmin, qmax)
    t = (b * (f32(1) / s)[..., None]).astype(f32)
    q = np.clip(np.rint(np.where(np.isnan(t), 0, t)) + zp[..., None], qmin, qmax)
    s = np.where(np.isnan(b).any(-1), np.nan, s).astype(f32)
    return q.reshape(x.shape[:-1] + (-1,))[..., :n].astype(np.int64), s, zp.astype(np.int64)


def quantize_fp8(x, block, name):
    b, n = blocks_last(np.asarray(x, f32), block)
    amax = finite_amax(b).astype(f32)
    s = np.where(amax > 0, amax / f32(max_finite(name)), f32(1)).astype(f32)
    v = (b * (f32(1) / s)[..., None]).astype(f32)
    codes = encode_rne(v, name)
    return codes.reshape(x.shape[:-1] + (-1,))[..., :n], s


def quantize_mx(x, name, block=32):
    b, n = blocks_last(np.asarray(x, f32), block)
    bad = (~np.isfinite(b)).any(-1)
    amax = finite_amax(b)
    e = np.where(amax > 0, floor_log2(np.where(amax > 0, amax, 1)) - EMAX[name], -127)
    e = np.clip(e, -127, 127)
    scale_codes = np.where(bad, 255, e + 127)
    v = np.asarray(b, np.float64) / np.ldexp(1.0, e)[..., None]
    v = np.where(bad[..., None], 0.0, v)
    codes = encode_rne(v, name)
    return codes.reshape(x.shape[:-1] + (-1,))[..., :n], scale_codes


def quantize_nvfp4(x, block=16):
    """1-D blocks of 16 along the last axis."""
    x = np.asarray(x, f32)
    gmax = f32(np.max(np.where(np.isfinite(x), np.abs(x), 0)))
    t = f32(gmax / f32(6 * 448)) if gmax > 0 else f32(1)
    b, n = blocks_last(x, block)
    bamax = finite_amax(b).astype(f32)
    sb_code = encode_rne((bamax / f32(6)).astype(f32) / t, "e4m3")
    sb = decode(sb_code, "e4m3").astype(f32)
    nan_block = np.isnan(b).any(-1)
    sb_code = np.where(nan_block, 0x7F, sb_code)
    denom = (sb * t).astype(f32)
    safe = np.where(denom == 0, f32(1), denom)
    inv = np.where(denom == 0, f32(0), f32(1) / safe).astype(f32)
    v = (b * inv[..., None]).astype(f32)
    v = np.where(np.isnan(b), 0, v)
    codes = encode_rne(v, "e2m1")
    return codes.reshape(x.shape[:-1] + (-1,))[..., :n], sb_code, t


def unpack_nibbles_last(packed, n):
    """uint8 [..., ceil(n/2)] → codes [..., n] (low nibble first)."""
    p = np.asarray(packed).astype(np.int64)
    out = np.stack([p & 0xF, p >> 4], axis=-1).reshape(p.shape[:-1] + (-1,))
    return out[..., :n]
