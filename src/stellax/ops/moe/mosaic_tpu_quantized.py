"""Pallas Mosaic TPU grouped matmul with quantized expert weights
(``rhs`` a `QArray` ``[G, K, N]`` quantized along K; see `quantized.py`).

The schedule is the one of the dense kernel (`mosaic_tpu.py`): aligned row
tiles visited once per group they hold rows of (`tile_visits`, scalar
prefetch), grid ``(N/bn, visits, K/bk)``, a float32 VMEM accumulator over the
K axis, each visit writing its own rows at the last K step, pseudo-group
visits writing zeros without copying operands.

The weights reach VMEM **as codes**: each K step DMAs the code tile of
``rhs[g]`` (``[bk, bn]`` int8 / fp8, or ``[bk/2, bn]`` bytes of two 4-bit codes)
and the step's scale rows, and decodes them in VMEM:

    w    = (decode(codes[g][k-block, cols]) - zp) · s        (blocked scales)
    acc += lhs[tile, k-block] @ w
    out  = act(acc · s_channel · tensor_scale)               (at the last K step)

Per-channel scales (one scale row per expert) multiply the accumulator once
in the epilogue instead of the weight tile. Blocked scales of K block ``kb``
are viewed as ``[G, S', r, N]`` with ``r = bk / kb`` rows per step (``kb < bk``:
the rows are repeated ``kb`` times in VMEM) or ``r = 1`` (``kb ≥ bk``: row
``k·bk // kb``), so a step's scale block always has its full second-minor
dimension. Nothing dequantized is ever written to HBM.

4-bit codes are packed two per byte along K (low nibble = even k). Instead
of interleaving the decoded nibbles in VMEM (a lane shuffle), ``lhs`` is
split into its even and odd K columns outside the kernel (an XLA copy of
the activations, never of the weights), and a step computes
``lhs_even @ w_low + lhs_odd @ w_high``; ``bk`` is then at least 256 so the
two ``[bm, bk/2]`` half tiles keep 128 lanes.

Scales that are stored as 8-bit codes (E8M0 of MXFP4, E4M3 of NVFP4) are
converted to bfloat16 outside the kernel (exactly: both fit bfloat16);
integer zero points to float32; both are ``1/kb`` the size of the weights.
The NVFP4 tensor scale is read from SMEM in the epilogue. fp8 element codes
(``fp8_e4m3``, ``fp8_e5m2``, ``mxfp8_*``) are DMA'd as fp8 and converted in
VMEM, so they need a generation with float8 (TPU7x; `configs.quantized_tpu_requirements`).
Its dlhs (`gmm_transposed`) is the XLA path of `xla_quantized`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import cdiv, mxu_dot, operand, output, pad_axis, tpu_kernel_call
from ..quant import formats as F
from ..quant.kernel import kernel_operands
from ..quant.qarray import QArray
from . import xla_quantized
from .activations import kernel_activation_fn
from .configs import xla_block
from .mosaic_tpu import tile_visits
from .schedule import group_bounds


@dataclasses.dataclass(frozen=True)
class ScaleLayout:
    """How a K step finds its scale rows: ``per_channel`` (one row, applied in
    the epilogue) or blocks of ``kb`` along K with ``rows`` rows per step."""

    per_channel: bool
    kb: int
    rows: int


def scale_layout(k_block: int | None, block_k: int) -> ScaleLayout:
    """`ScaleLayout` of scales with K block ``k_block`` (None per channel) for steps of ``block_k``."""
    if k_block is None:
        return ScaleLayout(True, 0, 1)
    return ScaleLayout(False, k_block, max(1, block_k // k_block))


def _nibbles(codes, fmt: str):
    """4-bit codes (int32 in [0, 16)) → float32 values of ``fmt``."""
    if F.get_format(fmt).element.kind == "int":
        return ((codes ^ 8) - 8).astype(jnp.float32)
    return F.e2m1_decode(codes)


def _expand_rows(s, repeat: int):
    """``s [r, bn]`` → ``[r·repeat, bn]`` (each row repeated ``repeat`` times)."""
    if s.shape[0] == 1:
        return s
    r, bn = s.shape
    return jnp.broadcast_to(s[:, None, :], (r, repeat, bn)).reshape(r * repeat, bn)


def _weight(codes, zp, s, layout: ScaleLayout, repeat: int, compute_dtype):
    """Decoded float32 codes ``[rows, bn]`` minus the zero points, times the blocked scales."""
    w = codes
    if zp is not None:
        w = w - _expand_rows(zp.astype(jnp.float32), repeat)
    if not layout.per_channel:
        w = w * _expand_rows(s.astype(jnp.float32), repeat)
    return w.astype(compute_dtype)


def _qgmm_kernel(visit_group, visit_tile, visit_lo, visit_hi, visit_live, *, lhs, lhs_odd, values, scales,
                 zero_points, tensor_scale, out, acc, bm, fmt, packed, layout, activation, compute_dtype, precision):
    """Grid step ``(j, v, k)``: ``acc += lhs[tile, k] @ decoded rhs[g][k, j]``; at
    the last K step the visit writes its rows of ``out`` (module doc)."""
    v, k = pl.program_id(1), pl.program_id(2)
    group, live = visit_group[v], visit_live[v] > 0

    @pl.when(k == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, acc.dtype)

    @pl.when(live & (group >= 0))
    def _accumulate():
        s = scales[...]
        zp = None if zero_points is None else zero_points[...]
        if packed:  # bytes [bk/2, bn] (int8 view): low nibbles are the even K rows, high the odd ones
            t = values[...].astype(jnp.int32)
            repeat = max(layout.kb // 2, 1)
            w_lo = _weight(_nibbles(t & 0xF, fmt), zp, s, layout, repeat, compute_dtype)
            w_hi = _weight(_nibbles((t >> 4) & 0xF, fmt), zp, s, layout, repeat, compute_dtype)
            acc[...] += mxu_dot(lhs[...], w_lo, precision) + mxu_dot(lhs_odd[...], w_hi, precision)
        else:
            w = _weight(values[...].astype(jnp.float32), zp, s, layout, max(layout.kb, 1), compute_dtype)
            acc[...] += mxu_dot(lhs[...], w, precision)

    @pl.when(live & (k == pl.num_programs(2) - 1))
    def _write():
        rows = visit_tile[v] * bm + jax.lax.broadcasted_iota(jnp.int32, (bm, 1), 0)
        mine = (rows >= visit_lo[v]) & (rows < visit_hi[v])
        y = acc[...]
        if layout.per_channel:
            y = y * scales[...].astype(jnp.float32)
        if tensor_scale is not None:
            y = y * tensor_scale[0]
        y = jnp.where(group >= 0, kernel_activation_fn(activation)(y), 0.0)
        out[...] = jnp.where(mine, y.astype(out.dtype), out[...])


def _scale_operand(array, layout: ScaleLayout, k_steps: int, n_p: int, block_k: int, block_n: int, dtype):
    """``[G, S, N]`` scales (or zero points) as ``[G, S', r, N_p]`` with the step's block spec."""
    a = pad_axis(array, 2, n_p).astype(dtype)
    g = a.shape[0]
    if layout.per_channel or layout.rows == 1:
        view = a.reshape(g, a.shape[1], 1, n_p)
        kb = layout.kb

        def row(kk):
            return 0 if layout.per_channel else (kk * block_k) // kb
    else:
        view = pad_axis(a, 1, k_steps * layout.rows).reshape(g, k_steps, layout.rows, n_p)

        def row(kk):
            return kk
    spec = pl.BlockSpec((None, None, layout.rows, block_n),
                        lambda j, v, kk, gr, *_: (jnp.maximum(gr[v], 0), row(jnp.where(gr[v] >= 0, kk, 0)), 0, j))
    return operand(view, spec)


def gmm(lhs, rhs: QArray, group_sizes, group_offset, *, activation, precision, out_dtype, k_block, config):
    """``lhs [M, K]`` float32/bfloat16 → ``act(lhs @ dequantize(rhs[g]))`` ``[M, N]`` per local
    group, zeros outside them; ``activation`` None or a name; ``k_block`` the scales' K
    block (None per channel). ``config``: a `TpuGroupedMatmulConfig` whose ``block_k``
    is a multiple or a divisor of ``k_block`` (and at least 256 for 4-bit formats)."""
    m, k = lhs.shape
    num_local, _, n = rhs.shape
    ops = kernel_operands(rhs)
    bm, bk, bn = config.block_m, config.block_k, config.block_n
    layout = scale_layout(k_block, bk)
    m_p, k_p, n_p = cdiv(m, bm) * bm, cdiv(k, bk) * bk, cdiv(n, bn) * bn
    k_steps = k_p // bk

    def k_of(v, kk, g):  # pseudo-group visits pin K: no operand copies
        return jnp.where(g[v] >= 0, kk, 0)

    lhs_p = pad_axis(pad_axis(lhs, 0, m_p), 1, k_p)
    if ops.packed:
        half = bk // 2
        lhs_spec = pl.BlockSpec((bm, half), lambda j, v, kk, g, t, *_: (t[v], k_of(v, kk, g)))
        lhs_ops = dict(lhs=operand(lhs_p[:, 0::2], lhs_spec), lhs_odd=operand(lhs_p[:, 1::2], lhs_spec))
        values = jax.lax.bitcast_convert_type(ops.values, jnp.int8)
        values = pad_axis(pad_axis(values, 1, k_p // 2), 2, n_p)
        values_spec = pl.BlockSpec((None, half, bn), lambda j, v, kk, g, *_: (jnp.maximum(g[v], 0),
                                                                               k_of(v, kk, g), j))
    else:
        lhs_spec = pl.BlockSpec((bm, bk), lambda j, v, kk, g, t, *_: (t[v], k_of(v, kk, g)))
        lhs_ops = dict(lhs=operand(lhs_p, lhs_spec), lhs_odd=None)
        values = pad_axis(pad_axis(ops.values, 1, k_p), 2, n_p)
        values_spec = pl.BlockSpec((None, bk, bn), lambda j, v, kk, g, *_: (jnp.maximum(g[v], 0),
                                                                             k_of(v, kk, g), j))
    scale_dtype = jnp.float32 if ops.scales.dtype == jnp.float32 else jnp.bfloat16
    if ops.scales.dtype == jnp.uint8:  # E8M0 codes → bfloat16 (exact)
        scales = F.e8m0_to_float(ops.scales).astype(jnp.bfloat16)
    else:
        scales = ops.scales
    scale_args = (layout, k_steps, n_p, bk, bn)
    zero_points = (None if ops.zero_points is None
                   else _scale_operand(ops.zero_points, *scale_args, jnp.float32))
    tensor_scale = (None if ops.tensor_scale is None
                    else operand(ops.tensor_scale, pl.BlockSpec(memory_space=pltpu.SMEM)))
    visits = tile_visits(group_bounds(group_sizes, group_offset, num_local, m), m_p, bm)
    kernel = functools.partial(
        _qgmm_kernel, bm=bm, fmt=rhs.format, packed=ops.packed, layout=layout, activation=activation,
        compute_dtype=lhs.dtype, precision=precision)
    outs = tpu_kernel_call(
        kernel, grid=(n_p // bn, visits.count, k_steps),  # the real visits only (module doc of mosaic_tpu)
        scalar_prefetch=dict(visit_group=visits.group, visit_tile=visits.tile, visit_lo=visits.lo,
                             visit_hi=visits.hi, visit_live=visits.live),
        inputs=dict(**lhs_ops, values=operand(values, values_spec),
                    scales=_scale_operand(scales, *scale_args, scale_dtype), zero_points=zero_points,
                    tensor_scale=tensor_scale),
        outputs=dict(out=output((m_p, n_p), out_dtype, pl.BlockSpec((bm, bn), lambda j, v, kk, g, t, *_: (t[v], j)))),
        scratch=dict(acc=pltpu.VMEM((bm, bn), jnp.float32)),
        dimension_semantics=("parallel", "arbitrary", "arbitrary"), name="stellax_ragged_dot_quantized_tpu",
    )
    return outs.out[:m, :n]


def gmm_transposed(dz, rhs: QArray, group_sizes, group_offset, *, precision, out_dtype, k_block, config):
    """``dlhs [M, K]``: ``dz [M, N] @ dequantize(rhs[g])ᵀ`` per group (zeros outside), by the XLA
    loop (`xla_quantized.gmm_transposed`) with its default row tile (``config`` is the forward's)."""
    del config
    return xla_quantized.gmm_transposed(dz, rhs, group_sizes, group_offset, precision=precision, out_dtype=out_dtype,
                                        k_block=k_block, config=xla_block(dz.shape[0], rhs.shape[0]))
