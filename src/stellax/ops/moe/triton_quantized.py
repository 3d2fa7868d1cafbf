"""Pallas Triton kernels of `ragged_dot` with quantized expert weights
(``rhs`` a `QArray` ``[G, K, N]`` quantized along K; see `quantized.py`).

Both kernels run on the grouped-matmul tile schedule of `triton.py`
(`OutputTile`, zero-fill tiles) and decode the codes of ``rhs[g]`` in
registers; no dequantized weight is ever written.

``gmm`` (forward), program ``(t, j)``, K loop in steps of ``bk`` (capped at
the scales' K block, so a step has one scale row ``s``):

    acc += (lhs[rows, k-block] @ (decode(codes[g][k-block, cols]) - zp)) · s[g][k-block, cols]
    out  = act(acc · tensor_scale)

(per-channel scales multiply ``acc`` once after the loop instead). 4-bit codes
are bytes ``[bk/2, bn]``, two K codes per byte.

``gmm_transposed`` (dlhs), program ``(t, i)`` over output K blocks of ``bo``
(≤ the scales' K block: one scale row, varying along the contraction N):

    out[rows, K-block] = Σ_n dz[rows, n-block] @ ((decode(codes[g][K-block, n-block]) - zp) · s)ᵀ
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...core.pallas import dot, dot_nt, iota, operand, output, triton_kernel_call
from ..quant.kernel import decode_codes, decode_packed_pairs, decode_scale, kernel_operands
from ..quant.qarray import QArray
from .activations import kernel_activation_fn
from .configs import GroupedMatmulConfig, effective_block_k
from .schedule import group_bounds, tile_schedule
from .triton import OutputTile, dot_precision, schedule_operands

_FULL = pl.BlockSpec()


def _weight_operands(ops) -> dict:
    """The decoded operands of a quantized rhs by name (``None`` when absent)."""
    return dict(values=operand(ops.values, _FULL), scales=operand(ops.scales, _FULL),
                zero_points=operand(ops.zero_points, _FULL), tensor_scale=operand(ops.tensor_scale, _FULL))


def _tensor_scaled(acc, tensor_scale):
    """``acc`` times the NVFP4 tensor scale (unchanged without one)."""
    if tensor_scale is None:
        return acc
    return acc * pltriton.load(tensor_scale.at[pl.ds(0, 1)]).reshape(1, 1)


def _load_row(ref, group, row, cols, col_ok):
    """``ref[group, row:row+1, cols]`` ``[1, width]`` (scales or zero points), 0 past the columns."""
    return pltriton.load(ref.at[group, pl.ds(row, 1), cols], mask=col_ok[None, :], other=jnp.zeros((), ref.dtype))


def _decoded_product(a, values, zero_points, tile: OutputTile, k0, zp_row, *, bk, k_dim, fmt, packed,
                     compute_dtype, precision):
    """``a [bm, bk] @ (decode(codes[g][k0:k0+bk, cols]) - zp)`` float32 (``zp_row``: the step's scale row)."""
    zp = _load_row(zero_points, tile.group, zp_row, tile.col_block, tile.col_ok).astype(jnp.float32) \
        if zero_points is not None else None
    if packed:  # bytes [bk/2, bn], two K codes per byte
        kb_ok = k0 // 2 + iota(bk // 2) < (k_dim + 1) // 2
        codes = pltriton.load(values.at[tile.group, pl.ds(k0 // 2, bk // 2), tile.col_block],
                              mask=kb_ok[:, None] & tile.col_ok[None, :], other=jnp.zeros((), values.dtype))
        w = decode_packed_pairs(codes.T, fmt)  # [bn, bk], K in element order
        if zp is not None:
            w = w - zp.T
        return dot_nt(a, w.astype(compute_dtype), precision=precision)
    k_ok = k0 + iota(bk) < k_dim
    codes = pltriton.load(values.at[tile.group, pl.ds(k0, bk), tile.col_block],
                          mask=k_ok[:, None] & tile.col_ok[None, :], other=jnp.zeros((), values.dtype))
    w = decode_codes(codes, fmt)
    if zp is not None:
        w = w - zp
    return dot(a, w.astype(compute_dtype), precision=precision)


def _gmm_kernel(*, tile_group, tile_start, tile_rows, lhs, values, scales, zero_points, tensor_scale, out, bm, bn,
                bk, k_dim, n_dim, fmt, packed, in_loop, group_k, activation, compute_dtype, precision):
    """Program ``(t, j)``: ``out = act(Σ_k (lhs @ decoded rhs[g]) · s · tensor_scale)`` (module doc)."""
    tile = OutputTile.of(tile_group, tile_start, tile_rows, bm=bm, width=bn, n_cols=n_dim)

    @pl.when((tile.rows > 0) & (tile.group >= 0))
    def _compute():
        def step(kb, acc):
            k0 = kb * bk
            k_ok = k0 + iota(bk) < k_dim
            a = pltriton.load(lhs.at[tile.row_block, pl.ds(k0, bk)], mask=tile.row_ok[:, None] & k_ok[None, :],
                              other=0.0).astype(compute_dtype)
            sb = k0 // group_k if in_loop else 0
            part = _decoded_product(a, values, zero_points, tile, k0, sb, bk=bk, k_dim=k_dim, fmt=fmt,
                                    packed=packed, compute_dtype=compute_dtype, precision=precision)
            if in_loop:
                part = part * decode_scale(_load_row(scales, tile.group, sb, tile.col_block, tile.col_ok))
            return acc + part

        acc = jax.lax.fori_loop(0, pl.cdiv(k_dim, bk), step, jnp.zeros((bm, bn), jnp.float32))
        if not in_loop:
            acc = acc * decode_scale(_load_row(scales, tile.group, 0, tile.col_block, tile.col_ok))
        y = kernel_activation_fn(activation)(_tensor_scaled(acc, tensor_scale))
        pltriton.store(out.at[tile.row_block, tile.col_block], y.astype(out.dtype), mask=tile.out_mask)

    @pl.when((tile.rows > 0) & (tile.group < 0))
    def _zero_fill():
        pltriton.store(out.at[tile.row_block, tile.col_block], jnp.zeros((bm, bn), out.dtype), mask=tile.out_mask)


def gmm(lhs, rhs: QArray, group_sizes, group_offset, *, activation, precision, out_dtype, k_block,
        config: GroupedMatmulConfig):
    """``lhs [M, K]`` → ``act(lhs @ dequantize(rhs[g]))`` ``[M, N]`` per group, zeros outside the
    local groups; ``activation`` must be None or fusable; ``k_block``: the scales' K block
    (None per channel)."""
    m, k = lhs.shape
    num_local, _, n = rhs.shape
    ops = kernel_operands(rhs)
    bm, bn = config.block_m, config.block_n
    bk = effective_block_k(config, k_block)
    sched = tile_schedule(group_bounds(group_sizes, group_offset, num_local, m), m, bm, fill=True)
    kernel = functools.partial(
        _gmm_kernel, bm=bm, bn=bn, bk=bk, k_dim=k, n_dim=n, fmt=rhs.format, packed=ops.packed,
        in_loop=k_block is not None, group_k=k_block or k, activation=activation, compute_dtype=lhs.dtype,
        precision=dot_precision(precision, lhs.dtype))
    return triton_kernel_call(
        kernel, grid=(sched.max_tiles, pl.cdiv(n, bn)),
        inputs=dict(**schedule_operands(sched), lhs=operand(lhs, _FULL), **_weight_operands(ops)),
        outputs=dict(out=output((m, n), out_dtype, _FULL)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_ragged_dot_quantized",
    ).out


def _transposed_weight(values, scales, zero_points, tile: OutputTile, c0, c_ok, sb, *, bo, bc, k_dim, fmt,
                       packed):
    """The decoded, scaled weight tile ``[bc, bo]`` (packed) or ``[bo, bc]`` of ``rhs[g]``
    for output K columns ``tile.col_block`` and contraction columns ``[c0, c0 + bc)``."""
    cols = pl.ds(c0, bc)
    s = decode_scale(_load_row(scales, tile.group, sb, cols, c_ok))  # [1, bc]
    zp = _load_row(zero_points, tile.group, sb, cols, c_ok).astype(jnp.float32) if zero_points is not None else None
    if packed:  # bytes [bo/2, bc] → [bc, bo]
        kb_ok = tile.col0 // 2 + iota(bo // 2) < (k_dim + 1) // 2
        codes = pltriton.load(values.at[tile.group, pl.ds(tile.col0 // 2, bo // 2), cols],
                              mask=kb_ok[:, None] & c_ok[None, :], other=jnp.zeros((), values.dtype))
        w = decode_packed_pairs(codes.T, fmt)
        return (w if zp is None else w - zp.T) * s.T
    codes = pltriton.load(values.at[tile.group, tile.col_block, cols], mask=tile.col_ok[:, None] & c_ok[None, :],
                          other=jnp.zeros((), values.dtype))
    w = decode_codes(codes, fmt)
    return (w if zp is None else w - zp) * s


def _gmm_transposed_kernel(*, tile_group, tile_start, tile_rows, dz, values, scales, zero_points, tensor_scale, out,
                           bm, bo, bc, k_dim, n_dim, fmt, packed, group_k, compute_dtype, precision):
    """dlhs, program ``(t, i)``: ``out[rows, K-block] = dz[rows, :] @ W[g][K-block, :]ᵀ`` with ``W``
    decoded in registers. The output K block (``bo`` ≤ the scales' K block) has one
    scale row, which varies along the contraction (N), so the scales multiply
    the decoded weight tile before the dot."""
    tile = OutputTile.of(tile_group, tile_start, tile_rows, bm=bm, width=bo, n_cols=k_dim)  # columns: K
    sb = tile.col0 // group_k

    @pl.when((tile.rows > 0) & (tile.group >= 0))
    def _compute():
        def step(cb, acc):
            c0 = cb * bc
            c_ok = c0 + iota(bc) < n_dim
            a = pltriton.load(dz.at[tile.row_block, pl.ds(c0, bc)], mask=tile.row_ok[:, None] & c_ok[None, :],
                              other=0.0).astype(compute_dtype)
            w = _transposed_weight(values, scales, zero_points, tile, c0, c_ok, sb, bo=bo, bc=bc, k_dim=k_dim,
                                   fmt=fmt, packed=packed).astype(compute_dtype)
            return acc + (dot(a, w, precision=precision) if packed else dot_nt(a, w, precision=precision))

        acc = jax.lax.fori_loop(0, pl.cdiv(n_dim, bc), step, jnp.zeros((bm, bo), jnp.float32))
        acc = _tensor_scaled(acc, tensor_scale)
        pltriton.store(out.at[tile.row_block, tile.col_block], acc.astype(out.dtype), mask=tile.out_mask)

    @pl.when((tile.rows > 0) & (tile.group < 0))
    def _zero_fill():
        pltriton.store(out.at[tile.row_block, tile.col_block], jnp.zeros((bm, bo), out.dtype), mask=tile.out_mask)


def gmm_transposed(dz, rhs: QArray, group_sizes, group_offset, *, precision, out_dtype, k_block,
                   config: GroupedMatmulConfig):
    """``dlhs [M, K]``: ``dz [M, N] @ dequantize(rhs[g])ᵀ`` per group (zeros outside).
    Output K blocks of ``min(block_n, K block)``, contraction steps of ``block_k``."""
    m, n = dz.shape
    num_local, k, _ = rhs.shape
    ops = kernel_operands(rhs)
    bm, bc = config.block_m, config.block_k
    bo = config.block_n if k_block is None else min(config.block_n, k_block)
    sched = tile_schedule(group_bounds(group_sizes, group_offset, num_local, m), m, bm, fill=True)
    kernel = functools.partial(
        _gmm_transposed_kernel, bm=bm, bo=bo, bc=bc, k_dim=k, n_dim=n, fmt=rhs.format, packed=ops.packed,
        group_k=k_block or k, compute_dtype=dz.dtype, precision=dot_precision(precision, dz.dtype))
    return triton_kernel_call(
        kernel, grid=(sched.max_tiles, pl.cdiv(k, bo)),
        inputs=dict(**schedule_operands(sched), dz=operand(dz, _FULL), **_weight_operands(ops)),
        outputs=dict(out=output((m, k), out_dtype, _FULL)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_ragged_dot_quantized_dlhs",
    ).out
