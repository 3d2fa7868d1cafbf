"""Pallas Triton kernel for the training GEMMs: both operands quantized.

``y [M, N] = D(a) · D(b)`` for ``a [M, K]`` quantized along K (1×g blocks)
and ``b [K, N]`` quantized along K (g×1 or g×g blocks), NVFP4 (``g = 16``,
E2M1 codes two per byte, E4M3 block scales, FP32 tensor scales) or MXFP8
(``g = 32``, E4M3/E5M2 codes, E8M0 block scales). One program per output
tile ``block_m × block_n``; the K loop steps one scale block ``g``, so each
step sees one scale per row of ``a`` and per column of ``b``:

    acc += dot(e_a[:, kb], e_b[kb, :]) · s_a[:, kb] · s_b[kb, :]
    y    = acc · t_a · t_b                                  (NVFP4 tensor scales)

``e`` are the element values decoded from the codes in registers (E2M1 and
E4M3/E5M2 values are exact in bfloat16, so the dot runs on bf16 tensor cores
with float32 accumulation: FP4/FP8 tensor cores emulated where the hardware
has none); the dequantized operands never exist in memory.

Prologue quantization (``a`` given as floats): the kernel quantizes each
loaded ``[block_m, g]`` tile of ``a`` itself — the block amax, the E4M3 (or
E8M0) block scale, the scaled elements rounded to the element grid (nearest
even, or stochastically with the given uniform noise) — with the formulas of
`reference.quantize_reference` (true IEEE divisions, exact power-of-two
scaling), so the codes are those `stellax.quantize` writes. The NVFP4 tensor
scale (a global amax) is computed before the launch. This fuses the
activation quantize into the forward GEMM and the gradient quantize (with its
stochastic rounding) into the data-gradient GEMM: the quantized activation /
gradient is never written to memory.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from ...core.pallas import dot, dot_nt, operand, output, triton_kernel_call
from . import formats as F
from . import kernel as K
from .configs import QMatmulConfig
from .qarray import QArray
from .reference import div
from .triton import _div_rn

_ANY = pl.BlockSpec(memory_space=pl.ANY)
FORMATS = ("nvfp4", "mxfp8_e4m3", "mxfp8_e5m2")


@dataclasses.dataclass(frozen=True)
class _Dual:
    """Static geometry of one launch."""

    m: int
    n: int
    k: int
    bm: int
    bn: int
    g: int          # the K block of both operands' scales (= the K step)
    fmt: str
    a_float: bool   # ``a`` holds floats, quantized in the prologue
    noise: bool     # stochastic rounding noise for the prologue quantize

    @property
    def packed(self) -> bool:
        return F.get_format(self.fmt).packed


def _zero(ref):
    return jnp.zeros((), ref.dtype)


def _rows_ok(g: _Dual, i, cols: int):
    return (i * g.bm + jax.lax.broadcasted_iota(jnp.int32, (g.bm, cols), 0)) < g.m


def _cols_ok(g: _Dual, j, rows: int):
    return (j * g.bn + jax.lax.broadcasted_iota(jnp.int32, (rows, g.bn), 1)) < g.n


def _load_a(ref, g: _Dual, i, s, width: int):
    """K step ``s`` of row block ``i``: ``[bm, width]`` (``width`` = g, or g/2 packed bytes)."""
    return plgpu.load(ref.at[pl.ds(i * g.bm, g.bm), pl.ds(s * width, width)], mask=_rows_ok(g, i, width),
                      other=_zero(ref))


def _quantize_tile(x, ts, noise, g: _Dual):
    """Quantize float32 rows ``x [bm, g]`` (one block per row) as
    `reference.quantize_reference` does: ``(element values [bm, g], block scale [bm, 1])``."""
    fmt = F.get_format(g.fmt)
    el = fmt.element
    finite = jnp.isfinite(x)
    amax = jnp.max(jnp.where(finite, jnp.abs(x), 0.0), axis=1, keepdims=True)
    if fmt.is_mx:
        bad = jnp.max(jnp.where(finite, 0, 1), axis=1, keepdims=True) > 0
        e = jnp.clip(jnp.where(amax > 0, F.floor_log2(amax) - el.emax, -127), -127, 127)
        v = jnp.where(bad, 0.0, x * F.exp2_int(jnp.clip(-e, -126, 127)))
        r = F.round_to_element(v, el, noise)
        scale = F.e8m0_to_float(jnp.where(bad, 255, e + 127))
        return jnp.where(jnp.isnan(r), 0.0, r), scale
    shape = amax.shape
    t = jnp.broadcast_to(ts, shape)
    sb = F.round_to_element(_div_rn(_div_rn(amax, jnp.full(shape, 6.0, jnp.float32)), t), F.E4M3)
    denom = sb * t
    inv = jnp.where(denom == 0, 0.0, _div_rn(jnp.ones(shape, jnp.float32), jnp.where(denom == 0, 1.0, denom)))
    v = jnp.where(jnp.isnan(x), 0.0, x * inv)
    r = F.round_to_element(v, el, noise)
    nan_block = jnp.max(jnp.where(jnp.isnan(x), 1, 0), axis=1, keepdims=True) > 0
    return jnp.where(jnp.isnan(r), 0.0, r), jnp.where(nan_block, jnp.float32(np.nan), sb)


def _a_step(a, a_scale, a_ts, a_noise, g: _Dual, i, s):
    """``(e_a [bm, g] float32, s_a [bm, 1])`` of K step ``s``."""
    if g.a_float:
        x = _load_a(a, g, i, s, g.g).astype(jnp.float32)
        noise = _load_a(a_noise, g, i, s, g.g) if g.noise else None
        ts = plgpu.load(a_ts.at[pl.ds(0, 1)]).reshape(1, 1) if a_ts is not None else None
        return _quantize_tile(x, ts, noise, g)
    if g.packed:
        e = K.decode_packed_pairs(_load_a(a, g, i, s, g.g // 2), g.fmt)
    else:
        e = K.decode_codes(_load_a(a, g, i, s, g.g), g.fmt)
    sa = plgpu.load(a_scale.at[pl.ds(i * g.bm, g.bm), pl.ds(s, 1)], mask=_rows_ok(g, i, 1), other=_zero(a_scale))
    return e, K.decode_scale(sa)


def _b_step(b, b_scale, g: _Dual, j, s):
    """``(e_b, s_b [1, bn])``: ``e_b`` is ``[bn, g]`` (packed, K last) or ``[g, bn]``."""
    rows = g.g // 2 if g.packed else g.g
    codes = plgpu.load(b.at[pl.ds(s * rows, rows), pl.ds(j * g.bn, g.bn)], mask=_cols_ok(g, j, rows),
                       other=_zero(b))
    e = K.decode_packed_pairs(codes.T, g.fmt) if g.packed else K.decode_codes(codes, g.fmt)
    sb = plgpu.load(b_scale.at[pl.ds(s, 1), pl.ds(j * g.bn, g.bn)], mask=_cols_ok(g, j, 1), other=_zero(b_scale))
    return e, K.decode_scale(sb)


def _dual_kernel(*, a, a_scale, a_ts, a_noise, b, b_scale, b_ts, y, geo: _Dual):
    """One ``[bm, bn]`` tile: ``acc += dot(e_a, e_b) · s_a · s_b`` per K block, ``y = acc · t_a · t_b``."""
    i, j = pl.program_id(0), pl.program_id(1)

    def body(s, acc):
        ea, sa = _a_step(a, a_scale, a_ts, a_noise, geo, i, s)
        eb, sb = _b_step(b, b_scale, geo, j, s)
        ea = ea.astype(jnp.bfloat16)  # E2M1 / E4M3 / E5M2 values are exact in bf16
        eb = eb.astype(jnp.bfloat16)
        part = dot_nt(ea, eb, precision=None) if geo.packed else dot(ea, eb, precision=None)
        return acc + part * sa * sb

    acc = jax.lax.fori_loop(0, geo.k // geo.g, body, jnp.zeros((geo.bm, geo.bn), jnp.float32))
    if a_ts is not None:
        acc = acc * plgpu.load(a_ts.at[pl.ds(0, 1)]).reshape(1, 1)
    if b_ts is not None:
        acc = acc * plgpu.load(b_ts.at[pl.ds(0, 1)]).reshape(1, 1)
    y[...] = acc


def default_config(m: int, n: int, g: int) -> QMatmulConfig:
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 16 if n <= 16 else 32 if n <= 32 else 64
    return QMatmulConfig(block_m=bm, block_n=bn, block_k=g, num_warps=4, num_stages=2)


def _check_b(b: QArray, k: int):
    if not isinstance(b, QArray) or b.ndim != 2 or b.axis != 0:
        raise ValueError(f"b: expected a rank-2 QArray [K, N] quantized along axis 0, got "
                         f"{b if not isinstance(b, QArray) else (b.shape, b.axis)}")
    if b.format not in FORMATS:
        raise ValueError(f"b: expected a format in {list(FORMATS)}, got {b.format}")
    if b.shape[0] != k:
        raise ValueError(f"b: expected K = {k} rows, got shape {b.shape}")
    g = b.block_shape[0]
    if k % g:
        raise ValueError(f"b: K = {k} must be a multiple of the K block {g}")
    return g


def _launch(a, a_scale, a_ts, a_noise, b: QArray, *, m, k, g, fmt, a_float, config):
    n = b.shape[1]
    kernel_ops = K.kernel_operands(b)
    config = config or default_config(m, n, g)
    geo = _Dual(m=m, n=n, k=k, bm=config.block_m, bn=config.block_n, g=g, fmt=fmt, a_float=a_float,
                noise=a_noise is not None)
    out = triton_kernel_call(
        functools.partial(_dual_kernel, geo=geo), grid=(pl.cdiv(m, geo.bm), pl.cdiv(n, geo.bn)),
        inputs=dict(a=operand(a, _ANY), a_scale=operand(a_scale, _ANY), a_ts=operand(a_ts, _ANY),
                    a_noise=operand(a_noise, _ANY), b=operand(kernel_ops.values, _ANY),
                    b_scale=operand(kernel_ops.scales, _ANY), b_ts=operand(kernel_ops.tensor_scale, _ANY)),
        outputs=dict(y=output((m, n), jnp.float32, pl.BlockSpec((geo.bm, geo.bn), lambda i, j: (i, j)))),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_dual_quantized_matmul",
    )
    return out.y


def dual_quantized_matmul(a: QArray, b: QArray, *, config: QMatmulConfig | None = None):
    """float32 ``D(a) · D(b)``: ``a`` a `QArray` ``[M, K]`` quantized along
    axis 1 in 1×g blocks, ``b`` ``[K, N]`` along axis 0 (g×1 or g×g blocks),
    both NVFP4 or both MXFP8 (see the module docstring)."""
    if not isinstance(a, QArray) or a.ndim != 2 or a.axis != 1:
        raise ValueError("a: expected a rank-2 QArray [M, K] quantized along axis 1")
    m, k = a.shape
    g = _check_b(b, k)
    if a.block_shape != (1, g) or F.get_format(a.format).packed != F.get_format(b.format).packed:
        raise ValueError(f"a: expected 1×{g} blocks in the family of b ({b.format}), got {a.format} {a.block_shape}")
    ka = K.kernel_operands(a)
    return _launch(ka.values, ka.scales, ka.tensor_scale, None, b, m=m, k=k, g=g, fmt=a.format, a_float=False,
                   config=config)


def nvfp4_tensor_scale(x):
    """The NVFP4 per-tensor scale of ``x`` as `reference.quantize_reference`
    computes it: ``amax / (6 · 448)`` over the finite values (1 if 0), float32 ``[1]``."""
    gmax = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x.astype(jnp.float32)), 0.0))
    return jnp.where(gmax > 0, div(gmax, 6.0 * 448.0), jnp.float32(1.0)).reshape(1)


def fused_quantize_matmul(x, b: QArray, *, format: str, noise=None, config: QMatmulConfig | None = None):
    """float32 ``D(Q(x)) · D(b)`` with ``x [M, K]`` (float) quantized inside the
    kernel's prologue along K in 1×g blocks (``format`` = b's format; round to
    nearest even, or stochastically with ``noise`` uniform ``[0, 1)`` ``[M, K]``
    float32: the noise `stellax.quantize` draws is ``jax.random.uniform(key, x.shape)``)."""
    fmt = F.get_format(format)
    if x.ndim != 2:
        raise ValueError(f"x: expected [M, K], got shape {tuple(x.shape)}")
    m, k = x.shape
    g = _check_b(b, k)
    if fmt.name != b.format:
        raise ValueError(f"format: expected b's format {b.format}, got {fmt.name}")
    if noise is not None and tuple(noise.shape) != (m, k):
        raise ValueError(f"noise: expected shape {(m, k)}, got {tuple(noise.shape)}")
    ts = nvfp4_tensor_scale(x) if fmt.tensor_scale else None
    nz = None if noise is None else noise.astype(jnp.float32)
    return _launch(x, None, ts, nz, b, m=m, k=k, g=g, fmt=fmt.name, a_float=True, config=config)


# -- the training GEMMs' entry points (a row of training.GEMMS) -------------------------------
def gemm(a: QArray, b: QArray):
    """float32 ``D(a) · D(b)``: `dual_quantized_matmul`."""
    return dual_quantized_matmul(a, b)


def quantize_gemm(x, b: QArray, recipe, key=None):
    """float32 ``D(Q_K(x; SR with key)) · D(b)``: `fused_quantize_matmul`, the noise drawn as
    `stellax.quantize` draws it."""
    noise = None if key is None else jax.random.uniform(key, x.shape, jnp.float32)
    return fused_quantize_matmul(x, b, format=recipe.format, noise=noise)


__all__ = ["default_config", "dual_quantized_matmul", "fused_quantize_matmul", "gemm", "nvfp4_tensor_scale",
           "quantize_gemm"]
