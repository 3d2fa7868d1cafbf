"""Pallas Triton kernels for linear cross-entropy: the logits live only as
``[block_t, block_v]`` tiles in registers, never as a ``[T, V]`` buffer.

Every kernel builds a logits tile the same way (`_logits_tile`): for token rows
``r`` and vocabulary columns ``j``, ``z = Σ_k x[r, k] @ w[k, j]`` over the hidden
size in steps of ``block_d`` (masked loads, so no size needs to be a multiple of a
tile), then ``c = cap·tanh(z/cap)`` when soft-capped.

* forward, one program per token block, looping over vocabulary blocks with
  the online log-sum-exp ``m' = max(m, max_j c)``, ``s' = s·e^{m−m'} + Σ_j e^{c−m'}``;
  it also sums the label's logit and all logits: outputs ``lse = m + log s``,
  ``target``, ``total`` (float32 ``[T]``);
* backward, from ``lse`` and the per-token coefficients ``(a, b, e)``
  (`reduction.coefficients`): ``dc = a·e^{c−lse} + b·onehot(y) + e``, ``dz = dc·(1 − (c/cap)²)``;
  - ``dx`` kernel, program ``(token block, hidden block)``: ``dx += dz @ w[hidden, :]ᵀ``
    over the vocabulary blocks;
  - ``dw`` kernel, program ``(vocabulary block, hidden block)``: ``dw += x[:, hidden]ᵀ @ dz``
    over the token blocks.
  Each program owns its output tile and sums in a fixed order: deterministic,
  no atomics. The price is recomputing the logits tile in both kernels, once
  per hidden block of the output (``D / block_d`` times).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from ...core.pallas import cdiv, dot, dot_nt, dot_tn, iota, operand, output, triton_kernel_call, triton_precision
from .configs import LinearCrossEntropyConfig

#: Operands the kernels index themselves (masked loads of any tile).
HIGHEST = jax.lax.Precision.HIGHEST
_FULL = pl.no_block_spec


def _load(ref, row0, nrows, row_limit, col0, ncols, col_limit):
    """``ref[row0 : row0 + nrows, col0 : col0 + ncols]``, out-of-range elements read as 0."""
    rows, cols = row0 + iota(nrows), col0 + iota(ncols)
    mask = (rows < row_limit)[:, None] & (cols < col_limit)[None, :]
    return pltriton.load(ref.at[pl.ds(row0, nrows), pl.ds(col0, ncols)], mask=mask, other=0)


def _load_vector(ref, start, n, limit, other):
    """``ref[start : start + n]``, out-of-range elements read as ``other``."""
    return pltriton.load(ref.at[pl.ds(start, n)], mask=start + iota(n) < limit, other=other)


def _precision(precision, dtype):
    """The in-kernel precision of a resolved ``precision`` (`stellax.core.precision`): float32
    operands as `triton_precision` says (one TF32 pass at ``DEFAULT``, three otherwise);
    bf16/f16 the tensor core's native precision."""
    return triton_precision(precision) if jnp.dtype(dtype) == jnp.float32 else None


def _w_tile(w, col0, k0, *, dims):
    """The weight tile of vocabulary columns ``col0 …`` and hidden rows ``k0 …``:
    ``[block_d, block_v]`` (``[block_v, block_d]`` for ``[V, D]`` weights)."""
    cfg = dims["cfg"]
    if dims["transpose_w"]:
        return _load(w, col0, cfg.block_v, dims["vocab"], k0, cfg.block_d, dims["features"])
    return _load(w, k0, cfg.block_d, dims["features"], col0, cfg.block_v, dims["vocab"])


def _logits_tile(x, w, row0, col0, *, dims):
    """``c [block_t, block_v]`` float32: ``Σ_k x[rows, k] @ w[k, cols]``, soft-capped."""
    cfg, prec = dims["cfg"], dims["precision"]

    def step(kb, acc):
        k0 = kb * cfg.block_d
        xa = _load(x, row0, cfg.block_t, dims["tokens"], k0, cfg.block_d, dims["features"])
        wt = _w_tile(w, col0, k0, dims=dims)
        return acc + (dot_nt(xa, wt, precision=prec) if dims["transpose_w"] else dot(xa, wt, precision=prec))

    z = jax.lax.fori_loop(0, cdiv(dims["features"], cfg.block_d), step,
                          jnp.zeros((cfg.block_t, cfg.block_v), jnp.float32))
    cap = dims["cap"]
    return z if cap is None else cap * jnp.tanh(z / cap)


def _forward_kernel(*, x, w, labels, lse, target, total, dims):
    """Token block ``i``: online log-sum-exp, label logit and logit sum over the vocabulary blocks."""
    cfg, vocab = dims["cfg"], dims["vocab"]
    row0 = pl.program_id(0) * cfg.block_t
    y = _load_vector(labels, row0, cfg.block_t, dims["tokens"], -1)

    def step(j, carry):
        m, s, tgt, tot = carry
        col0 = j * cfg.block_v
        c = _logits_tile(x, w, row0, col0, dims=dims)
        cols = col0 + iota(cfg.block_v)
        col_ok = (cols < vocab)[None, :]
        live = jnp.where(col_ok, c, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(live, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(live - m_new[:, None]), axis=1)
        tgt = tgt + jnp.sum(jnp.where(cols[None, :] == y[:, None], c, 0.0), axis=1)
        tot = tot + jnp.sum(jnp.where(col_ok, c, 0.0), axis=1)
        return m_new, s, tgt, tot

    zeros = jnp.zeros((cfg.block_t,), jnp.float32)
    init = (jnp.full((cfg.block_t,), -jnp.inf, jnp.float32), zeros, zeros, zeros)
    m, s, tgt, tot = jax.lax.fori_loop(0, cdiv(vocab, cfg.block_v), step, init)
    lse[...] = m + jnp.log(s)
    target[...] = tgt
    total[...] = tot


def _grad_tile(x, w, labels, lse, a, b, e, row0, col0, *, dims):
    """``dz [block_t, block_v]`` float32 for token rows ``row0 …`` and columns ``col0 …``
    (0 outside the vocabulary and on padding rows, whose coefficients read as 0)."""
    cfg, tokens = dims["cfg"], dims["tokens"]
    c = _logits_tile(x, w, row0, col0, dims=dims)
    y = _load_vector(labels, row0, cfg.block_t, tokens, -1)
    lse_r = _load_vector(lse, row0, cfg.block_t, tokens, 0.0)
    a_r, b_r, e_r = (_load_vector(v, row0, cfg.block_t, tokens, 0.0) for v in (a, b, e))
    cols = col0 + iota(cfg.block_v)
    dc = (a_r[:, None] * jnp.exp(c - lse_r[:, None]) + jnp.where(cols[None, :] == y[:, None], b_r[:, None], 0.0)
          + e_r[:, None])
    cap = dims["cap"]
    if cap is not None:
        dc = dc * (1.0 - (c / cap) * (c / cap))
    return jnp.where((cols < dims["vocab"])[None, :], dc, 0.0)


def _dx_kernel(*, x, w, labels, lse, a, b, e, dx, dims):
    """Tile ``(token block i, hidden block k)``: ``dx = Σ_j dz_j @ w[k, j]ᵀ``."""
    cfg, prec = dims["cfg"], dims["precision"]
    row0, k0 = pl.program_id(0) * cfg.block_t, pl.program_id(1) * cfg.block_d

    def step(j, acc):
        col0 = j * cfg.block_v
        dz = _grad_tile(x, w, labels, lse, a, b, e, row0, col0, dims=dims).astype(w.dtype)
        wt = _w_tile(w, col0, k0, dims=dims)
        return acc + (dot(dz, wt, precision=prec) if dims["transpose_w"] else dot_nt(dz, wt, precision=prec))

    dx[...] = jax.lax.fori_loop(0, cdiv(dims["vocab"], cfg.block_v), step,
                                jnp.zeros((cfg.block_t, cfg.block_d), jnp.float32))


def _dw_kernel(*, x, w, labels, lse, a, b, e, dw, dims):
    """Tile ``(vocabulary block j, hidden block k)``: ``dw = Σ_i x[i, k]ᵀ @ dz_i``."""
    cfg, prec = dims["cfg"], dims["precision"]
    col0, k0 = pl.program_id(0) * cfg.block_v, pl.program_id(1) * cfg.block_d
    shape = (cfg.block_v, cfg.block_d) if dims["transpose_w"] else (cfg.block_d, cfg.block_v)

    def step(i, acc):
        row0 = i * cfg.block_t
        dz = _grad_tile(x, w, labels, lse, a, b, e, row0, col0, dims=dims).astype(x.dtype)
        xa = _load(x, row0, cfg.block_t, dims["tokens"], k0, cfg.block_d, dims["features"])
        return acc + (dot_tn(dz, xa, precision=prec) if dims["transpose_w"] else dot_tn(xa, dz, precision=prec))

    dw[...] = jax.lax.fori_loop(0, cdiv(dims["tokens"], cfg.block_t), step, jnp.zeros(shape, jnp.float32))


def _dims(x, w, *, transpose_w, logit_soft_cap, precision, config: LinearCrossEntropyConfig):
    tokens, features = x.shape
    vocab = w.shape[0] if transpose_w else w.shape[1]
    return dict(tokens=tokens, features=features, vocab=vocab, transpose_w=transpose_w, cap=logit_soft_cap,
                cfg=config, precision=_precision(precision, x.dtype))


def forward_stats(x, w, labels, *, transpose_w, logit_soft_cap, config: LinearCrossEntropyConfig,
                  precision=HIGHEST):
    """``x [T, D]``, ``w [D, V]`` (``[V, D]``), ``labels [T]`` → ``(lse, target, total)`` float32 ``[T]``."""
    dims = _dims(x, w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap, precision=precision,
                 config=config)
    tokens = dims["tokens"]
    vec = pl.BlockSpec((config.block_t,), lambda i: (i,))
    stat = lambda: output((tokens,), jnp.float32, vec)
    outs = triton_kernel_call(
        functools.partial(_forward_kernel, dims=dims), grid=(cdiv(tokens, config.block_t),),
        inputs=dict(x=operand(x, _FULL), w=operand(w, _FULL), labels=operand(labels.astype(jnp.int32), _FULL)),
        outputs=dict(lse=stat(), target=stat(), total=stat()),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_linear_cross_entropy_forward",
    )
    return outs.lse, outs.target, outs.total


def backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, transpose_w, logit_soft_cap,
             config: LinearCrossEntropyConfig, precision=HIGHEST):
    """``(dx [T, D], dw)`` float32: the ``dx`` kernel and the ``dw`` kernel (see the module docstring)."""
    dims = _dims(x, w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap, precision=precision,
                 config=config)
    tokens, features, vocab = dims["tokens"], dims["features"], dims["vocab"]
    inputs = dict(x=operand(x, _FULL), w=operand(w, _FULL), labels=operand(labels.astype(jnp.int32), _FULL),
                  lse=operand(lse, _FULL), a=operand(softmax_coef, _FULL), b=operand(target_coef, _FULL),
                  e=operand(uniform_coef, _FULL))
    common = dict(num_warps=config.num_warps, num_stages=config.num_stages)
    bd = config.block_d
    dx = triton_kernel_call(
        functools.partial(_dx_kernel, dims=dims), grid=(cdiv(tokens, config.block_t), cdiv(features, bd)),
        inputs=inputs,
        outputs=dict(dx=output((tokens, features), jnp.float32,
                               pl.BlockSpec((config.block_t, bd), lambda i, k: (i, k)))),
        name="stellax_linear_cross_entropy_dx", **common,
    ).dx
    if transpose_w:
        dw_spec = pl.BlockSpec((config.block_v, bd), lambda j, k: (j, k))
    else:
        dw_spec = pl.BlockSpec((bd, config.block_v), lambda j, k: (k, j))
    dw = triton_kernel_call(
        functools.partial(_dw_kernel, dims=dims), grid=(cdiv(vocab, config.block_v), cdiv(features, bd)),
        inputs=inputs, outputs=dict(dw=output(w.shape, jnp.float32, dw_spec)),
        name="stellax_linear_cross_entropy_dw", **common,
    ).dw
    return dx, dw

