"""Pallas Triton grouped-matmul kernels: ``gmm`` (forward and dlhs) and ``tgmm`` (drhs).

``gmm`` — grid ``(T_max, ceil(N / block_n))`` over the group-aware tile
schedule (`schedule.tile_schedule` with zero-fill tiles): program ``(t, j)``
owns rows ``[start_t, start_t + rows_t)`` of one group ``g_t`` and columns
``[j·block_n, (j+1)·block_n)``:

    acc  = Σ_k lhs[rows, k-block] @ rhs[g_t][k-block, cols]     (float32)
    out  = epilogue(acc)            act(acc), or act(acc_gate) * acc_up

Tiles start at their group's first row, so a tile never mixes groups; its
rows past the group end are masked on load and store. Zero-fill tiles
(``g_t = -1``) write zeros to the rows before/after the local groups (other
experts' rows, rows past ``sum(group_sizes)``), so every output element is
written exactly once (checked by the NaN-poisoned outputs in interpret mode).
Programs past the real tile count return at once; an empty group has no tile.
With ``transpose_rhs`` the weights are ``[G, N, K]`` (``dlhs = dy @ rhs^T``). A gated
``rhs [G, K, 2, N]`` is read as ``[G, K, 2N]`` (gate columns, then up columns).

``tgmm`` — grid ``(L, ceil(K / block_k), ceil(N / block_n))``; program
``(g, i, j)`` loops over the group's rows in steps of ``block_m`` (a loop
with a device-computed trip count: an empty group runs no step and writes
zeros):

    out[g][k-block, n-block] = Σ_rows lhs[rows, k-block]^T @ rhs[rows, n-block]

Quantized expert weights (`QArray` rhs) have their own kernels in
`quantized.py` (decoding and blocked scales in the K loop). `_epilogue` remains
the place for per-row / per-column scales of a future quantized operand.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...core.pallas import dot, dot_nt, dot_tn, iota, operand, output, triton_kernel_call, triton_precision
from .activations import activation_fn, fusable_in_kernel, kernel_activation_fn
from .configs import GroupedMatmulConfig
from .schedule import group_bounds, tile_schedule

#: Operands the kernels index themselves (masked loads at schedule offsets).
_FULL = pl.BlockSpec()


def dot_precision(precision, dtype):
    """The in-kernel precision of a resolved ``precision`` (`stellax.core.precision`) for
    operands of ``dtype``: float32 as `triton_precision` says (one TF32 pass at
    ``DEFAULT``, three otherwise); narrower operands at the tensor core's native precision."""
    return triton_precision(precision) if jnp.dtype(dtype) == jnp.float32 else None


class OutputTile(NamedTuple):
    """Program ``(t, j)``'s output tile of a grouped matmul: ``rows`` valid rows
    (``bm`` at most) of ``group`` from row ``start`` (the tile schedule), and
    ``width`` columns from ``col0`` of ``n_cols``; masks and slices for loads
    and stores. ``group < 0`` or ``rows == 0``: a tile that only zero-fills."""

    group: jax.Array
    rows: jax.Array
    row_ok: jax.Array
    col0: jax.Array
    col_ok: jax.Array
    out_mask: jax.Array
    row_block: pl.Slice
    col_block: pl.Slice

    @classmethod
    def of(cls, tile_group, tile_start, tile_rows, *, bm: int, width: int, n_cols: int) -> "OutputTile":
        """The tile of program ``(t, j)`` from the schedule refs ``tile_group/start/rows [T_max]``."""
        t, j = pl.program_id(0), pl.program_id(1)
        group, start, rows = tile_group[t], tile_start[t], tile_rows[t]
        row_ok = iota(bm) < rows
        col0 = j * width
        col_ok = col0 + iota(width) < n_cols
        return cls(group, rows, row_ok, col0, col_ok, row_ok[:, None] & col_ok[None, :], pl.ds(start, bm),
                   pl.ds(col0, width))


def schedule_operands(sched) -> dict:
    """The tile schedule as named kernel operands ``tile_group/tile_start/tile_rows [T_max]``."""
    return dict(tile_group=operand(sched.group, _FULL), tile_start=operand(sched.start, _FULL),
                tile_rows=operand(sched.rows, _FULL))


def _epilogue(accs, *, activation, gated: bool):
    """Float32 accumulators → the output tile (before the cast).

    The place for dequantization scales of quantized operands: they scale
    ``accs`` here, before the activation."""
    act = kernel_activation_fn(activation)
    if gated:
        return act(accs[0]) * accs[1]
    return act(accs[0])


def _gmm_products(lhs, rhs, tile: OutputTile, *, bm, bn, bk, k_dim, n_dim, transpose_rhs, gated, precision):
    """``Σ_k lhs[rows, k-block] @ rhs[g][k-block, cols]`` float32 (two for a gated rhs)."""
    mask_k = k_dim % bk != 0

    def step(kb, accs):
        k0 = kb * bk
        k_ok = (k0 + iota(bk) < k_dim) if mask_k else jnp.ones((bk,), jnp.bool_)
        a = pltriton.load(lhs.at[tile.row_block, pl.ds(k0, bk)], mask=tile.row_ok[:, None] & k_ok[None, :],
                          other=0.0)
        if transpose_rhs:
            b = pltriton.load(rhs.at[tile.group, tile.col_block, pl.ds(k0, bk)],
                              mask=tile.col_ok[:, None] & k_ok[None, :], other=0.0)
            return (accs[0] + dot_nt(a, b, precision=precision),)
        b_mask = k_ok[:, None] & tile.col_ok[None, :]
        if gated:  # rhs viewed as [G, K, 2N]: gate columns, then up columns
            gate = pltriton.load(rhs.at[tile.group, pl.ds(k0, bk), tile.col_block], mask=b_mask, other=0.0)
            up = pltriton.load(rhs.at[tile.group, pl.ds(k0, bk), pl.ds(n_dim + tile.col0, bn)], mask=b_mask,
                               other=0.0)
            return (accs[0] + dot(a, gate, precision=precision), accs[1] + dot(a, up, precision=precision))
        b = pltriton.load(rhs.at[tile.group, pl.ds(k0, bk), tile.col_block], mask=b_mask, other=0.0)
        return (accs[0] + dot(a, b, precision=precision),)

    init = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(2 if gated else 1))
    return jax.lax.fori_loop(0, pl.cdiv(k_dim, bk), step, init)


def _gmm_kernel(*, tile_group, tile_start, tile_rows, lhs, rhs, out, pre, bm, bn, bk, k_dim, n_dim, transpose_rhs,
                gated, activation, precision):
    """Program ``(t, j)``: ``out = epilogue(acc)`` and/or the pre-activation ``pre``
    (``None`` when not written) of one schedule tile; zero-fill tiles write zeros."""
    tile = OutputTile.of(tile_group, tile_start, tile_rows, bm=bm, width=bn, n_cols=n_dim)
    halves = 2 if gated else 1

    def store_pre(values):  # pre-activation [M, N] or [M, 2N]
        for half, value in enumerate(values):
            pltriton.store(pre.at[tile.row_block, pl.ds(half * n_dim + tile.col0, bn)], value.astype(pre.dtype),
                           mask=tile.out_mask)

    @pl.when((tile.rows > 0) & (tile.group >= 0))
    def _compute():
        accs = _gmm_products(lhs, rhs, tile, bm=bm, bn=bn, bk=bk, k_dim=k_dim, n_dim=n_dim,
                             transpose_rhs=transpose_rhs, gated=gated, precision=precision)
        if out is not None:
            y = _epilogue(accs, activation=activation, gated=gated)
            pltriton.store(out.at[tile.row_block, tile.col_block], y.astype(out.dtype), mask=tile.out_mask)
        if pre is not None:
            store_pre(accs)

    @pl.when((tile.rows > 0) & (tile.group < 0))
    def _zero_fill():
        if out is not None:
            pltriton.store(out.at[tile.row_block, tile.col_block], jnp.zeros((bm, bn), out.dtype),
                           mask=tile.out_mask)
        if pre is not None:
            store_pre([jnp.zeros((bm, bn), pre.dtype)] * halves)


def gmm(lhs, rhs, group_sizes, group_offset, *, transpose_rhs: bool, activation, precision, out_dtype,
        save_preactivation: bool, config: GroupedMatmulConfig):
    """Same contract as `xla.gmm`: ``lhs [M, K]``, ``rhs [G, K, N]`` (``[G, N, K]``
    transposed, ``[G, K, 2, N]`` gated) → ``(out [M, N], preactivation or None)``.

    A callable activation is not traced into the kernel: the kernel writes the
    pre-activation and XLA applies the activation (rows outside the local
    groups stay zero)."""
    m, k = lhs.shape
    gated = rhs.ndim == 4
    num_local = rhs.shape[0]
    precision = dot_precision(precision, lhs.dtype)
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[-1]
    fused = fusable_in_kernel(activation)
    write_pre = save_preactivation or not fused
    bm, bn, bk = config.block_m, config.block_n, config.block_k

    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    sched = tile_schedule(bounds, m, bm, fill=True)
    pre_shape = (m, 2 * n_dim) if gated else (m, n_dim)
    if gated:
        rhs = rhs.reshape(num_local, k, 2 * n_dim)
    kernel = functools.partial(
        _gmm_kernel, bm=bm, bn=bn, bk=bk, k_dim=k, n_dim=n_dim, transpose_rhs=transpose_rhs, gated=gated,
        activation=activation if fused else None, precision=precision)
    outs = triton_kernel_call(
        kernel, grid=(sched.max_tiles, pl.cdiv(n_dim, bn)),
        inputs=dict(**schedule_operands(sched), lhs=operand(lhs, _FULL), rhs=operand(rhs, _FULL)),
        outputs=dict(out=output((m, n_dim), out_dtype, _FULL) if fused else None,
                     pre=output(pre_shape, out_dtype, _FULL) if write_pre else None),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_ragged_dot",
    )
    pre = outs.pre.reshape((m, 2, n_dim) if gated else (m, n_dim)) if write_pre else None
    if fused:
        out = outs.out
    else:
        z = pre.astype(jnp.float32)
        act = activation_fn(activation)
        y = act(z[:, 0]) * z[:, 1] if gated else act(z)
        rows = jnp.arange(m)[:, None]
        out = jnp.where((rows >= bounds.begin) & (rows < bounds.end), y, 0.0).astype(out_dtype)
    return out, (pre if save_preactivation else None)


def _tgmm_kernel(*, group_start, group_size, lhs, rhs, out, bm, bk, bn, k_dim, n_dim, transpose_lhs, precision):
    """Program ``(g, i, j)``: ``out[g][k-block, n-block] = Σ_rows lhs[rows, k-block]ᵀ @ rhs[rows, n-block]``
    over the ``group_size[g]`` rows from ``group_start[g]`` (zeros for an empty group)."""
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = group_start[g], group_size[g]
    k0, n0 = i * bk, j * bn
    k_ok = k0 + iota(bk) < k_dim
    n_ok = n0 + iota(bn) < n_dim

    def step(s, acc):
        r0 = start + s * bm
        r_ok = s * bm + iota(bm) < size
        if transpose_lhs:  # lhs [M, K]: contract its rows
            a = pltriton.load(lhs.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=r_ok[:, None] & k_ok[None, :],
                              other=0.0)
        else:  # lhs [K, M]
            a = pltriton.load(lhs.at[pl.ds(k0, bk), pl.ds(r0, bm)], mask=k_ok[:, None] & r_ok[None, :],
                              other=0.0)
        b = pltriton.load(rhs.at[pl.ds(r0, bm), pl.ds(n0, bn)], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
        return acc + (dot_tn(a, b, precision=precision) if transpose_lhs else dot(a, b, precision=precision))

    acc = jax.lax.fori_loop(0, (size + bm - 1) // bm, step, jnp.zeros((bk, bn), jnp.float32))
    pltriton.store(out.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out.dtype),
                   mask=k_ok[:, None] & n_ok[None, :])


def tgmm(lhs, rhs, group_sizes, group_offset, *, num_local: int, transpose_lhs: bool, precision, out_dtype,
         config: GroupedMatmulConfig):
    """Same contract as `xla.tgmm`: ``lhs [K, M]`` (``[M, K]`` transposed), ``rhs [M, N]`` → ``[L, K, N]``."""
    if transpose_lhs:
        m, k = lhs.shape
    else:
        k, m = lhs.shape
    n = rhs.shape[1]
    precision = dot_precision(precision, lhs.dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    kernel = functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn, k_dim=k, n_dim=n, transpose_lhs=transpose_lhs,
                               precision=precision)
    return triton_kernel_call(
        kernel, grid=(num_local, pl.cdiv(k, bk), pl.cdiv(n, bn)),
        inputs=dict(group_start=operand(bounds.starts, _FULL), group_size=operand(bounds.sizes, _FULL),
                    lhs=operand(lhs, _FULL), rhs=operand(rhs, _FULL)),
        outputs=dict(out=output((num_local, k, n), out_dtype, _FULL)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_ragged_dot_tgmm",
    ).out
