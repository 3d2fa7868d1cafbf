"""Golden linear cross-entropy: the naive formula in float32, logits materialized.

For tokens ``x [T, D]``, weights ``w [D, V]`` (``[V, D]`` with ``transpose_w``)
and integer labels ``y [T]``:

    z     = x @ w                                    [T, V] logits
    c     = cap · tanh(z / cap)                      (soft cap, when given; else c = z)
    lse_t = log Σ_j exp(c_tj)
    loss_t = lse_t − (1 − ε)·c_{t,y_t} − (ε / V)·Σ_j c_tj + λ·lse_t²

which is ``(1 − ε)·(−log p_{t,y}) + ε·mean_j(−log p_tj) + λ·lse²`` (label
smoothing ε as in ``torch.nn.functional.cross_entropy``, z-loss λ as in PaLM).
Tokens whose label is ``ignore_index`` contribute 0 and are not counted by
``"mean"``; a label outside ``[0, V)`` gives a NaN loss.

The backward op's golden is the VJP of the scalar

    F(x, w) = Σ_t a_t·lse_t + b_t·c_{t,y_t} + e_t·Σ_j c_tj

with per-token coefficients ``a, b, e`` held constant: every cotangent of the
forward outputs (loss, lse, z-loss under any reduction) is such a triple
(`reduction.coefficients`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core import Call
from ...core.precision import float32_logsumexp, soft_cap
from .reduction import finalize

HIGHEST = jax.lax.Precision.HIGHEST


def logits(x, w, *, transpose_w: bool, logit_soft_cap):
    """``c [T, V]`` float32: ``x @ w`` (``x @ wᵀ`` with ``transpose_w``), soft-capped."""
    x, w = x.astype(jnp.float32), w.astype(jnp.float32)
    z = jnp.matmul(x, w.T if transpose_w else w, precision=HIGHEST)
    return soft_cap(z, logit_soft_cap)


def token_stats(c, labels):
    """``(lse, target, total)`` per token from ``c [T, V]``: the log-sum-exp, the
    label's logit (0 for a label outside ``[0, V)``) and the sum of the logits."""
    vocab = c.shape[-1]
    lse = float32_logsumexp(c, axis=-1)
    in_vocab = (labels >= 0) & (labels < vocab)
    safe = jnp.where(in_vocab, labels, 0)
    target = jnp.where(in_vocab, jnp.take_along_axis(c, safe[:, None], axis=1)[:, 0], 0.0)
    return lse, target, jnp.sum(c, axis=-1)


def _rows(call: Call):
    """``(x [T, D], labels [T])`` of a call whose ``x`` may have leading axes."""
    return call.x.reshape(-1, call.x.shape[-1]), call.labels.reshape(-1)


def linear_cross_entropy_reference(call: Call):
    """Golden `linear_cross_entropy` (float32, logits materialized)."""
    x, labels = _rows(call)
    c = logits(x, call.w, transpose_w=call.transpose_w, logit_soft_cap=call.logit_soft_cap)
    return finalize(call, *token_stats(c, labels), labels)


def linear_cross_entropy_backward_reference(call: Call):
    """Golden backward: ``(dx [T, D], dw)`` of ``F`` above, in the inputs' dtypes."""
    def objective(x, w):
        c = logits(x, w, transpose_w=call.transpose_w, logit_soft_cap=call.logit_soft_cap)
        lse, target, total = token_stats(c, call.labels)
        return jnp.sum(call.softmax_coef * lse + call.target_coef * target + call.uniform_coef * total)

    dx, dw = jax.grad(objective, argnums=(0, 1))(call.x.astype(jnp.float32), call.w.astype(jnp.float32))
    return dx.astype(call.x.dtype), dw.astype(call.w.dtype)
