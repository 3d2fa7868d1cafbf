"""Grouped matmuls in plain XLA: a loop over group-aligned row tiles.

``jax.lax.ragged_dot`` on the CPU expands ``lhs`` to ``[G, M, K]`` masked
copies and runs G dense matmuls (G× the FLOPs). Here the rows are cut into
tiles of ``block_m`` rows that each belong to one group (`schedule.py`); a
``fori_loop`` with a *device-computed trip count* runs one dense
``[block_m, K] @ [K, N]`` matmul per real tile, so empty groups cost nothing
and the work is ``sum(group_sizes) + (< block_m per group)`` rows.

Forward, per tile (rows ``[s, s + block_m)`` of group ``g``):

    out[s : s + block_m] = epilogue(lhs[s : s + block_m] @ rhs[g])

Tiles run in row order, so the rows a partial tile writes past its group are
rewritten by the next tile; rows outside the local groups are zeroed at the
end. ``tgmm`` accumulates ``lhs_tile^T @ rhs_tile`` (rows outside the group
masked) into ``out[g]`` in float32.

The quantized grouped matmul's loop is in `xla_quantized.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .activations import activation_fn
from .schedule import group_bounds, tile_schedule


def accumulator_dot(a, b, contracting, precision):
    return jax.lax.dot_general(a, b, (contracting, ((), ())), precision=precision,
                               preferred_element_type=jnp.float32)


def gmm(lhs, rhs, group_sizes, group_offset, *, transpose_rhs: bool, activation, precision, out_dtype,
        save_preactivation: bool, config):
    """``ragged_dot`` forward: ``(out [M, N], preactivation or None)``, ``config.block_m``
    rows (an `XlaGroupedMatmulConfig`) per step.

    ``rhs``: ``[L, K, N]``, ``[L, K, 2, N]`` (gated: ``act(gate) * up``) or,
    with ``transpose_rhs``, ``[L, N, K]``. The pre-activation (``[M, N]`` or
    ``[M, 2, N]``) is returned in ``out_dtype`` when requested.
    """
    m, _ = lhs.shape
    block_m = config.block_m
    gated = rhs.ndim == 4
    num_local = rhs.shape[0]
    if gated:
        n = rhs.shape[-1]
        rhs = rhs.reshape(num_local, rhs.shape[1], 2 * n)
    n_total = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    n_out = n_total // 2 if gated else n_total
    contracting = ((1,), (1,)) if transpose_rhs else ((1,), (0,))
    act = activation_fn(activation)

    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    sched = tile_schedule(bounds, m, block_m, fill=False)
    padded = jnp.pad(lhs, ((0, block_m), (0, 0)))

    def body(t, carry):
        out, pre = carry
        start = sched.start[t]
        tile = jax.lax.dynamic_slice_in_dim(padded, start, block_m, 0)
        weight = jax.lax.dynamic_index_in_dim(rhs, sched.group[t], 0, keepdims=False)
        z = accumulator_dot(tile, weight, contracting, precision)
        y = act(z[:, :n_out]) * z[:, n_out:] if gated else act(z)
        out = jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), start, 0)
        if pre is not None:
            pre = jax.lax.dynamic_update_slice_in_dim(pre, z.astype(pre.dtype), start, 0)
        return out, pre

    out = jnp.zeros((m + block_m, n_out), out_dtype)
    pre = jnp.zeros((m + block_m, n_total), out_dtype) if save_preactivation else None
    out, pre = jax.lax.fori_loop(0, sched.count, body, (out, pre))
    rows = jnp.arange(m)[:, None]
    inside = (rows >= bounds.begin) & (rows < bounds.end)
    out = jnp.where(inside, out[:m], 0).astype(out_dtype)
    if pre is not None:
        pre = jnp.where(inside, pre[:m], 0).astype(out_dtype)
        if gated:
            pre = pre.reshape(m, 2, n_out)
    return out, pre


def tgmm(lhs, rhs, group_sizes, group_offset, *, num_local: int, transpose_lhs: bool, precision, out_dtype,
         config):
    """``out[g] = lhs_rows[rows of g]^T @ rhs[rows of g]`` → ``[L, K, N]``.

    ``lhs`` is ``[K, M]`` (or ``[M, K]`` with ``transpose_lhs``), ``rhs [M, N]``;
    ``config.block_m`` rows per step.
    """
    block_m = config.block_m
    a = lhs if transpose_lhs else lhs.T
    m, k = a.shape
    n = rhs.shape[1]
    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    sched = tile_schedule(bounds, m, block_m, fill=False)
    a = jnp.pad(a, ((0, block_m), (0, 0)))
    b = jnp.pad(rhs, ((0, block_m), (0, 0)))
    inside = jnp.arange(block_m)[:, None]

    def body(t, out):
        start, g = sched.start[t], sched.group[t]
        keep = inside < sched.rows[t]
        a_tile = jnp.where(keep, jax.lax.dynamic_slice_in_dim(a, start, block_m, 0), 0)
        b_tile = jnp.where(keep, jax.lax.dynamic_slice_in_dim(b, start, block_m, 0), 0)
        partial = accumulator_dot(a_tile, b_tile, ((0,), (0,)), precision)
        current = jax.lax.dynamic_index_in_dim(out, g, 0, keepdims=True)
        return jax.lax.dynamic_update_index_in_dim(out, current + partial[None], g, 0)

    out = jax.lax.fori_loop(0, sched.count, body, jnp.zeros((num_local, k, n), jnp.float32))
    return out.astype(out_dtype)

