"""Memory-linear attention in plain XLA: online softmax over key blocks.

Forward, for each query block (``lax.map``) over only the key blocks it can
see (``lax.fori_loop`` from ``lo`` to ``hi`` of the mask's `visit_schedule`;
empty blocks are never visited), with running max ``m``, normalizer ``l``
and accumulator ``acc`` (float32):

    s     = mask(scale · q_i·k_jᵀ → soft cap → + bias)
    m'    = max(m, rowmax(s));  α = exp(m - m')
    l     = α·l + rowsum(exp(s - m'));  acc = α·acc + exp(s - m')·v_j
    out   = acc / l,  lse = m + log(l)      (sinks join l at the end)

Nothing of size T×S is materialized: peak memory is O(block_q·block_k) for
the logits plus the O(T) inputs and outputs.

Backward (the custom VJP recomputes), with ``delta = rowsum(dO·O) - dlse``
and per visible block (i, j):

    p  = exp(s - lse);  dp = dO_i·v_jᵀ;  ds = p·(dp - delta);  dbias_ij = ds
    ds *= scale · (1 - tanh²) [soft cap]
    pass 1, per query block over its key blocks:   dq_i += ds·k_j
    pass 2, per key block over its query blocks:   dv_j += pᵀ·dO_i;  dk_j += dsᵀ·q_i
    dsinks = -Σ exp(sink - lse)·delta

Every sum runs in a fixed order: the result is deterministic.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ...core.pallas import cdiv, pad_axis
from ...core.precision import float32_log, soft_cap_tanh
from .masks import MaskSpec, classify_blocks, mask_fn, visit_schedule

F32 = jnp.float32


class _Layout:
    """Operands in the block-friendly layout ``[B, K, T, G, H]`` (q rows of a
    kv head's group side by side, so a q block is one batched matmul)."""

    def __init__(self, c, block_q: int, block_k: int):
        q, k, v = c.q, c.k, c.v
        self.b, self.t, self.n, self.h = q.shape
        self.s, self.kh = k.shape[1:3]
        self.hv = v.shape[-1]
        self.g = self.n // self.kh
        self.bq = min(block_q, self.t)
        self.bk = min(block_k, self.s)
        self.nq, self.nk = cdiv(self.t, self.bq), cdiv(self.s, self.bk)
        self.tp, self.sp = self.nq * self.bq, self.nk * self.bk
        self.spec: MaskSpec = c.spec
        self.scale = c.scale
        self.cap = c.logits_soft_cap
        self.precision = c.precision
        self.tanh = soft_cap_tanh(q.dtype, c.precision)
        self.q = pad_axis(self.to_rows(q), 2, self.tp)
        self.k = pad_axis(k.transpose(0, 2, 1, 3), 2, self.sp)
        self.v = pad_axis(v.transpose(0, 2, 1, 3), 2, self.sp)
        self.q_pos = pad_axis(c.q_pos, 1, self.tp)
        self.kv_pos = pad_axis(c.kv_pos, 1, self.sp)
        self.q_seg = None if c.q_seg is None else pad_axis(c.q_seg, 1, self.tp)
        self.kv_seg = None if c.kv_seg is None else pad_axis(c.kv_seg, 1, self.sp)
        self.bias = self._grouped(c.bias, 0.0)
        self.mask = self._grouped(c.mask, False)
        classes = classify_blocks(c.spec, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg, block_q=self.bq,
                                  block_k=self.bk)
        self.classes = classes

    def to_rows(self, x):
        """``[B, T, N, D]`` → ``[B, K, T, G, D]``."""
        b, t, n, d = x.shape
        return x.reshape(b, t, self.kh, self.g, d).transpose(0, 2, 1, 3, 4)

    def from_rows(self, x):
        """``[B, K, Tp, G, D]`` → ``[B, T, N, D]``."""
        b, kh, tp, g, d = x.shape
        return x.transpose(0, 2, 1, 3, 4).reshape(b, tp, kh * g, d)[:, :self.t]

    def _grouped(self, x, pad_value):
        """``[Bx, N|1, T|1, S|1]`` → ``[Bx, K|1, Tp|1, G|1, Sp|1]``."""
        if x is None:
            return None
        bx, nx, tx, sx = x.shape
        if nx == 1:
            x = x[:, :, None]
        else:
            x = x.reshape(bx, self.kh, self.g, tx, sx)
        x = x.transpose(0, 1, 3, 2, 4)
        if tx > 1:
            x = pad_axis(x, 2, self.tp, pad_value)
        if sx > 1:
            x = pad_axis(x, 4, self.sp, pad_value)
        return x

    # -- per block pieces ------------------------------------------------------
    def q_rows(self, x, i, size_d):
        """Block ``i`` of a ``[B, K, Tp, G, D]`` array as ``[B, K, bq·G, D]``."""
        blk = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=2)
        return blk.reshape(self.b, self.kh, self.bq * self.g, size_d)

    def stat_rows(self, x, i):
        """Block ``i`` of a ``[B, K, Tp, G]`` array as ``[B, K, bq·G]``."""
        blk = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=2)
        return blk.reshape(self.b, self.kh, self.bq * self.g)

    def _slice_dense(self, x, i, j):
        if x.shape[2] > 1:
            x = lax.dynamic_slice_in_dim(x, i * self.bq, self.bq, axis=2)
        if x.shape[4] > 1:
            x = lax.dynamic_slice_in_dim(x, j * self.bk, self.bk, axis=4)
        return x

    def logits(self, qi, i, j):
        """Masked logits ``[B, K, bq, G, bk]`` (float32) and the soft-cap tanh (or None)."""
        kj = lax.dynamic_slice_in_dim(self.k, j * self.bk, self.bk, axis=2)
        s = jnp.einsum("bkqh,bksh->bkqs", qi, kj, precision=self.precision,
                       preferred_element_type=jnp.float32)
        s = s.reshape(self.b, self.kh, self.bq, self.g, self.bk) * jnp.float32(self.scale)
        tanh = None
        if self.cap is not None:
            tanh = self.tanh(s * jnp.float32(1.0 / self.cap))
            s = jnp.float32(self.cap) * tanh
        if self.bias is not None:
            s = s + self._slice_dense(self.bias, i, j).astype(jnp.float32)
        valid = self.valid(i, j)
        if valid is not None:
            s = jnp.where(valid, s, -jnp.inf)
        return s, tanh

    def valid(self, i, j):
        qp = lax.dynamic_slice_in_dim(self.q_pos, i * self.bq, self.bq, axis=1)
        kp = lax.dynamic_slice_in_dim(self.kv_pos, j * self.bk, self.bk, axis=1)
        qs = ks = None
        if self.spec.segments:
            qs = lax.dynamic_slice_in_dim(self.q_seg, i * self.bq, self.bq, axis=1)[:, :, None]
            ks = lax.dynamic_slice_in_dim(self.kv_seg, j * self.bk, self.bk, axis=1)[:, None, :]
        ok = mask_fn(self.spec, qp[:, :, None], kp[:, None, :], qs, ks)
        if self.s % self.bk:
            in_range = (j * self.bk + jnp.arange(self.bk) < self.s)[None, None, :]
            ok = in_range if ok is None else jnp.logical_and(ok, in_range)
        if ok is not None:
            ok = ok[:, None, :, None, :]  # [Bp, 1, bq, 1, bk]
        if self.mask is not None:
            dense = self._slice_dense(self.mask, i, j)
            ok = dense if ok is None else jnp.logical_and(ok, dense)
        return ok

    def flat(self, s):
        return s.reshape(self.b, self.kh, self.bq * self.g, self.bk)


def _bounds(schedule):
    """Per-row ``(lo, hi)`` over the batch: ``[Bc, n, 4]`` → ``([n], [n])``."""
    lo = jnp.min(schedule[..., 0], axis=0)
    hi = jnp.max(schedule[..., 3], axis=0)
    return lo, jnp.maximum(hi, lo)


def forward(c, config):
    """``(out [B, T, N, Hv], lse [B, N, T] float32)``. fp8 attention: q/k/v are
    dequantized to the output dtype first."""
    c = c.dequantized()
    L = _Layout(c, config.block_q, config.block_k)
    lo, hi = _bounds(visit_schedule(L.classes))
    rows = L.bq * L.g

    def q_block(i):
        qi = L.q_rows(L.q, i, L.h)

        def body(j, carry):
            acc, m, l = carry
            s, _ = L.logits(qi, i, j)
            s = L.flat(s)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            p = jnp.exp(s - m_safe[..., None])
            alpha = jnp.exp(m - m_safe)
            vj = lax.dynamic_slice_in_dim(L.v, j * L.bk, L.bk, axis=2)
            pv = jnp.einsum("bkqs,bksh->bkqh", p, vj,
                            precision=L.precision, preferred_element_type=jnp.float32)
            return alpha[..., None] * acc + pv, m_new, alpha * l + jnp.sum(p, axis=-1)

        init = (jnp.zeros((L.b, L.kh, rows, L.hv), jnp.float32),
                jnp.full((L.b, L.kh, rows), -jnp.inf, jnp.float32), jnp.zeros((L.b, L.kh, rows), jnp.float32))
        acc, m, l = lax.fori_loop(lo[i], hi[i], body, init)
        if c.sinks is not None:
            sink = jnp.broadcast_to(c.sinks.astype(jnp.float32).reshape(1, L.kh, 1, L.g),
                                    (L.b, L.kh, L.bq, L.g)).reshape(L.b, L.kh, rows)
            m_new = jnp.maximum(m, sink)
            alpha = jnp.exp(m - m_new)
            acc, l, m = alpha[..., None] * acc, alpha * l + jnp.exp(sink - m_new), m_new
        l_safe = jnp.where(l > 0, l, 1.0)
        out = acc / l_safe[..., None]
        lse = jnp.where(l > 0, jnp.where(m == -jnp.inf, 0.0, m) + float32_log(l_safe), -jnp.inf)
        return (out.reshape(L.b, L.kh, L.bq, L.g, L.hv).astype(c.q.dtype),
                lse.reshape(L.b, L.kh, L.bq, L.g))

    if L.nq == 1:
        outs, lses = jax.tree_util.tree_map(lambda x: x[None], q_block(jnp.int32(0)))
    else:
        outs, lses = lax.map(q_block, jnp.arange(L.nq, dtype=jnp.int32))
    # [nq, B, K, bq, G, D] → [B, K, Tp, G, D]
    outs = jnp.moveaxis(outs, 0, 2).reshape(L.b, L.kh, L.tp, L.g, L.hv)
    lses = jnp.moveaxis(lses, 0, 2).reshape(L.b, L.kh, L.tp, L.g)
    out = L.from_rows(outs)
    lse = lses.transpose(0, 1, 3, 2).reshape(L.b, L.n, L.tp)[:, :, :L.t]
    return out, lse


class _Stats(NamedTuple):
    """The backward's per-row operands in the ``[B, K, Tp, G, ·]`` layout:
    ``d_out``, ``lse`` (``+inf`` for a fully masked row, so ``p = 0``) and
    ``delta = rowsum(dO·O) - dlse``; ``delta_bt`` is ``delta`` as ``[B, T, N]``."""

    d_out: Any
    lse: Any
    delta: Any
    delta_bt: Any

    @classmethod
    def of(cls, L: _Layout, out, lse, d_out, d_lse) -> "_Stats":
        delta = jnp.sum(d_out.astype(F32) * out.astype(F32), axis=-1)  # [B, T, N]
        if d_lse is not None:
            delta = delta - jnp.swapaxes(d_lse.astype(F32), 1, 2)
        lse_bt = jnp.swapaxes(lse, 1, 2)  # [B, T, N]
        lse_safe = jnp.where(lse_bt == -jnp.inf, jnp.inf, lse_bt)
        to_stats = lambda x, fill: pad_axis(
            x.reshape(L.b, L.t, L.kh, L.g).transpose(0, 2, 1, 3), 2, L.tp, fill)  # [B, K, Tp, G]
        return cls(pad_axis(L.to_rows(d_out), 2, L.tp), to_stats(lse_safe, jnp.inf), to_stats(delta, 0.0), delta)

    def probs(self, L: _Layout, qi, doi, i, j, vj):
        """``p``, ``ds`` (before scale/soft cap) and the soft-cap tanh of block (i, j)."""
        s, tanh = L.logits(qi, i, j)
        p = jnp.exp(L.flat(s) - L.stat_rows(self.lse, i)[..., None])  # [B, K, rows, bk]
        dp = jnp.einsum("bkqh,bksh->bkqs", doi, vj, precision=L.precision, preferred_element_type=F32)
        return p, p * (dp - L.stat_rows(self.delta, i)[..., None]), tanh


def _scaled(L: _Layout, ds, tanh):
    if tanh is not None:
        ds = ds * L.flat(1.0 - tanh * tanh)
    return ds * F32(L.scale)


def _dq_pass(L: _Layout, st: _Stats):
    """Pass 1: ``dq`` ``[B, T, N, H]`` (float32) and the bias gradient in the
    grouped layout ``[nq, Bb, K|1, bq|1, G|1, Sp|1]`` (or None), per query
    block over its visible key blocks."""
    lo, hi = _bounds(visit_schedule(L.classes))
    has_bias = L.bias is not None
    bias_shape = L.bias.shape if has_bias else None
    dbias_rows = None
    if has_bias:
        dbias_rows = (bias_shape[0], bias_shape[1], L.bq if bias_shape[2] > 1 else 1, bias_shape[3], bias_shape[4])

    def accumulate_dbias(dbias, ds, j):
        blk = ds.reshape(L.b, L.kh, L.bq, L.g, L.bk)
        axes = tuple(a for a, (full, got) in enumerate(zip(blk.shape, dbias_rows)) if got == 1 and full > 1)
        blk = jnp.sum(blk, axis=axes, keepdims=True) if axes else blk
        if bias_shape[4] == 1:
            return dbias + blk
        cur = lax.dynamic_slice_in_dim(dbias, j * L.bk, L.bk, axis=4)
        return lax.dynamic_update_slice_in_dim(dbias, cur + blk, j * L.bk, axis=4)

    def q_block(i):
        qi = L.q_rows(L.q, i, L.h)
        doi = L.q_rows(st.d_out, i, L.hv)

        def body(j, carry):
            dq, dbias = carry
            kj = lax.dynamic_slice_in_dim(L.k, j * L.bk, L.bk, axis=2)
            vj = lax.dynamic_slice_in_dim(L.v, j * L.bk, L.bk, axis=2)
            _, ds, tanh = st.probs(L, qi, doi, i, j, vj)
            if has_bias:
                dbias = accumulate_dbias(dbias, ds, j)
            dq = dq + jnp.einsum("bkqs,bksh->bkqh", _scaled(L, ds, tanh), kj, precision=L.precision,
                                 preferred_element_type=F32)
            return dq, dbias

        init = (jnp.zeros((L.b, L.kh, L.bq * L.g, L.h), F32), jnp.zeros(dbias_rows, F32) if has_bias else None)
        dq, dbias = lax.fori_loop(lo[i], hi[i], body, init)
        return dq.reshape(L.b, L.kh, L.bq, L.g, L.h), dbias

    dq, dbias = lax.map(q_block, jnp.arange(L.nq, dtype=jnp.int32))  # [nq, ...]
    return L.from_rows(jnp.moveaxis(dq, 0, 2).reshape(L.b, L.kh, L.tp, L.g, L.h)), dbias


def _dkdv_pass(L: _Layout, st: _Stats):
    """Pass 2: ``dk [B, S, K, H]``, ``dv [B, S, K, Hv]`` (float32), per key
    block over the query blocks that see it."""
    lo, hi = _bounds(visit_schedule(jnp.swapaxes(L.classes, 1, 2)))

    def k_block(j):
        vj = lax.dynamic_slice_in_dim(L.v, j * L.bk, L.bk, axis=2)

        def body(i, carry):
            dk, dv = carry
            qi = L.q_rows(L.q, i, L.h)
            doi = L.q_rows(st.d_out, i, L.hv)
            p, ds, tanh = st.probs(L, qi, doi, i, j, vj)
            dv = dv + jnp.einsum("bkqs,bkqh->bksh", p, doi, precision=L.precision, preferred_element_type=F32)
            dk = dk + jnp.einsum("bkqs,bkqh->bksh", _scaled(L, ds, tanh), qi, precision=L.precision,
                                 preferred_element_type=F32)
            return dk, dv

        init = (jnp.zeros((L.b, L.kh, L.bk, L.h), F32), jnp.zeros((L.b, L.kh, L.bk, L.hv), F32))
        return lax.fori_loop(lo[j], hi[j], body, init)

    dk, dv = lax.map(k_block, jnp.arange(L.nk, dtype=jnp.int32))
    # [nk, B, K, bk, D] → [B, S, K, D]
    unblock = lambda x, d: jnp.moveaxis(x, 0, 2).reshape(L.b, L.kh, L.sp, d)[:, :, :L.s].transpose(0, 2, 1, 3)
    return unblock(dk, L.h), unblock(dv, L.hv)


def _dbias(L: _Layout, bias, dbias):
    """The grouped bias gradient of `_dq_pass` → ``bias``'s shape ``[Bx, N|1, T|1, S|1]``."""
    if bias is None:
        return None
    # [nq, Bb, K|1, bq|1, G|1, Sp|1] → [Bb, K|1, Tp|1, G|1, Sp|1]
    if L.bias.shape[2] > 1:
        dbias = jnp.moveaxis(dbias, 0, 2).reshape(L.bias.shape)
    else:
        dbias = jnp.sum(dbias, axis=0)
    bx, nx, tx, sx = bias.shape
    db = dbias.transpose(0, 1, 3, 2, 4)[..., :tx, :sx]  # [Bb, K|1, G|1, Tb, Sb]
    return db.reshape(bx, nx, tx, sx).astype(bias.dtype)


def backward(c, out, lse, d_out, d_lse, config):
    """``(dq, dk, dv, dbias, dsinks)`` in the operands' dtypes.

    Two passes (each recomputes the probabilities of its blocks): dq and dbias
    per query block over its key blocks, then dk/dv per key block over its
    query blocks; no scattered accumulation."""
    L = _Layout(c, config.block_q, config.block_k)
    st = _Stats.of(L, out, lse, d_out, d_lse)
    dq, dbias = _dq_pass(L, st)
    dk, dv = _dkdv_pass(L, st)
    dsinks = None
    if c.sinks is not None:
        p_sink = jnp.exp(c.sinks.astype(F32)[None, None, :] - jnp.swapaxes(lse, 1, 2))  # [B, T, N]
        dsinks = (-jnp.sum(p_sink * st.delta_bt, axis=(0, 1))).astype(c.sinks.dtype)
    return (dq.astype(c.q.dtype), dk.astype(c.k.dtype), dv.astype(c.v.dtype), _dbias(L, c.bias, dbias), dsinks)
