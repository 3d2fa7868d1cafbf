"""vLLM's fp8 KV-cache codes, written the way vLLM's CPU backend writes them.

Pure torch (no vLLM import). vLLM's ``--kv-cache-dtype fp8`` (= ``fp8_e4m3``)
and ``fp8_e5m2`` store one byte per key / value element with one float32
scale per layer and tensor (the attention layer's ``_k_scale`` /
``_v_scale``, 1.0 unless the checkpoint carries KV scales):

    code = fp8(x / scale)            x ≈ float(code) · scale

with the byte read as IEEE-style e4m3fn (bias 7, max 448, ``0x7F`` NaN) or
e5m2 (bias 15, max 57344). vLLM's CPU kernels (``cpu_attn_reshape_and_cache``,
``csrc/cpu/cpu_attn_fp8.hpp``) compute ``x · (1 / scale)`` in float32, clamp to
the format's largest finite value and then **truncate** the mantissa (toward
zero), not round it; `fp8_codes` does the same bit for bit, so a cache written
by the stellax backend holds the same bytes as one written by ``CPU_ATTN``
(``tests/integrations/test_vllm_e2e.py`` compares the two on random inputs).
The values a code decodes to are the standard float8 values
(``torch.float8_e4m3fn`` / ``torch.float8_e5m2``), which is how stellax's
kernels read them.
"""

from __future__ import annotations

import torch

#: vLLM ``--kv-cache-dtype`` → the code format (``torch`` dtype the bytes are read as).
FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

_E4M3_MAX = 448.0
_E5M2_MAX = 57344.0


def _bits(v: torch.Tensor) -> torch.Tensor:
    return v.contiguous().view(torch.int32)


def _e4m3_truncated(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` (already clamped to ±448) → e4m3fn bytes, mantissa truncated.

    ``v · 2^-120`` moves e4m3's exponent bias (7) to float32's (127), so the
    e4m3 code is bits 20..26 of the product (sign at bit 31); values below
    e4m3's normal range land in float32's subnormals and the same bits are
    e4m3's subnormal code. ``0x7F`` (NaN) is kept out."""
    bits = _bits(v * 2.0 ** -120)
    sign = (bits >> 24) & 0x80
    payload = torch.clamp((bits >> 20) & 0x7F, max=0x7E)
    return sign | payload


def _e5m2_truncated(v: torch.Tensor) -> torch.Tensor:
    """float32 ``v`` (already clamped to ±57344) → e5m2 bytes, mantissa truncated."""
    bits = _bits(v)
    sign = (bits >> 24) & 0x80
    exp = ((bits >> 23) & 0xFF) - 127
    normal = sign | ((exp + 15).clamp(min=0) << 2) | ((bits >> 21) & 0x03)
    # Below 2^-14: e5m2 subnormals, the 24-bit significand shifted right by (-14 - exp) + 21.
    shift = (-14 - exp).clamp(min=0) + 21
    significand = (bits & 0x7FFFFF) | 0x800000
    sub = torch.where(shift >= 32, torch.zeros_like(bits), (significand >> shift.clamp(max=31)).clamp(max=3))
    return torch.where(exp < -14, sign | sub, normal)


def fp8_codes(x: torch.Tensor, scale, cache_dtype: str) -> torch.Tensor:
    """vLLM CPU's fp8 cache codes of ``x`` (any shape, float) as uint8 bytes.

    Args:
      x: keys or values (float32 / bfloat16 / float16).
      scale: the layer's per-tensor scale (a float or a float32 scalar tensor); ``x / scale``
        is computed as ``x · (1 / scale)`` in float32, as vLLM does.
      cache_dtype: ``"fp8"``, ``"fp8_e4m3"`` or ``"fp8_e5m2"``.

    NaN inputs become the largest positive code (vLLM's ``std::min``/``std::max``
    clamp); ±0 become code 0.
    """
    if cache_dtype not in FP8_CACHE_DTYPES:
        raise ValueError(f"cache_dtype: expected one of {sorted(FP8_CACHE_DTYPES)}, got {cache_dtype!r}")
    inv = 1.0 / torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    v = x.to(torch.float32) * inv
    limit = _E5M2_MAX if cache_dtype == "fp8_e5m2" else _E4M3_MAX
    v = torch.where(torch.isnan(v), torch.full_like(v, limit), v).clamp(-limit, limit)
    codes = _e5m2_truncated(v) if cache_dtype == "fp8_e5m2" else _e4m3_truncated(v)
    codes = torch.where(v == 0, torch.zeros_like(codes), codes)
    return codes.to(torch.uint8)


def dequantize(codes: torch.Tensor, scale, cache_dtype: str) -> torch.Tensor:
    """float32 values of uint8 fp8 ``codes``: ``float(code) · scale``."""
    return codes.view(FP8_CACHE_DTYPES[cache_dtype]).to(torch.float32) * torch.as_tensor(scale, dtype=torch.float32)


def write_kv(pages: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor, k_scale,
             v_scale, cache_dtype: str) -> None:
    """The backend's fp8 cache write, in place: ``pages`` is the layer's uint8
    ``[num_blocks, block_size, 2, K, D]`` view; row ``t`` of ``key`` / ``value
    [T, K, D]`` goes to slot ``slot_mapping[t]`` (negative: padding) as
    `fp8_codes` with the layer's scales."""
    from stellax.torch import update_kv_cache_

    if pages.dtype != torch.uint8:
        raise TypeError(f"pages: expected the uint8 view of an fp8 cache, got {pages.dtype}")
    update_kv_cache_(pages[:, :, 0], pages[:, :, 1], fp8_codes(key, k_scale, cache_dtype),
                     fp8_codes(value, v_scale, cache_dtype), slot_mapping)


def kv_pools(codes: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor, cache_dtype: str, head_size: int):
    """The key and value pools over an fp8 cache's pages, sharing them.

    ``codes [num_blocks, block_size, 2, K, D]`` (the float8 view of the layer's
    pages), ``k_scale`` / ``v_scale`` float32 scalar tensors → two
    `stellax.torch.QuantizedPages` (``KVQuant(format, group_axis="tensor",
    part=0 | 1)``) whose ``data`` is ``codes`` itself."""
    from stellax.torch import QuantizedPages

    if codes.dtype != FP8_CACHE_DTYPES[cache_dtype]:
        raise TypeError(f"codes: expected {FP8_CACHE_DTYPES[cache_dtype]} for kv_cache_dtype={cache_dtype!r}, got "
                        f"{codes.dtype}")
    fmt = "fp8_e5m2" if cache_dtype == "fp8_e5m2" else "fp8"
    return tuple(QuantizedPages(codes, scale, None, None, None, _spec(fmt, part), int(head_size))
                 for part, scale in enumerate((k_scale, v_scale)))


_SPECS: dict = {}


def _spec(fmt: str, part: int):
    from stellax import KVQuant

    key = (fmt, part)
    if key not in _SPECS:
        _SPECS[key] = KVQuant(fmt, group_axis="tensor", part=part)
    return _SPECS[key]
