"""Golden dot-product attention: plain einsum/softmax in float32.

On canonical operands (see `base.canonicalize`): ``q [B, T, N, H]``,
``k [B, S, K, H]``, ``v [B, S, K, Hv]``, GQA with ``G = N // K`` (query head
``n`` reads kv head ``n // G``, never materialized repeated), optional
``bias``/``mask [B|1, N|1, T|1, S|1]``, ``sinks [N]``:

    s    = scale · q·kᵀ                                  (float32, HIGHEST)
    s    = cap · tanh(s / cap)                           (logits_soft_cap)
    s    = s + bias
    s    = -inf where the mask (positions, segments, dense mask) hides a key
    m    = max(max_j s_j, sink)
    l    = Σ_j exp(s_j - m) + exp(sink - m)              (sink: denominator only)
    out  = Σ_j exp(s_j - m) v_j / l                      (0 when l == 0)
    lse  = m + log(l)                                    (-inf when l == 0)

A fully masked row (no key and no sink) returns zeros and ``lse = -inf``;
its gradients are zero. The soft cap is applied before the bias so that an
additive ``-inf`` bias still masks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.precision import float32_log, soft_cap
from .masks import MaskSpec, dense_mask

HIGHEST = jax.lax.Precision.HIGHEST


def group_heads(x, k_heads: int):
    """``[Bx, N|1, Tx, Sx]`` → ``[Bx, K|1, G|1, Tx, Sx]``."""
    if x is None:
        return None
    bx, nx, tx, sx = x.shape
    if nx == 1:
        return x[:, :, None]
    return x.reshape(bx, k_heads, nx // k_heads, tx, sx)


def attention_forward_reference(q, k, v, bias, mask, sinks, q_pos, kv_pos, q_seg, kv_seg, *,
                                spec: MaskSpec, scale: float, logits_soft_cap: float | None,
                                precision=None):
    """Returns ``(out [B, T, N, Hv] in q.dtype, lse [B, N, T] float32)``."""
    b, t, n, h = q.shape
    kh = k.shape[2]
    g = n // kh
    precision = HIGHEST if precision is None else precision
    qf = q.astype(jnp.float32).reshape(b, t, kh, g, h)
    s = jnp.einsum("btkgh,bskh->bkgts", qf, k.astype(jnp.float32), precision=precision)
    s = s * jnp.float32(scale)
    if logits_soft_cap is not None:
        s = soft_cap(s, jnp.float32(logits_soft_cap))
    if bias is not None:
        s = s + group_heads(bias.astype(jnp.float32), kh)
    valid = dense_mask(spec, q_pos, kv_pos, q_seg, kv_seg)
    if valid is not None:
        valid = valid[:, None, None]
    if mask is not None:
        dense = group_heads(mask, kh)
        valid = dense if valid is None else jnp.logical_and(valid, dense)
    if valid is not None:
        s = jnp.where(valid, s, -jnp.inf)
    m = jnp.max(s, axis=-1)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(kh, g)[None, :, :, None]
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    p = jnp.exp(s - m[..., None])
    l = jnp.sum(p, axis=-1)
    if sinks is not None:
        l = l + jnp.exp(sink - m)
    o = jnp.einsum("bkgts,bskh->btkgh", p, v.astype(jnp.float32), precision=precision)
    l_safe = jnp.where(l > 0, l, 1.0)
    o = o / jnp.moveaxis(l_safe, -1, 1)[..., None]
    lse = jnp.where(l > 0, m + float32_log(l_safe), -jnp.inf)
    out = o.reshape(b, t, n, v.shape[-1]).astype(q.dtype)
    return out, lse.reshape(b, n, t)
