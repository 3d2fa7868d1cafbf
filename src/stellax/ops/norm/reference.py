"""Golden layer/RMS normalization in float32.

For a row ``x`` of length ``D`` (the normalized axis):

    mean = sum(x) / D                      (0 when subtract_mean=False: RMSNorm)
    var  = sum((x - mean)^2) / D
    y    = (x - mean) / sqrt(var + epsilon) * scale + offset

With a residual, ``h = x + residual`` is normalized and returned alongside ``y``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call


def normalize_rows(x, scale, offset, *, epsilon: float, subtract_mean: bool):
    """Normalize over the last axis in float32; returns ``(y, mean, rstd)``
    with ``mean``/``rstd`` of shape ``x.shape[:-1]`` (float32)."""
    x = x.astype(jnp.float32)
    mean = jnp.mean(x, axis=-1) if subtract_mean else jnp.zeros(x.shape[:-1], jnp.float32)
    centered = x - mean[..., None]
    rstd = jax.lax.rsqrt(jnp.mean(centered * centered, axis=-1) + epsilon)
    y = centered * rstd[..., None]
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
