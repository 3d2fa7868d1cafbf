"""Pallas Mosaic TPU kernels for layer/RMS normalization, forward and backward.

Bandwidth first: every kernel reads each input byte once from HBM and writes each output
byte once. Rows ``x [R, D]`` move in large blocks of ``block_rows`` rows (megabytes: few grid
steps, long DMAs) with the feature axis padded (in the wrapper, with zeros, only when D is
not a multiple of 128) to ``Dp``; inside a block the kernel walks `CHUNK_ROWS` rows at a
time (a ``fori_loop``) and each chunk in lane slabs of ``slab`` columns (static), so the
float32 working set of one step is a few vector registers and the code size does not grow
with the block. The last block of rows may be partial: its out-of-range rows are computed on
whatever the buffer holds, never written back, and masked out of the backward's column sums.

Forward, per row in float32, overflow-safe for any finite input: with
``s = 2^⌊log2 max|h|⌋`` (a power of two, so the scaling is exact) and ``u = h / s``:

    mean_u = Σu/D (or 0),  var_u = Σ(u - mean_u)²/D
    r = s·rstd = rsqrt(var_u + eps/s²)        (s ≥ 1; eps/s² never overflows)
               = s·rsqrt(var_u·s² + eps)      (s < 1; var_u·s² never overflows)
    y = (u - mean_u)·r·scale + offset,  mean = mean_u·s,  rstd = r / s

in passes over the chunk held in a float32 VMEM scratch (``h = x + residual`` is formed and
stored once): max |h|, Σu (LayerNorm only), Σ(u - mean_u)², then ``y``. Row statistics are
written as ``[R, 1]`` float32; RMSNorm writes no mean (it is 0).

Backward, per row with x̂ = (h - mean)·rstd and g = dy·scale:

    dh = rstd·(g - mean(g) - x̂·mean(g·x̂)) + dh_out     (no mean(g) for RMSNorm)
    dscale = Σ_rows dy·x̂,  doffset = Σ_rows dy

in two passes over the chunk (the row sums, then ``dh``). The column sums accumulate in
float32 in the output block itself, ``[splits, 8, Dp]``: the grid is ``(splits, steps)``, the
first axis ``parallel`` (one split per TensorCore of a megacore chip), the second
``arbitrary`` (the block stays in VMEM across it); XLA sums the ``splits × 8`` partial rows in
a fixed order. Deterministic.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import operand, output, pad_axis, tpu_kernel_call
from .configs import (CHUNK_ROWS, NormTpuConfig, tpu_block_rows, tpu_block_vmem_bytes, tpu_chunk_rows,
                      tpu_padded_features, tpu_slab, tpu_vmem_limit)

_EXPONENT_BITS = 0x7F800000
#: ``2^126``: the largest scale whose reciprocal is a normal float32 (TPUs flush subnormals).
_MAX_SCALE_BITS = 0x7E800000
#: ``2^-126``: the smallest normal float32, the scale of rows of tiny or zero values.
_MIN_SCALE_BITS = 0x00800000
_TINY = float(jnp.finfo(jnp.float32).tiny)
F32 = jnp.float32
__all__ = ["CHUNK_ROWS", "norm_backward", "norm_forward"]


def _power_of_two_scale(amax):
    """``s = 2^⌊log2 amax⌋`` clamped to ``[2^-126, 2^126]`` (float32 ``[rows, 1]``): the
    exponent bits of ``amax`` with a zero mantissa."""
    bits = jax.lax.bitcast_convert_type(amax, jnp.int32) & _EXPONENT_BITS
    bits = jnp.clip(bits, _MIN_SCALE_BITS, _MAX_SCALE_BITS)
    return jax.lax.bitcast_convert_type(bits, F32)


def _chunk_rows(i, chunk: int):
    """The rows of chunk ``i`` of a block (a ``pl.ds``; aligned to the sublane tile)."""
    start = i * chunk
    return pl.ds(pl.multiple_of(start, chunk) if chunk % 8 == 0 else start, chunk)


def _fold_rows(a):
    """Column sums of ``a [chunk, w]`` folded to ``[8, w]`` with vector adds (``[1, w]`` when the
    chunk is not a multiple of 8 rows: a block of fewer than `CHUNK_ROWS` rows)."""
    rows, width = a.shape
    if rows % 8:
        return jnp.sum(a, axis=0, keepdims=True)
    return jnp.sum(a.reshape(rows // 8, 8, width), axis=0)


def _forward_kernel(*, x, residual, scale, offset, y, h, mean, rstd, hbuf, features, epsilon, subtract_mean,
                    chunk, slab):
    """One block of rows, `CHUNK_ROWS` at a time: ``y = (h - mean)·rstd·scale + offset`` with
    ``h = x + residual``; writes ``y``, ``h`` (with a residual) and the rows' ``mean``/``rstd``."""
    padded = x.shape[1]
    slabs = [slice(c, c + slab) for c in range(0, padded, slab)]
    inv_d = 1.0 / features
    source = x if hbuf is None else hbuf  # float32 rows without a residual are read in place

    def body(i, carry):
        rows = _chunk_rows(i, chunk)
        amax = None
        for cols in slabs:  # pass 0: h, stored once in float32, and max |h|
            hs = x[rows, cols].astype(F32)
            if residual is not None:
                hs = hs + residual[rows, cols].astype(F32)
                h[rows, cols] = hs.astype(h.dtype)
            if hbuf is not None:
                hbuf[:, cols] = hs
            amax = jnp.abs(hs) if amax is None else jnp.maximum(amax, jnp.abs(hs))
        s = _power_of_two_scale(jnp.max(amax, axis=1, keepdims=True))
        inv_s = 1.0 / s
        u = lambda cols: (source[:, cols] if hbuf is not None else source[rows, cols].astype(F32)) * inv_s
        mean_u = jnp.zeros_like(s)
        if subtract_mean:  # pass 1: Σu
            acc = None
            for cols in slabs:
                acc = u(cols) if acc is None else acc + u(cols)
            mean_u = jnp.sum(acc, axis=1, keepdims=True) * inv_d
        acc = None
        for cols in slabs:  # pass 2: Σ(u - mean_u)², padded columns masked
            c = u(cols) - mean_u if subtract_mean else u(cols)
            if subtract_mean and cols.stop > features:
                column = cols.start + jax.lax.broadcasted_iota(jnp.int32, c.shape, 1)
                c = jnp.where(column < features, c, 0.0)
            acc = c * c if acc is None else acc + c * c
        var_u = jnp.sum(acc, axis=1, keepdims=True) * inv_d
        large = jax.lax.rsqrt(jnp.maximum(var_u + epsilon * inv_s * inv_s, _TINY))
        small = s * jax.lax.rsqrt(var_u * s * s + epsilon)
        r = jnp.where(s >= 1.0, large, small)
        for cols in slabs:  # pass 3: y
            out = (u(cols) - mean_u) * r if subtract_mean else u(cols) * r
            if scale is not None:
                out = out * scale[:, cols]
            if offset is not None:
                out = out + offset[:, cols]
            y[rows, cols] = out.astype(y.dtype)
        if mean is not None:
            mean[rows, :] = mean_u * s
        rstd[rows, :] = r * inv_s
        return carry

    jax.lax.fori_loop(0, x.shape[0] // chunk, body, 0)


def _backward_kernel(*, dy, x, scale, mean, rstd, dh, dx, dscale, doffset, xbuf, dybuf, rows_total, steps,
                     features, chunk, slab):
    """One block of rows, `CHUNK_ROWS` at a time: ``dh = rstd·(g - mean(g) - x̂·mean(g·x̂)) +
    dh_out``; adds the rows' ``dy·x̂`` and ``dy`` to the split's column sums."""
    block_rows, padded = x.shape
    slabs = [slice(c, c + slab) for c in range(0, padded, slab)]
    inv_d = 1.0 / features
    block = pl.program_id(0) * steps + pl.program_id(1)
    partial_block = rows_total % block_rows != 0

    @pl.when(pl.program_id(1) == 0)
    def _():
        for acc in (dscale, doffset):
            if acc is not None:
                acc[...] = jnp.zeros_like(acc)

    def body(i, carry):
        rows = _chunk_rows(i, chunk)
        r = rstd[rows, :]
        mu = mean[rows, :] if mean is not None else None
        sum_gx = sum_g = None
        for cols in slabs:  # pass A: x̂ and dy in float32 scratch; Σ g·x̂, Σ g
            xf = x[rows, cols].astype(F32)
            xhat = (xf - mu) * r if mu is not None else xf * r
            dyf = dy[rows, cols].astype(F32)
            xbuf[:, cols] = xhat
            dybuf[:, cols] = dyf
            g = dyf * scale[:, cols] if scale is not None else dyf  # 0 in padded columns
            sum_gx = g * xhat if sum_gx is None else sum_gx + g * xhat
            if mu is not None:
                sum_g = g if sum_g is None else sum_g + g
        c1 = jnp.sum(sum_gx, axis=1, keepdims=True) * inv_d
        c2 = jnp.sum(sum_g, axis=1, keepdims=True) * inv_d if mu is not None else None
        inside = None
        if partial_block:  # rows past the end hold garbage: keep them out of the column sums
            row = block * block_rows + i * chunk + jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
            inside = row < rows_total
        for cols in slabs:  # pass B: dx, and the column sums
            xhat, dyf = xbuf[:, cols], dybuf[:, cols]
            g = dyf * scale[:, cols] if scale is not None else dyf
            d = g - xhat * c1
            if c2 is not None:
                d = d - c2
            d = d * r
            if dh is not None:
                d = d + dh[rows, cols].astype(F32)
            dx[rows, cols] = d.astype(dx.dtype)
            if dscale is not None:
                term = dyf * xhat if inside is None else jnp.where(inside, dyf * xhat, 0.0)
                part = _fold_rows(term)
                dscale[0, :part.shape[0], cols] += part
            if doffset is not None:
                term = dyf if inside is None else jnp.where(inside, dyf, 0.0)
                part = _fold_rows(term)
                doffset[0, :part.shape[0], cols] += part
        return carry

    jax.lax.fori_loop(0, block_rows // chunk, body, 0)


def _pad_rows(a, padded):
    """``[R, D]`` → ``[R, Dp]`` (zeros), ``None`` stays ``None``."""
    return None if a is None else pad_axis(a, 1, padded)


def _pad_vector(v, padded):
    """``[D]`` → ``[1, Dp]`` float32 (zeros), ``None`` stays ``None``."""
    return None if v is None else pad_axis(v.astype(F32), 0, padded).reshape(1, padded)


def norm_forward(x, residual, scale, offset, *, epsilon, subtract_mean, config: NormTpuConfig):
    """Rows ``x [R, D]`` (``residual`` ``[R, D]`` or None, ``scale``/``offset`` ``[D]`` or None) →
    ``(y [R, D], h [R, D] or None, mean [R] f32, rstd [R] f32)``; ``y``/``h`` in ``x.dtype``."""
    rows, features = x.shape
    padded = tpu_padded_features(features)
    block_rows = tpu_block_rows(rows, config.block_rows)
    chunk, slab = tpu_chunk_rows(block_rows), tpu_slab(padded)
    row_spec = pl.BlockSpec((block_rows, padded), lambda i: (i, 0))
    vec_spec = pl.BlockSpec((1, padded), lambda i: (0, 0))
    stat_spec = pl.BlockSpec((block_rows, 1), lambda i: (i, 0))
    staged = residual is not None or x.dtype != F32
    kernel = functools.partial(_forward_kernel, features=features, epsilon=epsilon, subtract_mean=subtract_mean,
                               chunk=chunk, slab=slab)
    streams = 1 + (residual is not None)
    need = tpu_block_vmem_bytes("forward", streams, streams, rows, features, x.dtype.itemsize, config.block_rows)
    outs = tpu_kernel_call(
        kernel, grid=(pl.cdiv(rows, block_rows),), dimension_semantics=("parallel",),
        name="stellax_norm_forward_tpu",
        inputs=dict(x=operand(_pad_rows(x, padded), row_spec),
                    residual=operand(_pad_rows(residual, padded), row_spec),
                    scale=operand(_pad_vector(scale, padded), vec_spec),
                    offset=operand(_pad_vector(offset, padded), vec_spec)),
        outputs=dict(y=output((rows, padded), x.dtype, row_spec),
                     h=output((rows, padded), x.dtype, row_spec) if residual is not None else None,
                     mean=output((rows, 1), F32, stat_spec) if subtract_mean else None,
                     rstd=output((rows, 1), F32, stat_spec)),
        scratch=dict(hbuf=pltpu.VMEM((chunk, padded), F32) if staged else None),
        vmem_limit_bytes=tpu_vmem_limit(need),
    )
    unpad = lambda a: None if a is None else (a if padded == features else a[:, :features])
    mean = outs.mean[:, 0] if subtract_mean else jnp.zeros((rows,), F32)
    return unpad(outs.y), unpad(outs.h), mean, outs.rstd[:, 0]


def _splits(blocks: int) -> int:
    """Column-sum partials: one per TensorCore of a megacore chip when the blocks split evenly."""
    return 2 if blocks >= 2 and blocks % 2 == 0 else 1


def norm_backward(dy, x, scale, offset, mean, rstd, dh, *, subtract_mean, config: NormTpuConfig):
    """Rows backward: ``dy [R, D]``, the normalized rows ``x [R, D]``, ``mean``/``rstd`` ``[R]``,
    ``dh [R, D]`` or None → ``(dx [R, D] in x.dtype, dscale [D] f32 or None, doffset [D] f32 or None)``."""
    rows, features = x.shape
    padded = tpu_padded_features(features)
    block_rows = tpu_block_rows(rows, config.block_rows)
    chunk, slab = tpu_chunk_rows(block_rows), tpu_slab(padded)
    blocks = pl.cdiv(rows, block_rows)
    splits = _splits(blocks)
    steps = blocks // splits
    row_spec = pl.BlockSpec((block_rows, padded), lambda c, i: (c * steps + i, 0))
    vec_spec = pl.BlockSpec((1, padded), lambda c, i: (0, 0))
    stat_spec = pl.BlockSpec((block_rows, 1), lambda c, i: (c * steps + i, 0))
    partial_spec = pl.BlockSpec((1, 8, padded), lambda c, i: (c, 0, 0))
    partial = output((splits, 8, padded), F32, partial_spec)
    kernel = functools.partial(_backward_kernel, rows_total=rows, steps=steps, features=features, chunk=chunk,
                               slab=slab)
    need = tpu_block_vmem_bytes("backward", 2 + (dh is not None), 1, rows, features, x.dtype.itemsize,
                                config.block_rows)
    outs = tpu_kernel_call(
        kernel, grid=(splits, steps), dimension_semantics=("parallel", "arbitrary"),
        name="stellax_norm_backward_tpu",
        inputs=dict(dy=operand(_pad_rows(dy, padded), row_spec), x=operand(_pad_rows(x, padded), row_spec),
                    scale=operand(_pad_vector(scale, padded), vec_spec),
                    mean=operand(mean.astype(F32).reshape(rows, 1), stat_spec) if subtract_mean else None,
                    rstd=operand(rstd.astype(F32).reshape(rows, 1), stat_spec),
                    dh=operand(_pad_rows(dh, padded), row_spec)),
        outputs=dict(dx=output((rows, padded), x.dtype, row_spec),
                     dscale=partial if scale is not None else None,
                     doffset=partial if offset is not None else None),
        scratch=dict(xbuf=pltpu.VMEM((chunk, padded), F32), dybuf=pltpu.VMEM((chunk, padded), F32)),
        vmem_limit_bytes=tpu_vmem_limit(need),
    )
    column_sum = lambda p: None if p is None else jnp.sum(p[:, :, :features], axis=(0, 1))
    dx = outs.dx if padded == features else outs.dx[:, :features]
    return dx, column_sum(outs.dscale), column_sum(outs.doffset)
