"""Pallas Triton kernels for layer/RMS normalization, forward and backward.

Rows are processed ``block_rows`` at a time; each program holds its rows
padded to a power of two ``block_d`` ≥ D in registers, masking the tail
columns (and tail rows in the backward reductions).

Forward, per row (float32):
    h = x + residual                      (fused residual add, optional)
    mean = Σh/D (or 0), rstd = 1/sqrt(Σ(h-mean)²/D + eps)
    y = (h - mean)·rstd·scale + offset
computed on h scaled by its row max |h| (`reference.row_statistics`): no
intermediate overflows for finite inputs.

Backward, per row with x̂ = (h - mean)·rstd and g = dy·scale:
    dh = rstd·(g - mean(g) - x̂·mean(g·x̂)) + dh_out   (drop mean(g) for RMSNorm)
    dscale = Σ_rows dy·x̂,  doffset = Σ_rows dy
The column sums are written per program as float32 partials
``[num_programs, D]`` and summed in XLA: deterministic, no atomics.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import iota, operand, output, triton_kernel_call
from .configs import NormConfig, row_block
from .reference import row_statistics


def _tile_masks(shape, rows: int, features: int):
    """``(row_ok [br], col_ok [br, bd])`` for the program's tile."""
    block_rows = shape[0]
    row = pl.program_id(0) * block_rows + iota(block_rows)
    col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return row < rows, col < features


def _forward_kernel(*, x, residual, scale, offset, y, h, mean, rstd, rows, features, epsilon, subtract_mean):
    """One block of rows: ``y = (h - mean)·rstd·scale + offset`` with ``h = x + residual``."""
    hx = x[...].astype(jnp.float32)
    if residual is not None:
        hx = hx + residual[...].astype(jnp.float32)
        h[...] = hx.astype(h.dtype)
    _, col_ok = _tile_masks(hx.shape, rows, features)
    hx = jnp.where(col_ok, hx, 0.0)
    # Statistics of the row scaled by its max |h| (no overflow for finite h; see `row_statistics`).
    xs, mean_s, factor, row_mean, row_rstd = row_statistics(
        hx, epsilon=epsilon, subtract_mean=subtract_mean, axis=1, features=features, valid=col_ok)
    out = jnp.where(col_ok, xs - mean_s, 0.0) * factor
    row_mean, row_rstd = row_mean[:, 0], row_rstd[:, 0]
    if scale is not None:
        out = out * scale[...].astype(jnp.float32)[None, :]
    if offset is not None:
        out = out + offset[...].astype(jnp.float32)[None, :]
    y[...] = out.astype(y.dtype)
    mean[...] = row_mean
    rstd[...] = row_rstd


def _specs(rows: int, features: int, block_rows: int):
    """``(row, vec, stat)`` block specs of a row-blocked launch."""
    block_d = row_block(features)
    row_spec = pl.BlockSpec((block_rows, block_d), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((block_d,), lambda i: (0,))
    stat_spec = pl.BlockSpec((block_rows,), lambda i: (i,))
    return row_spec, vec_spec, stat_spec


def norm_forward(x, residual, scale, offset, *, epsilon, subtract_mean, config: NormConfig):
    """Rows ``x [R, D]`` → ``(y [R, D], h or None, mean [R], rstd [R])``."""
    rows, features = x.shape
    row_spec, vec_spec, stat_spec = _specs(rows, features, config.block_rows)
    kernel = functools.partial(_forward_kernel, rows=rows, features=features, epsilon=epsilon,
                               subtract_mean=subtract_mean)
    outs = triton_kernel_call(
        kernel, grid=(pl.cdiv(rows, config.block_rows),),
        inputs=dict(x=operand(x, row_spec), residual=operand(residual, row_spec),
                    scale=operand(scale, vec_spec), offset=operand(offset, vec_spec)),
        outputs=dict(y=output(x.shape, x.dtype, row_spec),
                     h=output(x.shape, x.dtype, row_spec) if residual is not None else None,
                     mean=output((rows,), jnp.float32, stat_spec), rstd=output((rows,), jnp.float32, stat_spec)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_norm_forward",
    )
    return outs.y, outs.h, outs.mean, outs.rstd


def _backward_kernel(*, dy, x, scale, mean, rstd, dh, dx, dscale, doffset, rows, features, subtract_mean):
    """One block of rows: ``dh = rstd·(g - mean(g) - x̂·mean(g·x̂)) + dh_out``, per-program column sums."""
    xf = x[...].astype(jnp.float32)
    row_ok, col_ok = _tile_masks(xf.shape, rows, features)
    valid = row_ok[:, None] & col_ok
    dyf = jnp.where(valid, dy[...].astype(jnp.float32), 0.0)
    row_mean = jnp.where(row_ok, mean[...], 0.0)
    row_rstd = jnp.where(row_ok, rstd[...], 0.0)
    xhat = jnp.where(valid, (xf - row_mean[:, None]) * row_rstd[:, None], 0.0)
    # Padded tail columns of scale hold garbage (NaN when interpreted): mask them.
    g = jnp.where(valid, dyf * scale[...].astype(jnp.float32)[None, :], 0.0) if scale is not None else dyf
    g_xhat = jnp.sum(g * xhat, axis=1, keepdims=True) / features
    dxf = g - xhat * g_xhat
    if subtract_mean:
        dxf = dxf - jnp.sum(g, axis=1, keepdims=True) / features
    dxf = dxf * row_rstd[:, None]
    if dh is not None:
        dxf = dxf + dh[...].astype(jnp.float32)
    dx[...] = dxf.astype(dx.dtype)
    if dscale is not None:
        dscale[...] = jnp.sum(dyf * xhat, axis=0)[None, :]
    if doffset is not None:
        doffset[...] = jnp.sum(dyf, axis=0)[None, :]


def norm_backward(dy, x, scale, offset, mean, rstd, dh, *, subtract_mean, config: NormConfig):
    """Rows backward → ``(dx [R, D], dscale [D] f32 or None, doffset [D] f32 or None)``."""
    rows, features = x.shape
    programs = pl.cdiv(rows, config.block_rows)
    row_spec, vec_spec, stat_spec = _specs(rows, features, config.block_rows)
    partial_spec = pl.BlockSpec((1, row_block(features)), lambda i: (i, 0))
    partial = output((programs, features), jnp.float32, partial_spec)
    kernel = functools.partial(_backward_kernel, rows=rows, features=features, subtract_mean=subtract_mean)
    outs = triton_kernel_call(
        kernel, grid=(programs,),
        inputs=dict(dy=operand(dy, row_spec), x=operand(x, row_spec), scale=operand(scale, vec_spec),
                    mean=operand(mean, stat_spec), rstd=operand(rstd, stat_spec), dh=operand(dh, row_spec)),
        outputs=dict(dx=output(x.shape, x.dtype, row_spec), dscale=partial if scale is not None else None,
                     doffset=partial if offset is not None else None),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_norm_backward",
    )
    dscale = None if outs.dscale is None else jnp.sum(outs.dscale, axis=0)
    doffset = None if outs.doffset is None else jnp.sum(outs.doffset, axis=0)
    return outs.dx, dscale, doffset
