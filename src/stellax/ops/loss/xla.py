"""The ``"xla"`` implementation of linear cross-entropy: the reference formula on the
full ``[T, V]`` logits, differentiated by JAX — the baseline, memory ``O(T·V)``. The
memory-linear XLA path is `xla_chunked`."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.precision import soft_cap
from .reference import HIGHEST, token_stats


def _naive_logits(x, w, *, transpose_w, logit_soft_cap, precision):
    z = jax.lax.dot_general(x, w, (((1,), (1 if transpose_w else 0,)), ((), ())),
                            precision=precision, preferred_element_type=jnp.float32)
    return soft_cap(z, logit_soft_cap, x.dtype, precision)


def forward_stats(x, w, labels, *, transpose_w, logit_soft_cap, precision=HIGHEST, config=None):
    """``(lse, target, total)`` from the full logits (JAX autodiff through it)."""
    del config
    return token_stats(_naive_logits(x, w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap,
                                     precision=precision), labels)


def backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, transpose_w, logit_soft_cap,
             precision=HIGHEST, config=None):
    """``(dx, dw)`` from the full ``[T, V]`` gradient of the logits."""
    del config
    c = _naive_logits(x, w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap, precision=precision)
    vocab = c.shape[1]
    onehot = jnp.arange(vocab)[None, :] == labels[:, None]
    dc = (softmax_coef[:, None] * jnp.exp(c - lse[:, None]) + jnp.where(onehot, target_coef[:, None], 0.0)
          + uniform_coef[:, None])
    dz = dc if logit_soft_cap is None else dc * (1.0 - jnp.square(c / logit_soft_cap))
    return gradients(x, w, dz, transpose_w, precision)


def gradients(x, w, dz, transpose_w, prec):
    """``(dx = dz @ wᵀ, dw = xᵀ @ dz)`` (``dw = dzᵀ @ x`` for ``[V, D]`` weights), float32."""
    dzc = dz.astype(x.dtype)
    dx = jax.lax.dot_general(dzc, w, (((1,), (0 if transpose_w else 1,)), ((), ())), precision=prec,
                             preferred_element_type=jnp.float32)
    if transpose_w:
        dw = jax.lax.dot_general(dzc, x, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
    else:
        dw = jax.lax.dot_general(x, dzc, (((0,), (0,)), ((), ())), precision=prec, preferred_element_type=jnp.float32)
    return dx, dw
