"""Pallas Mosaic TPU kernels for layer/RMS normalization, forward and backward.

Layout: rows ``x [R, D]`` are cut into blocks of ``block_rows`` rows (a grid
axis marked ``parallel``); each block holds whole rows with the feature axis
padded (in the wrapper, with zeros) to ``Dp``, a multiple of 128 lanes, so
every block is ``(block_rows, Dp)``: legal under the TPU (8, 128) tiling.
Padded columns are masked out of the statistics; the last block of rows may
be partial (its out-of-range rows are computed on whatever the buffer holds
and never written back, and masked out of the backward's column sums).
Row statistics are stored as ``[R, 1]`` float32 (a block equal to the full
last dimension); scale/offset as ``[1, Dp]``.

Forward, per row in float32, overflow-safe for any finite input: with
``s = 2^⌊log2 max|h|⌋`` (a power of two, so the scaling is exact) and
``u = h / s`` (``|u| < 2``):

    mean_u = Σu/D (or 0),  var_u = Σ(u - mean_u)²/D
    r = s·rstd = rsqrt(var_u + eps/s²)        (s ≥ 1; eps/s² never overflows)
               = s·rsqrt(var_u·s² + eps)      (s < 1; var_u·s² never overflows)
    y = (u - mean_u)·r·scale + offset,  mean = mean_u·s,  rstd = r / s

Backward, per row with x̂ = (h - mean)·rstd and g = dy·scale:

    dh = rstd·(g - mean(g) - x̂·mean(g·x̂)) + dh_out     (no mean(g) for RMSNorm)
    dscale = Σ_rows dy·x̂,  doffset = Σ_rows dy

The column sums are written per block as float32 partials ``[blocks, 1, Dp]``
and summed in XLA in a fixed order: deterministic, and the row axis stays
``parallel`` (split across the TensorCores of a megacore chip).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import operand, output, pad_axis, tpu_kernel_call
from .configs import NormTpuConfig, tpu_block_rows, tpu_block_vmem_bytes, tpu_padded_features, tpu_vmem_limit

_EXPONENT_BITS = 0x7F800000
#: ``2^126``: the largest scale whose reciprocal is a normal float32 (TPUs flush subnormals).
_MAX_SCALE_BITS = 0x7E800000
#: ``2^-126``: the smallest normal float32, the scale of rows of tiny or zero values.
_MIN_SCALE_BITS = 0x00800000
_TINY = float(jnp.finfo(jnp.float32).tiny)


def _power_of_two_scale(amax):
    """``s = 2^⌊log2 amax⌋`` clamped to ``[2^-126, 2^126]`` (float32 ``[rows, 1]``): the
    exponent bits of ``amax`` with a zero mantissa."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32) & _EXPONENT_BITS
    bits = jnp.clip(bits, _MIN_SCALE_BITS, _MAX_SCALE_BITS)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _row_statistics(h, *, features: int, padded: int, epsilon: float, subtract_mean: bool):
    """``(centered_u, r, mean, rstd)`` of float32 rows ``h [br, Dp]`` (see the module docstring);
    ``centered_u [br, Dp]`` is 0 in padded columns, the others are ``[br, 1]``."""
    scale = _power_of_two_scale(jnp.max(jnp.abs(h), axis=1, keepdims=True))
    inv_scale = 1.0 / scale
    u = h * inv_scale
    inv_d = 1.0 / features
    if subtract_mean:
        mean_u = jnp.sum(u, axis=1, keepdims=True) * inv_d
        centered = u - mean_u
        if padded != features:
            column = jax.lax.broadcasted_iota(jnp.int32, u.shape, 1)
            centered = jnp.where(column < features, centered, 0.0)
    else:
        mean_u = jnp.zeros_like(scale)
        centered = u  # padded columns are zeros already
    var_u = jnp.sum(centered * centered, axis=1, keepdims=True) * inv_d
    large = jax.lax.rsqrt(jnp.maximum(var_u + epsilon * inv_scale * inv_scale, _TINY))
    small = scale * jax.lax.rsqrt(var_u * scale * scale + epsilon)
    r = jnp.where(scale >= 1.0, large, small)
    return centered, r, mean_u * scale, r * inv_scale


def _forward_kernel(*, x, residual, scale, offset, y, h, mean, rstd, features, padded, epsilon,
                    subtract_mean):
    """One block of rows: ``y = (h - mean)·rstd·scale + offset`` with ``h = x + residual``;
    writes ``y``, ``h`` (with a residual) and the rows' ``mean``/``rstd``."""
    hx = x[...].astype(jnp.float32)
    if residual is not None:
        hx = hx + residual[...].astype(jnp.float32)
        h[...] = hx.astype(h.dtype)
    centered, r, row_mean, row_rstd = _row_statistics(hx, features=features, padded=padded, epsilon=epsilon,
                                                      subtract_mean=subtract_mean)
    out = centered * r
    if scale is not None:
        out = out * scale[...].astype(jnp.float32)
    if offset is not None:
        out = out + offset[...].astype(jnp.float32)
    y[...] = out.astype(y.dtype)
    mean[...] = row_mean
    rstd[...] = row_rstd


def _backward_kernel(*, dy, x, scale, mean, rstd, dh, dx, dscale, doffset, rows, block_rows, features,
                     subtract_mean):
    """One block of rows: ``dh = rstd·(g - mean(g) - x̂·mean(g·x̂)) + dh_out``; the block's
    column sums of ``dy·x̂`` and ``dy`` as ``[1, 1, Dp]`` partials."""
    xf = x[...].astype(jnp.float32)
    dyf = dy[...].astype(jnp.float32)
    row_mean, row_rstd = mean[...], rstd[...]
    if rows % block_rows:  # the last block is partial: zero its out-of-range rows
        row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
        inside = row < rows
        dyf = jnp.where(inside, dyf, 0.0)
        row_mean = jnp.where(inside, row_mean, 0.0)
        row_rstd = jnp.where(inside, row_rstd, 0.0)
        xf = jnp.where(inside, xf, 0.0)
    xhat = (xf - row_mean) * row_rstd
    g = dyf * scale[...].astype(jnp.float32) if scale is not None else dyf  # 0 in padded columns
    inv_d = 1.0 / features
    dxf = g - xhat * (jnp.sum(g * xhat, axis=1, keepdims=True) * inv_d)
    if subtract_mean:
        dxf = dxf - jnp.sum(g, axis=1, keepdims=True) * inv_d
    dxf = dxf * row_rstd
    if dh is not None:
        dxf = dxf + dh[...].astype(jnp.float32)
    dx[...] = dxf.astype(dx.dtype)
    if dscale is not None:
        dscale[...] = jnp.sum(dyf * xhat, axis=0, keepdims=True)[None]
    if doffset is not None:
        doffset[...] = jnp.sum(dyf, axis=0, keepdims=True)[None]


def _layout(rows: int, features: int, config: NormTpuConfig):
    """``(block_rows, Dp, grid, row_spec, vec_spec, stat_spec)`` of a row-blocked launch."""
    block_rows = tpu_block_rows(rows, config.block_rows)
    padded = tpu_padded_features(features)
    row_spec = pl.BlockSpec((block_rows, padded), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((1, padded), lambda i: (0, 0))
    stat_spec = pl.BlockSpec((block_rows, 1), lambda i: (i, 0))
    return block_rows, padded, (pl.cdiv(rows, block_rows),), row_spec, vec_spec, stat_spec


def _pad_rows(a, padded):
    """``[R, D]`` → ``[R, Dp]`` (zeros), ``None`` stays ``None``."""
    return None if a is None else pad_axis(a, 1, padded)


def _pad_vector(v, padded):
    """``[D]`` → ``[1, Dp]`` (zeros), ``None`` stays ``None``."""
    return None if v is None else pad_axis(v, 0, padded).reshape(1, padded)


def norm_forward(x, residual, scale, offset, *, epsilon, subtract_mean, config: NormTpuConfig):
    """Rows ``x [R, D]`` (``residual`` ``[R, D]`` or None, ``scale``/``offset`` ``[D]`` or None) →
    ``(y [R, D], h [R, D] or None, mean [R] f32, rstd [R] f32)``; ``y``/``h`` in ``x.dtype``."""
    rows, features = x.shape
    block_rows, padded, grid, row_spec, vec_spec, stat_spec = _layout(rows, features, config)
    kernel = functools.partial(_forward_kernel, features=features, padded=padded, epsilon=epsilon,
                               subtract_mean=subtract_mean)
    streams = 1 + (residual is not None)
    need = tpu_block_vmem_bytes("forward", streams, streams, rows, features, x.dtype.itemsize, config.block_rows)
    outs = tpu_kernel_call(
        kernel, grid=grid, dimension_semantics=("parallel",), name="stellax_norm_forward_tpu",
        inputs=dict(x=operand(_pad_rows(x, padded), row_spec),
                    residual=operand(_pad_rows(residual, padded), row_spec),
                    scale=operand(_pad_vector(scale, padded), vec_spec),
                    offset=operand(_pad_vector(offset, padded), vec_spec)),
        outputs=dict(y=output((rows, padded), x.dtype, row_spec),
                     h=output((rows, padded), x.dtype, row_spec) if residual is not None else None,
                     mean=output((rows, 1), jnp.float32, stat_spec), rstd=output((rows, 1), jnp.float32, stat_spec)),
        vmem_limit_bytes=tpu_vmem_limit(need),
    )
    unpad = lambda a: None if a is None else (a if padded == features else a[:, :features])
    return unpad(outs.y), unpad(outs.h), outs.mean[:, 0], outs.rstd[:, 0]


def norm_backward(dy, x, scale, offset, mean, rstd, dh, *, subtract_mean, config: NormTpuConfig):
    """Rows backward: ``dy [R, D]``, the normalized rows ``x [R, D]``, ``mean``/``rstd`` ``[R]``,
    ``dh [R, D]`` or None → ``(dx [R, D] in x.dtype, dscale [D] f32 or None, doffset [D] f32 or None)``."""
    rows, features = x.shape
    block_rows, padded, grid, row_spec, vec_spec, stat_spec = _layout(rows, features, config)
    partial_spec = pl.BlockSpec((1, 1, padded), lambda i: (i, 0, 0))
    partial = output((grid[0], 1, padded), jnp.float32, partial_spec)
    kernel = functools.partial(_backward_kernel, rows=rows, block_rows=block_rows, features=features,
                               subtract_mean=subtract_mean)
    need = tpu_block_vmem_bytes("backward", 2 + (dh is not None), 1, rows, features, x.dtype.itemsize,
                                config.block_rows)
    outs = tpu_kernel_call(
        kernel, grid=grid, dimension_semantics=("parallel",), name="stellax_norm_backward_tpu",
        inputs=dict(dy=operand(_pad_rows(dy, padded), row_spec), x=operand(_pad_rows(x, padded), row_spec),
                    scale=operand(_pad_vector(scale, padded), vec_spec),
                    mean=operand(mean.astype(jnp.float32).reshape(rows, 1), stat_spec),
                    rstd=operand(rstd.astype(jnp.float32).reshape(rows, 1), stat_spec),
                    dh=operand(_pad_rows(dh, padded), row_spec)),
        outputs=dict(dx=output((rows, padded), x.dtype, row_spec),
                     dscale=partial if scale is not None else None,
                     doffset=partial if offset is not None else None),
        vmem_limit_bytes=tpu_vmem_limit(need),
    )
    column_sum = lambda p: None if p is None else jnp.sum(p[:, 0, :features], axis=0)
    dx = outs.dx if padded == features else outs.dx[:, :features]
    return dx, column_sum(outs.dscale), column_sum(outs.doffset)
