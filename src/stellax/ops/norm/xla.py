"""XLA implementations of the normalization forward and backward (rows form).

The same math as the Triton kernels (see `triton.py`), in jnp: XLA fuses it
into one or two loops per pass. Row statistics are float32.
"""

from __future__ import annotations

import jax.numpy as jnp

from .reference import normalize_rows


def norm_forward(x, residual, scale, offset, *, epsilon, subtract_mean, config=None):
    """Rows ``x [R, D]`` → ``(y, h or None, mean [R], rstd [R])``."""
    del config
    h = None
    if residual is not None:
        h32 = x.astype(jnp.float32) + residual.astype(jnp.float32)
        h = h32.astype(x.dtype)
        x = h32
    y, mean, rstd = normalize_rows(x, scale, offset, epsilon=epsilon, subtract_mean=subtract_mean)
    return y.astype(h.dtype if h is not None else x.dtype), h, mean, rstd


def norm_backward(dy, x, scale, offset, mean, rstd, dh, *, subtract_mean, config=None):
    """Rows backward → ``(dx, dscale f32 or None, doffset f32 or None)``."""
    del config
    features = x.shape[-1]
    dy32 = dy.astype(jnp.float32)
    xhat = (x.astype(jnp.float32) - mean[:, None]) * rstd[:, None]
    g = dy32 * scale.astype(jnp.float32) if scale is not None else dy32
    dx = g - xhat * (jnp.sum(g * xhat, axis=-1, keepdims=True) / features)
    if subtract_mean:
        dx = dx - jnp.sum(g, axis=-1, keepdims=True) / features
    dx = dx * rstd[:, None]
    if dh is not None:
        dx = dx + dh.astype(jnp.float32)
    dscale = jnp.sum(dy32 * xhat, axis=0) if scale is not None else None
    doffset = jnp.sum(dy32, axis=0) if offset is not None else None
    return dx.astype(x.dtype), dscale, doffset
