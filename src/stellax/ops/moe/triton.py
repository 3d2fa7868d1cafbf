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

from ...core.pallas import triton_call
from .activations import activation_fn, fusable_in_kernel, kernel_activation_fn
from .checks import kernel_precision
from .configs import GroupedMatmulConfig
from .schedule import group_bounds, tile_schedule


def _iota(n: int):
    return jax.lax.broadcasted_iota(jnp.int32, (n,), 0)


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
    def of(cls, group_ref, start_ref, rows_ref, *, bm: int, width: int, n_cols: int) -> "OutputTile":
        t, j = pl.program_id(0), pl.program_id(1)
        group, start, rows = group_ref[t], start_ref[t], rows_ref[t]
        row_ok = _iota(bm) < rows
        col0 = j * width
        col_ok = col0 + _iota(width) < n_cols
        return cls(group, rows, row_ok, col0, col_ok, row_ok[:, None] & col_ok[None, :], pl.ds(start, bm),
                   pl.ds(col0, width))


def _dot(a, b, contracting, precision):
    return jax.lax.dot_general(a, b, (contracting, ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def _epilogue(accs, *, activation, gated: bool):
    """Float32 accumulators → the output tile (before the cast).

    The place for dequantization scales of quantized operands: they scale
    ``accs`` here, before the activation."""
    act = kernel_activation_fn(activation)
    if gated:
        return act(accs[0]) * accs[1]
    return act(accs[0])


def _gmm_kernel(group_ref, start_ref, rows_ref, lhs_ref, rhs_ref, *out_refs, bm, bn, bk, k_dim, n_dim,
                transpose_rhs, gated, activation, write_out, write_pre, precision):
    out_ref = out_refs[0] if write_out else None
    pre_ref = out_refs[-1] if write_pre else None
    group, rows, row_ok, col0, col_ok, out_mask, row_block, col_block = OutputTile.of(
        group_ref, start_ref, rows_ref, bm=bm, width=bn, n_cols=n_dim)
    k_steps = pl.cdiv(k_dim, bk)
    mask_k = k_dim % bk != 0

    @pl.when((rows > 0) & (group >= 0))
    def _compute():
        def step(kb, accs):
            k0 = kb * bk
            k_ok = (k0 + _iota(bk) < k_dim) if mask_k else jnp.ones((bk,), jnp.bool_)
            a = pltriton.load(lhs_ref.at[row_block, pl.ds(k0, bk)], mask=row_ok[:, None] & k_ok[None, :],
                              other=0.0)
            if transpose_rhs:
                b = pltriton.load(rhs_ref.at[group, col_block, pl.ds(k0, bk)],
                                  mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                return (accs[0] + _dot(a, b, ((1,), (1,)), precision),)
            b_mask = k_ok[:, None] & col_ok[None, :]
            if gated:  # rhs viewed as [G, K, 2N]: gate columns, then up columns
                gate = pltriton.load(rhs_ref.at[group, pl.ds(k0, bk), col_block], mask=b_mask, other=0.0)
                up = pltriton.load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(n_dim + col0, bn)], mask=b_mask,
                                   other=0.0)
                return (accs[0] + _dot(a, gate, ((1,), (0,)), precision),
                        accs[1] + _dot(a, up, ((1,), (0,)), precision))
            b = pltriton.load(rhs_ref.at[group, pl.ds(k0, bk), col_block], mask=b_mask, other=0.0)
            return (accs[0] + _dot(a, b, ((1,), (0,)), precision),)

        init = tuple(jnp.zeros((bm, bn), jnp.float32) for _ in range(2 if gated else 1))
        accs = jax.lax.fori_loop(0, k_steps, step, init)
        if write_out:
            y = _epilogue(accs, activation=activation, gated=gated)
            pltriton.store(out_ref.at[row_block, col_block], y.astype(out_ref.dtype), mask=out_mask)
        if write_pre:
            for half, acc in enumerate(accs):  # pre-activation [M, N] or [M, 2N]
                pltriton.store(pre_ref.at[row_block, pl.ds(half * n_dim + col0, bn)], acc.astype(pre_ref.dtype),
                               mask=out_mask)

    @pl.when((rows > 0) & (group < 0))
    def _zero_fill():
        if write_out:
            pltriton.store(out_ref.at[row_block, col_block], jnp.zeros((bm, bn), out_ref.dtype), mask=out_mask)
        if write_pre:
            for half in range(2 if gated else 1):
                pltriton.store(pre_ref.at[row_block, pl.ds(half * n_dim + col0, bn)],
                               jnp.zeros((bm, bn), pre_ref.dtype), mask=out_mask)


def gmm(lhs, rhs, group_sizes, group_offset, *, transpose_rhs: bool, activation, precision, out_dtype,
        save_preactivation: bool, config: GroupedMatmulConfig):
    """Same contract as `xla.gmm`: ``(out [M, N], preactivation or None)``.

    A callable activation is not traced into the kernel: the kernel writes the
    pre-activation and XLA applies the activation (rows outside the local
    groups stay zero)."""
    m, k = lhs.shape
    gated = rhs.ndim == 4
    num_local = rhs.shape[0]
    precision = kernel_precision(precision, lhs.dtype)
    n_dim = rhs.shape[1] if transpose_rhs else rhs.shape[-1]
    fused = fusable_in_kernel(activation)
    write_pre = save_preactivation or not fused
    bm, bn, bk = config.block_m, config.block_n, config.block_k

    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    sched = tile_schedule(bounds, m, bm, fill=True)
    pre_shape = (m, 2 * n_dim) if gated else (m, n_dim)
    if gated:
        rhs = rhs.reshape(num_local, k, 2 * n_dim)
    out_shape = []
    if fused:
        out_shape.append(jax.ShapeDtypeStruct((m, n_dim), out_dtype))
    if write_pre:
        out_shape.append(jax.ShapeDtypeStruct(pre_shape, out_dtype))
    kernel = functools.partial(
        _gmm_kernel, bm=bm, bn=bn, bk=bk, k_dim=k, n_dim=n_dim, transpose_rhs=transpose_rhs, gated=gated,
        activation=activation if fused else None, write_out=fused, write_pre=write_pre, precision=precision)
    full = pl.BlockSpec()
    outs = triton_call(
        kernel, out_shape=out_shape, grid=(sched.max_tiles, pl.cdiv(n_dim, bn)), in_specs=[full] * 5,
        out_specs=[full] * len(out_shape), num_warps=config.num_warps, num_stages=config.num_stages,
        name="stellax_ragged_dot",
    )(sched.group, sched.start, sched.rows, lhs, rhs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    pre = outs[-1].reshape((m, 2, n_dim) if gated else (m, n_dim)) if write_pre else None
    if fused:
        out = outs[0]
    else:
        z = pre.astype(jnp.float32)
        act = activation_fn(activation)
        y = act(z[:, 0]) * z[:, 1] if gated else act(z)
        rows = jnp.arange(m)[:, None]
        out = jnp.where((rows >= bounds.begin) & (rows < bounds.end), y, 0.0).astype(out_dtype)
    return out, (pre if save_preactivation else None)


def _tgmm_kernel(start_ref, size_ref, lhs_ref, rhs_ref, out_ref, *, bm, bk, bn, k_dim, n_dim, transpose_lhs,
                 precision):
    g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    start, size = start_ref[g], size_ref[g]
    k0, n0 = i * bk, j * bn
    k_ok = k0 + _iota(bk) < k_dim
    n_ok = n0 + _iota(bn) < n_dim

    def step(s, acc):
        r0 = start + s * bm
        r_ok = s * bm + _iota(bm) < size
        if transpose_lhs:  # lhs [M, K]
            a = pltriton.load(lhs_ref.at[pl.ds(r0, bm), pl.ds(k0, bk)], mask=r_ok[:, None] & k_ok[None, :],
                              other=0.0)
            contract_a = 0
        else:  # lhs [K, M]
            a = pltriton.load(lhs_ref.at[pl.ds(k0, bk), pl.ds(r0, bm)], mask=k_ok[:, None] & r_ok[None, :],
                              other=0.0)
            contract_a = 1
        b = pltriton.load(rhs_ref.at[pl.ds(r0, bm), pl.ds(n0, bn)], mask=r_ok[:, None] & n_ok[None, :],
                          other=0.0)
        return acc + _dot(a, b, ((contract_a,), (0,)), precision)

    acc = jax.lax.fori_loop(0, (size + bm - 1) // bm, step, jnp.zeros((bk, bn), jnp.float32))
    pltriton.store(out_ref.at[g, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
                   mask=k_ok[:, None] & n_ok[None, :])


def tgmm(lhs, rhs, group_sizes, group_offset, *, num_local: int, transpose_lhs: bool, precision, out_dtype,
         config: GroupedMatmulConfig):
    """Same contract as `xla.tgmm`: ``[L, K, N]``."""
    if transpose_lhs:
        m, k = lhs.shape
    else:
        k, m = lhs.shape
    n = rhs.shape[1]
    precision = kernel_precision(precision, lhs.dtype)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    kernel = functools.partial(_tgmm_kernel, bm=bm, bk=bk, bn=bn, k_dim=k, n_dim=n, transpose_lhs=transpose_lhs,
                               precision=precision)
    full = pl.BlockSpec()
    return triton_call(
        kernel, out_shape=jax.ShapeDtypeStruct((num_local, k, n), out_dtype),
        grid=(num_local, pl.cdiv(k, bk), pl.cdiv(n, bn)), in_specs=[full] * 4, out_specs=full,
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_ragged_dot_tgmm",
    )(bounds.starts, bounds.sizes, lhs, rhs)
