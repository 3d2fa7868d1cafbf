"""Golden layer/RMS normalization in float32.

For a row ``x`` of length ``D`` (the normalized axis):

    mean = sum(x) / D                      (0 when subtract_mean=False: RMSNorm)
    var  = sum((x - mean)^2) / D
    y    = (x - mean) / sqrt(var + epsilon) * scale + offset

computed on the row divided by its largest magnitude (`row_statistics`), so
no intermediate overflows for finite inputs (x² alone does past ~1.8e19).

With a residual, ``h = x + residual`` is normalized and returned alongside ``y``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call


def row_statistics(x, *, epsilon: float, subtract_mean: bool, axis: int = -1, features: int | None = None,
                   valid=None):
    """Overflow-free row statistics of float32 ``x``: ``(xs, mean_s, factor,
    mean, rstd)`` with ``y = (xs - mean_s) · factor``.

    ``x²`` overflows float32 for ``|x| ≳ 1.8e19`` (and ``Σx`` near the top of
    the range), so every row is first divided by its largest magnitude ``a =
    max |x|`` (``xs = x / a``, ``|xs| ≤ 1``): ``mean = a · mean(xs)``,
    ``var = a² · var_s`` and

        factor = a · rstd = rsqrt(var_s + eps / a²)          (a ≥ 1)
                          = a · rsqrt(a² · var_s + eps)        (a < 1: no overflow)

    ``rstd = factor / a``. A zero row keeps ``a = 1``. (Divisions by ``a`` are
    done as two multiplications by ``rsqrt(a)``.) ``valid`` (a mask
    broadcast against ``x``) excludes padding columns; ``features`` is the
    row length (default ``x.shape[axis]``)."""
    n = x.shape[axis] if features is None else features
    mag = jnp.abs(x) if valid is None else jnp.where(valid, jnp.abs(x), 0.0)
    a = jnp.max(mag, axis=axis, keepdims=True)
    a = jnp.where(a > 0, a, 1.0)
    r = jax.lax.rsqrt(a)          # x·r·r, never x / a: XLA turns that into x·(1/a), and 1/a
    xs = (x * r) * r              # is subnormal (flushed to 0) for a ≳ 8.5e37
    if valid is not None:
        xs = jnp.where(valid, xs, 0.0)
    mean_s = jnp.sum(xs, axis=axis, keepdims=True) / n if subtract_mean else jnp.zeros_like(a)
    centered = xs - mean_s
    if valid is not None:
        centered = jnp.where(valid, centered, 0.0)
    var_s = jnp.sum(centered * centered, axis=axis, keepdims=True) / n
    big = a >= 1.0
    a_big = jnp.where(big, a, 1.0)
    a_small = jnp.where(big, 0.0, a)
    factor = jnp.where(big, jax.lax.rsqrt(var_s + epsilon / (a_big * a_big)),
                       a_small * jax.lax.rsqrt(a_small * a_small * var_s + epsilon))
    mean = jnp.zeros_like(a)
    if subtract_mean:  # Σx/D when it is finite (exact as before; the backward's x̂ = (x - mean)·rstd uses it)
        direct = jnp.sum(x if valid is None else jnp.where(valid, x, 0.0), axis=axis, keepdims=True) / n
        mean = jnp.where(jnp.isfinite(direct), direct, mean_s * a)
    return xs, mean_s, factor, mean, (factor * r) * r


def normalize_rows(x, scale, offset, *, epsilon: float, subtract_mean: bool):
    """Normalize over the last axis in float32; returns ``(y, mean, rstd)``
    with ``mean``/``rstd`` of shape ``x.shape[:-1]`` (float32). Statistics by
    `row_statistics` (no overflow for any finite input)."""
    x = x.astype(jnp.float32)
    xs, mean_s, factor, mean, rstd = row_statistics(x, epsilon=epsilon, subtract_mean=subtract_mean)
    y = (xs - mean_s) * factor
    mean, rstd = mean[..., 0], rstd[..., 0]
    if scale is not None:
        y = y * scale.astype(jnp.float32)
    if offset is not None:
        y = y + offset.astype(jnp.float32)
    return y, mean, rstd


def layer_norm_reference(call: Call):
    """Golden `layer_norm`: float32 math, output in the input dtype."""
    x, residual = call.x, call.residual
    axis = call.axis
    h = x if residual is None else (x.astype(jnp.float32) + residual.astype(jnp.float32))
    h_last = jnp.moveaxis(h, axis, -1)
    y, _, _ = normalize_rows(h_last, call.scale, call.offset, epsilon=call.epsilon,
                             subtract_mean=call.subtract_mean)
    y = jnp.moveaxis(y, -1, axis).astype(x.dtype)
    if residual is None:
        return y
    return y, h.astype(x.dtype)


def layer_norm_backward_reference(call: Call):
    """Golden backward on 2-D rows: the VJP of the float32 forward.

    Returns ``(dx, dscale, doffset)``; ``dx`` includes the cotangent ``dh`` of
    the returned residual sum when present (``dx == dresidual``).
    """
    x, scale, offset, dy, dh = call.x, call.scale, call.offset, call.dy, call.dh

    def forward(x, scale, offset):
        y, _, _ = normalize_rows(x, scale, offset, epsilon=call.epsilon, subtract_mean=call.subtract_mean)
        return y

    x32 = x.astype(jnp.float32)
    s32 = None if scale is None else scale.astype(jnp.float32)
    o32 = None if offset is None else offset.astype(jnp.float32)
    _, vjp = jax.vjp(forward, x32, s32, o32)
    dx, dscale, doffset = vjp(dy.astype(jnp.float32))
    if dh is not None:
        dx = dx + dh.astype(jnp.float32)
    return (
        dx.astype(x.dtype),
        None if scale is None else dscale.astype(scale.dtype),
        None if offset is None else doffset.astype(offset.dtype),
    )
