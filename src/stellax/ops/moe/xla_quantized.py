"""The quantized grouped matmul in plain XLA (a `QArray` ``rhs [G, K, N]``; see `quantized.py`).

The row-tile loop of `xla.py`; each tile dequantizes only its own expert
``rhs[g]`` (``[K, N]`` in the activation dtype) — never all experts at once.
(The work is repeated per tile of a group: the XLA path is the portable
fallback, not the fast one.) The activation is applied by XLA after the loop.

Entry points (the contract of `triton_quantized` and `mosaic_tpu_quantized`):
`gmm` (the forward, or the pre-activation with ``activation=None``) and
`gmm_transposed` (the dlhs).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..quant.qarray import QArray
from ..quant.reference import dequantize_reference
from .activations import activation_fn
from .schedule import group_bounds, tile_schedule
from .xla import accumulator_dot


def _expert(rhs: QArray, g, dtype):
    """``dequantize(rhs[g])`` ``[K, N]`` in ``dtype`` (``g`` traced)."""
    pick = lambda a: None if a is None else jax.lax.dynamic_index_in_dim(a, g, 0, keepdims=False)  # noqa: E731
    one = QArray(pick(rhs.values), pick(rhs.scales), pick(rhs.zero_points), rhs.tensor_scale, format=rhs.format,
                 shape=rhs.shape[1:], block_shape=rhs.block_shape[1:], axis=0, _validate=False)
    return dequantize_reference(one, dtype)


def gmm_quantized(lhs, rhs: QArray, group_sizes, group_offset, *, transpose: bool, precision, out_dtype,
                  block_m: int):
    """Pre-activation ``z = lhs [M, K] @ dequantize(rhs[g]) [K, N]`` per group (``transpose``:
    ``lhs [M, N] @ dequantize(rhs[g])ᵀ → [M, K]``), zeros outside the local groups."""
    m = lhs.shape[0]
    num_local, k, n = rhs.shape
    width = k if transpose else n
    contracting = ((1,), (1,)) if transpose else ((1,), (0,))
    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    sched = tile_schedule(bounds, m, block_m, fill=False)
    padded = jnp.pad(lhs, ((0, block_m), (0, 0)))

    def body(t, out):
        start = sched.start[t]
        tile = jax.lax.dynamic_slice_in_dim(padded, start, block_m, 0)
        weight = _expert(rhs, sched.group[t], lhs.dtype)
        z = accumulator_dot(tile, weight, contracting, precision)
        return jax.lax.dynamic_update_slice_in_dim(out, z.astype(out.dtype), start, 0)

    out = jax.lax.fori_loop(0, sched.count, body, jnp.zeros((m + block_m, width), out_dtype))
    rows = jnp.arange(m)[:, None]
    return jnp.where((rows >= bounds.begin) & (rows < bounds.end), out[:m], 0).astype(out_dtype)


def activated(z, activation, group_sizes, group_offset, num_local: int, out_dtype):
    """``activation(z)`` in float32 (XLA), zero outside the local groups, in ``out_dtype``;
    ``z`` as is without an activation."""
    if activation is None:
        return z
    m = z.shape[0]
    bounds = group_bounds(group_sizes, group_offset, num_local, m)
    rows = jnp.arange(m)[:, None]
    y = activation_fn(activation)(z.astype(jnp.float32))
    return jnp.where((rows >= bounds.begin) & (rows < bounds.end), y, 0.0).astype(out_dtype)


def gmm(lhs, rhs: QArray, group_sizes, group_offset, *, activation, precision, out_dtype, k_block, config):
    """``act(lhs [M, K] @ dequantize(rhs[g]))`` ``[M, N]`` per group, zeros outside the local
    groups; ``config.block_m`` rows per step (an `XlaGroupedMatmulConfig`; ``k_block`` unused)."""
    del k_block
    z = gmm_quantized(lhs, rhs, group_sizes, group_offset, transpose=False, precision=precision,
                      out_dtype=out_dtype, block_m=config.block_m)
    return activated(z, activation, group_sizes, group_offset, rhs.shape[0], out_dtype)


def gmm_transposed(dz, rhs: QArray, group_sizes, group_offset, *, precision, out_dtype, k_block, config):
    """``dlhs [M, K]``: ``dz [M, N] @ dequantize(rhs[g])ᵀ`` per group (zeros outside)."""
    del k_block
    return gmm_quantized(dz, rhs, group_sizes, group_offset, transpose=True, precision=precision,
                         out_dtype=out_dtype, block_m=config.block_m)
