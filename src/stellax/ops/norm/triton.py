"""Pallas Triton kernels for layer/RMS normalization, forward and backward.

Rows are processed ``block_rows`` at a time; each program holds its rows
padded to a power of two ``block_d`` ≥ D in registers, masking the tail
columns (and tail rows in the backward reductions).

Forward, per row (float32):
    h = x + residual                      (fused residual add, optional)
    mean = Σh/D (or 0), rstd = 1/sqrt(Σ(h-mean)²/D + eps)
    y = (h - mean)·rstd·scale + offset

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

from ...core.pallas import triton_call
from .configs import NormConfig, row_block


def _tile_masks(shape, rows: int, features: int):
    """``(row_ok [br], col_ok [br, bd])`` for the program's tile."""
    block_rows = shape[0]
    row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows,), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    return row < rows, col < features


def _forward_kernel(*refs, rows, features, epsilon, subtract_mean, has_residual, has_scale, has_offset):
    refs = list(refs)
    x_ref = refs.pop(0)
    r_ref = refs.pop(0) if has_residual else None
    scale_ref = refs.pop(0) if has_scale else None
    offset_ref = refs.pop(0) if has_offset else None
    y_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_residual else None
    mean_ref, rstd_ref = refs

    x = x_ref[...].astype(jnp.float32)
    if has_residual:
        x = x + r_ref[...].astype(jnp.float32)
        h_ref[...] = x.astype(h_ref.dtype)
    _, col_ok = _tile_masks(x.shape, rows, features)
    x = jnp.where(col_ok, x, 0.0)
    if subtract_mean:
        mean = jnp.sum(x, axis=1) / features
    else:
        mean = jnp.zeros((x.shape[0],), jnp.float32)
    centered = jnp.where(col_ok, x - mean[:, None], 0.0)
    rstd = jax.lax.rsqrt(jnp.sum(centered * centered, axis=1) / features + epsilon)
    y = centered * rstd[:, None]
    if has_scale:
        y = y * scale_ref[...].astype(jnp.float32)[None, :]
    if has_offset:
        y = y + offset_ref[...].astype(jnp.float32)[None, :]
    y_ref[...] = y.astype(y_ref.dtype)
    mean_ref[...] = mean
    rstd_ref[...] = rstd


def norm_forward(x, residual, scale, offset, *, epsilon, subtract_mean, config: NormConfig):
    """Rows ``x [R, D]`` → ``(y [R, D], h or None, mean [R], rstd [R])``."""
    rows, features = x.shape
    block_d = row_block(features)
    br = config.block_rows
    grid = (pl.cdiv(rows, br),)
    row_spec = pl.BlockSpec((br, block_d), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((block_d,), lambda i: (0,))
    stat_spec = pl.BlockSpec((br,), lambda i: (i,))
    inputs, in_specs = [x], [row_spec]
    for arr, spec in ((residual, row_spec), (scale, vec_spec), (offset, vec_spec)):
        if arr is not None:
            inputs.append(arr)
            in_specs.append(spec)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row_spec]
    if residual is not None:
        out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
        out_specs.append(row_spec)
    out_shape += [jax.ShapeDtypeStruct((rows,), jnp.float32)] * 2
    out_specs += [stat_spec, stat_spec]
    kernel = functools.partial(
        _forward_kernel, rows=rows, features=features, epsilon=epsilon, subtract_mean=subtract_mean,
        has_residual=residual is not None, has_scale=scale is not None, has_offset=offset is not None,
    )
    outs = triton_call(
        kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs,
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_norm_forward",
    )(*inputs)
    if residual is not None:
        y, h, mean, rstd = outs
    else:
        (y, mean, rstd), h = outs, None
    return y, h, mean, rstd


def _backward_kernel(*refs, rows, features, subtract_mean, has_scale, has_offset, has_dh):
    refs = list(refs)
    dy_ref, x_ref = refs.pop(0), refs.pop(0)
    scale_ref = refs.pop(0) if has_scale else None
    mean_ref, rstd_ref = refs.pop(0), refs.pop(0)
    dh_ref = refs.pop(0) if has_dh else None
    dx_ref = refs.pop(0)
    dscale_ref = refs.pop(0) if has_scale else None
    doffset_ref = refs.pop(0) if has_offset else None

    x = x_ref[...].astype(jnp.float32)
    row_ok, col_ok = _tile_masks(x.shape, rows, features)
    valid = row_ok[:, None] & col_ok
    dy = jnp.where(valid, dy_ref[...].astype(jnp.float32), 0.0)
    mean = jnp.where(row_ok, mean_ref[...], 0.0)
    rstd = jnp.where(row_ok, rstd_ref[...], 0.0)
    xhat = jnp.where(valid, (x - mean[:, None]) * rstd[:, None], 0.0)
    # Padded tail columns of scale hold garbage (NaN when interpreted): mask them.
    g = jnp.where(valid, dy * scale_ref[...].astype(jnp.float32)[None, :], 0.0) if has_scale else dy
    g_xhat = jnp.sum(g * xhat, axis=1, keepdims=True) / features
    dx = g - xhat * g_xhat
    if subtract_mean:
        dx = dx - jnp.sum(g, axis=1, keepdims=True) / features
    dx = dx * rstd[:, None]
    if has_dh:
        dx = dx + dh_ref[...].astype(jnp.float32)
    dx_ref[...] = dx.astype(dx_ref.dtype)
    if has_scale:
        dscale_ref[...] = jnp.sum(dy * xhat, axis=0)[None, :]
    if has_offset:
        doffset_ref[...] = jnp.sum(dy, axis=0)[None, :]


def norm_backward(dy, x, scale, offset, mean, rstd, dh, *, subtract_mean, config: NormConfig):
    """Rows backward → ``(dx [R, D], dscale [D] f32 or None, doffset [D] f32 or None)``."""
    rows, features = x.shape
    block_d = row_block(features)
    br = config.block_rows
    programs = pl.cdiv(rows, br)
    row_spec = pl.BlockSpec((br, block_d), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((block_d,), lambda i: (0,))
    stat_spec = pl.BlockSpec((br,), lambda i: (i,))
    partial_spec = pl.BlockSpec((1, block_d), lambda i: (i, 0))
    inputs, in_specs = [dy, x], [row_spec, row_spec]
    if scale is not None:
        inputs.append(scale)
        in_specs.append(vec_spec)
    inputs += [mean, rstd]
    in_specs += [stat_spec, stat_spec]
    if dh is not None:
        inputs.append(dh)
        in_specs.append(row_spec)
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype)]
    out_specs = [row_spec]
    partial = jax.ShapeDtypeStruct((programs, features), jnp.float32)
    for present in (scale is not None, offset is not None):
        if present:
            out_shape.append(partial)
            out_specs.append(partial_spec)
    kernel = functools.partial(
        _backward_kernel, rows=rows, features=features, subtract_mean=subtract_mean,
        has_scale=scale is not None, has_offset=offset is not None, has_dh=dh is not None,
    )
    outs = triton_call(
        kernel, out_shape=out_shape, grid=(programs,), in_specs=in_specs, out_specs=out_specs,
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_norm_backward",
    )(*inputs)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    dx = outs.pop(0)
    dscale = jnp.sum(outs.pop(0), axis=0) if scale is not None else None
    doffset = jnp.sum(outs.pop(0), axis=0) if offset is not None else None
    return dx, dscale, doffset
