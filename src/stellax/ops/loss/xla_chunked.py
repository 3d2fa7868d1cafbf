"""The memory-linear XLA implementation of linear cross-entropy (``implementation="xla_chunked"``,
the default off a GPU): tokens in chunks of ``block_tokens`` (``lax.scan``), inside them the
vocabulary in chunks of ``block_vocab`` (an inner ``lax.scan``), never an array larger than
``[block_tokens, V]``:

- `forward_stats`: per vocabulary chunk the logits tile ``c = cap·tanh(x_c @ w_j / cap)``
  and the online log-sum-exp ``m' = max(m, max c)``, ``s' = s·e^{m−m'} + Σ e^{c−m'}``,
  plus the label's logit and the logit sum; ``lse = m + log s``;
- `backward` (its own op): per token chunk, per vocabulary chunk the logits
  tile again, ``dc = a·e^{c−lse} + b·onehot(y) + e``, ``dz = dc·(1 − (c/cap)²)``,
  and both gradients in the same pass: ``dx_c += dz @ w_jᵀ``, ``dw_j += x_cᵀ @ dz``;
- `fused_forward_backward` (a scalar loss under ``jax.grad``): per token
  chunk the forward pass keeps the chunk's logits tiles (``[block_tokens, V]``)
  and the gradient pass reuses them, so the whole step costs the three
  matmuls of the naive version (logits, dx, dw), not four.

A vocabulary that is not a multiple of ``block_vocab`` is covered by a last
chunk that starts at ``V − block_vocab`` (overlapping the previous one) with its
already-covered columns masked, so ``w`` is never padded or copied; the
token axis is padded (``x`` is small next to ``w``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.pallas import cdiv, pad_axis
from ...core.precision import float32_log, soft_cap
from .reference import HIGHEST
from .xla import gradients


def _layout(x, w, labels, transpose_w, config):
    """Token chunks of padded ``x``/labels, and the vocabulary chunk starts."""
    tokens = x.shape[0]
    vocab = w.shape[0] if transpose_w else w.shape[1]
    bt, bv = min(config.block_tokens, tokens), min(config.block_vocab, vocab)
    chunks = cdiv(tokens, bt)
    xs = pad_axis(x, 0, chunks * bt).reshape(chunks, bt, x.shape[1])
    ys = pad_axis(labels, 0, chunks * bt, value=-1).reshape(chunks, bt)
    return xs, ys, bv, vocab, cdiv(vocab, bv)


def _vocab_chunk(w, j, bv, vocab, transpose_w):
    """``(w_j, start, fresh)``: chunk ``j`` of the weights (``[D, bv]`` or ``[bv, D]``), its first
    column and the mask ``[bv]`` of columns no earlier chunk covered."""
    nominal = j * bv
    start = jnp.minimum(nominal, vocab - bv)
    axis = 0 if transpose_w else 1
    w_j = jax.lax.dynamic_slice_in_dim(w, start, bv, axis=axis)
    cols = start + jnp.arange(bv)
    return w_j, start, cols, cols >= nominal


def _tile(x_c, w_j, transpose_w, logit_soft_cap, precision):
    """The logits tile ``c [bt, bv]`` (float32 accumulation, soft-capped)."""
    z = jax.lax.dot_general(x_c, w_j, (((1,), (1 if transpose_w else 0,)), ((), ())),
                            precision=precision, preferred_element_type=jnp.float32)
    return soft_cap(z, logit_soft_cap, x_c.dtype, precision)


def _chunk_stats(x_c, y_c, w, *, bv, vocab, chunks, transpose_w, logit_soft_cap, precision, keep_tiles):
    """Online ``(lse, target, total)`` of one token chunk over the vocabulary chunks
    (and the chunk's logits tiles ``[chunks, bt, bv]`` when ``keep_tiles``)."""
    bt = x_c.shape[0]

    def step(carry, j):
        m, s, target, total = carry
        w_j, _, cols, fresh = _vocab_chunk(w, j, bv, vocab, transpose_w)
        c = _tile(x_c, w_j, transpose_w, logit_soft_cap, precision)
        live = jnp.where(fresh[None, :], c, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(live, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(live - m_new[:, None]), axis=1)
        target = target + jnp.sum(jnp.where((cols[None, :] == y_c[:, None]) & fresh[None, :], c, 0.0), axis=1)
        total = total + jnp.sum(jnp.where(fresh[None, :], c, 0.0), axis=1)
        return (m_new, s, target, total), (c if keep_tiles else None)

    zeros = jnp.zeros((bt,), jnp.float32)
    init = (jnp.full((bt,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    (m, s, target, total), tiles = jax.lax.scan(step, init, jnp.arange(chunks))
    return (m + float32_log(s), target, total), tiles


def forward_stats(x, w, labels, *, transpose_w, logit_soft_cap, config, precision=HIGHEST):
    """``(lse, target, total)`` float32 ``[T]``, memory ``O(block_tokens · block_vocab)``."""
    xs, ys, bv, vocab, chunks = _layout(x, w, labels, transpose_w, config)

    def per_chunk(args):
        stats, _ = _chunk_stats(*args, w, bv=bv, vocab=vocab, chunks=chunks, transpose_w=transpose_w,
                                logit_soft_cap=logit_soft_cap, precision=precision, keep_tiles=False)
        return stats

    stats = jax.lax.map(per_chunk, (xs, ys))
    return tuple(s.reshape(-1)[: x.shape[0]] for s in stats)


def _grad_tile(c, y_c, cols, fresh, lse, a, b, e, logit_soft_cap):
    """``dz [bt, bv]``: ``dc = a·e^{c−lse} + b·onehot(y) + e`` through the soft cap, 0 on covered columns."""
    dc = (a[:, None] * jnp.exp(c - lse[:, None]) + jnp.where(cols[None, :] == y_c[:, None], b[:, None], 0.0)
          + e[:, None])
    if logit_soft_cap is not None:
        dc = dc * (1.0 - jnp.square(c / logit_soft_cap))
    return jnp.where(fresh[None, :], dc, 0.0)


def _gradient_pass(x_c, y_c, w, dw, lse, a, b, e, tiles, *, bv, vocab, chunks, transpose_w, logit_soft_cap,
                   precision):
    """One token chunk's ``dx_c [bt, D]`` and ``dw`` (float32 carry) updated over the vocabulary
    chunks; logits tiles recomputed, or taken from ``tiles``."""
    axis = 0 if transpose_w else 1

    def step(carry, inputs):
        dx_c, dw = carry
        j, kept = inputs
        w_j, start, cols, fresh = _vocab_chunk(w, j, bv, vocab, transpose_w)
        c = _tile(x_c, w_j, transpose_w, logit_soft_cap, precision) if kept is None else kept
        dz = _grad_tile(c, y_c, cols, fresh, lse, a, b, e, logit_soft_cap)
        dx_j, dw_j = gradients(x_c, w_j, dz, transpose_w, precision)
        dw = jax.lax.dynamic_update_slice_in_dim(dw, jax.lax.dynamic_slice_in_dim(dw, start, bv, axis) + dw_j,
                                                 start, axis)
        return (dx_c + dx_j, dw), None

    init = (jnp.zeros(x_c.shape, jnp.float32), dw)
    (dx_c, dw), _ = jax.lax.scan(step, init, (jnp.arange(chunks), tiles))
    return dx_c, dw


def backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, transpose_w, logit_soft_cap,
             config, precision=HIGHEST):
    """``(dx [T, D], dw)`` float32, logits recomputed chunk by chunk; dx and dw in one pass."""
    xs, ys, bv, vocab, chunks = _layout(x, w, labels, transpose_w, config)
    n, bt = ys.shape
    per_token = [pad_axis(v, 0, n * bt).reshape(n, bt) for v in (lse, softmax_coef, target_coef, uniform_coef)]
    opts = dict(bv=bv, vocab=vocab, chunks=chunks, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap,
                precision=precision)

    def step(dw, inputs):
        x_c, y_c, lse_c, a, b, e = inputs
        dx_c, dw = _gradient_pass(x_c, y_c, w, dw, lse_c, a, b, e, None, **opts)
        return dw, dx_c

    dw, dx = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), (xs, ys, *per_token))
    return dx.reshape(-1, x.shape[1])[: x.shape[0]], dw


def fused_forward_backward(x, w, labels, coefficients_of, *, transpose_w, logit_soft_cap, config,
                           precision=HIGHEST):
    """Stats and the gradients of a scalar loss in one sweep over the token chunks.

    ``coefficients_of(lse_c, labels_c, rows_c) -> (a, b, e)`` gives one chunk's backward
    coefficients of a unit cotangent (they depend on the chunk's lse, known after its
    forward pass; ``rows_c`` is False on padding rows). Returns
    ``((lse, target, total), (dx [T, D] f32, dw f32))``."""
    xs, ys, bv, vocab, chunks = _layout(x, w, labels, transpose_w, config)
    n, bt = ys.shape
    rows = jnp.arange(n * bt).reshape(n, bt) < x.shape[0]
    opts = dict(bv=bv, vocab=vocab, chunks=chunks, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap,
                precision=precision)

    def step(dw, inputs):
        x_c, y_c, rows_c = inputs
        (lse, target, total), tiles = _chunk_stats(x_c, y_c, w, keep_tiles=True, **opts)
        a, b, e = coefficients_of(lse, y_c, rows_c)
        dx_c, dw = _gradient_pass(x_c, y_c, w, dw, lse, a, b, e, tiles, **opts)
        return dw, (lse, target, total, dx_c)

    dw, (lse, target, total, dx) = jax.lax.scan(step, jnp.zeros(w.shape, jnp.float32), (xs, ys, rows))
    stats = tuple(s.reshape(-1)[: x.shape[0]] for s in (lse, target, total))
    return stats, (dx.reshape(-1, x.shape[1])[: x.shape[0]], dw)

