"""Pallas Mosaic TPU kernels for linear cross-entropy: the logits exist only as
``[bt, bv]`` float32 tiles in VMEM, never as a ``[T, V]`` array in HBM.

Every kernel builds a logits tile the same way (`_Tiles.logits`): token rows
``i`` (a ``[bt, D]`` block, the whole hidden size) against vocabulary columns
``j`` (a ``[D, bv]`` weight tile, ``[bv, D]`` for ``[V, D]`` weights), one MXU
contraction over ``D`` with float32 accumulation, then ``c = cap·tanh(z/cap)``
when soft-capped.

* forward, grid ``(T/bt parallel, V/bv arbitrary)``: the token block stays in
  VMEM while the weight tiles stream past it; per tile the online log-sum-exp

      m' = max(m, rowmax c);   s = s·e^{m−m'} + Σ_j e^{c_j−m'};   m = m'

  plus the label's logit (picked up in the tile that holds it) and the logit
  sum; the last tile writes ``lse = m + log s``, ``target``, ``total`` (float32
  ``[T]``);
* backward, from ``lse`` and the per-token coefficients ``(a, b, e)``
  (`base.coefficients`), the logits tile recomputed and

      dc = a·e^{c−lse} + b·onehot(y) + e,   dz = dc·(1 − (c/cap)²)

  - ``dx`` kernel, grid ``(T/bt parallel, V/bv arbitrary)``: ``dx += dz @ wᵀ``
    over the vocabulary tiles in a ``[bt, D]`` float32 VMEM accumulator;
  - ``dw`` kernel, grid ``(V/bv parallel, T/bt arbitrary)``: ``dw += xᵀ @ dz``
    over the token blocks in a ``[D, bv]`` float32 VMEM accumulator.

  Every sum runs in a fixed order (deterministic, no atomics). The price is the
  logits recomputed in both kernels: a training step costs five ``2·T·D·V``
  matmuls (forward 1, ``dx`` 2, ``dw`` 2) where the full-logits version
  differentiated by JAX costs three (it keeps the ``[T, V]`` logits), and on a
  v5e forward + backward is 0.79x that version (docs/loss.md).

Ragged edges: a partial last vocabulary tile reads columns past ``V``; they are
excluded from every sum (``-inf`` in the max and exponentials, 0 in the sums
and in ``dz``) and, in the ``dx`` kernel, zeroed in the weight tile itself (a
stale NaN times a zero ``dz`` would still be NaN). A partial last token block
reads rows past ``T``: their outputs are never written back, and the ``dw``
kernel zeroes them in ``x`` and ``dz`` before they enter its sum.

Precision (`stellax.core.precision`): bfloat16 operands go to the MXU as they
are (``dz`` rounded to bfloat16 for the gradient products), float32 operands at
the call's resolved precision (`mxu_dot`: one or three bfloat16 passes, or
Mosaic's ``fp32``); at ``HIGHEST`` the soft cap's ``tanh`` and the exponentials
are `float32_tanh` / `float32_exp`, the row's log is always `float32_log`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import mxu_dot, mxu_dot_nt, mxu_dot_tn, operand, output, tpu_kernel_call
from ...core.precision import HIGHEST, accurate_functions, float32_exp, float32_log, soft_cap_tanh
from .configs import LossTpuConfig, loss_tpu_vmem_bytes, loss_tpu_vmem_limit, tpu_tile

F32 = jnp.float32


class _Tiles:
    """The sizes of one launch and the tile math every kernel shares."""

    def __init__(self, x, w, *, transpose_w, logit_soft_cap, precision, config: LossTpuConfig):
        self.tokens, self.features = x.shape
        self.vocab = w.shape[0] if transpose_w else w.shape[1]
        self.bt, self.bv = tpu_tile(self.tokens, config.block_t), tpu_tile(self.vocab, config.block_v)
        self.nt, self.nv = pl.cdiv(self.tokens, self.bt), pl.cdiv(self.vocab, self.bv)
        self.ragged_t, self.ragged_v = self.tokens % self.bt != 0, self.vocab % self.bv != 0
        self.transpose_w = transpose_w
        self.cap = logit_soft_cap
        self.precision = precision
        self.dtype = x.dtype
        self.tanh = soft_cap_tanh(x.dtype, precision)
        self.exp = float32_exp if accurate_functions(x.dtype, precision) else jnp.exp
        need = loss_tpu_vmem_bytes(self.tokens, self.features, self.vocab, x.dtype.itemsize, config)
        self.vmem_limit = loss_tpu_vmem_limit(need)

    # -- block specs (``v_axis`` / ``t_axis``: which grid index walks V / T) ------------------
    def x_spec(self, t_axis: int):
        return pl.BlockSpec((self.bt, self.features), lambda *g: (g[t_axis], 0))

    def w_spec(self, v_axis: int):
        if self.transpose_w:
            return pl.BlockSpec((self.bv, self.features), lambda *g: (g[v_axis], 0))
        return pl.BlockSpec((self.features, self.bv), lambda *g: (0, g[v_axis]))

    def vector_spec(self, t_axis: int):
        return pl.BlockSpec((self.bt, 1), lambda *g: (g[t_axis], 0))

    # -- tile math ------------------------------------------------------------------------
    def columns(self, j):
        """``[1, bv]`` vocabulary indices of tile ``j``."""
        return jax.lax.broadcasted_iota(jnp.int32, (1, self.bv), 1) + j * self.bv

    def row_mask(self, i):
        """``[bt, 1]``: rows of token block ``i`` inside ``T``."""
        return jax.lax.broadcasted_iota(jnp.int32, (self.bt, 1), 0) < self.tokens - i * self.bt

    def weights(self, w, j):
        """Weight tile ``j`` with its columns past ``V`` zeroed (when ``V`` is ragged)."""
        if not self.ragged_v:
            return w
        shape, axis = ((self.bv, 1), 0) if self.transpose_w else ((1, self.bv), 1)
        keep = jax.lax.broadcasted_iota(jnp.int32, shape, axis) < self.vocab - j * self.bv
        return jnp.where(keep, w, jnp.zeros_like(w))

    def logits(self, x, w):
        """``(c, tanh(z/cap) or None)``: the soft-capped float32 logits tile ``[bt, bv]``."""
        z = (mxu_dot_nt if self.transpose_w else mxu_dot)(x, w, self.precision)
        if self.cap is None:
            return z, None
        th = self.tanh(z * (1.0 / self.cap))
        return self.cap * th, th

    def dz(self, x, w, j, *, labels, lse, a, b, e):
        """``dz [bt, bv]`` float32 (0 on columns past ``V``)."""
        c, th = self.logits(x, w)
        cols = self.columns(j)
        dc = (a[...] * self.exp(c - lse[...]) + jnp.where(cols == labels[...], b[...], 0.0) + e[...])
        if th is not None:
            dc = dc * (1.0 - th * th)
        if self.ragged_v:
            dc = jnp.where(cols < self.vocab, dc, 0.0)
        return dc

    def dx_update(self, dz, w):
        """``dz [bt, bv] @ w_tileᵀ`` → ``[bt, D]``."""
        return (mxu_dot if self.transpose_w else mxu_dot_nt)(dz.astype(self.dtype), w, self.precision)

    def dw_update(self, x, dz):
        """``x [bt, D]ᵀ @ dz`` as the weight tile's layout (``[D, bv]`` or ``[bv, D]``)."""
        dz = dz.astype(self.dtype)
        return mxu_dot_tn(dz, x, self.precision) if self.transpose_w else mxu_dot_tn(x, dz, self.precision)


# -- kernel bodies -------------------------------------------------------------------------
def _forward_kernel(*, x, w, labels, lse, target, total, m_run, s_run, tgt_run, tot_run, t: _Tiles):
    """Token block ``i``, vocabulary tile ``j``: one online log-sum-exp step."""
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        m_run[...] = jnp.full(m_run.shape, -jnp.inf, F32)
        for ref in (s_run, tgt_run, tot_run):
            ref[...] = jnp.zeros(ref.shape, F32)

    c, _ = t.logits(x[...], w[...])
    cols = t.columns(j)
    if t.ragged_v:
        valid = cols < t.vocab
        live, counted = jnp.where(valid, c, -jnp.inf), jnp.where(valid, c, 0.0)
    else:
        live = counted = c
    m_prev = m_run[...]
    m_new = jnp.maximum(m_prev, jnp.max(live, axis=1, keepdims=True))
    s_run[...] = s_run[...] * t.exp(m_prev - m_new) + jnp.sum(t.exp(live - m_new), axis=1, keepdims=True)
    m_run[...] = m_new
    tgt_run[...] += jnp.sum(jnp.where(cols == labels[...], counted, 0.0), axis=1, keepdims=True)
    tot_run[...] += jnp.sum(counted, axis=1, keepdims=True)

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        lse[...] = m_run[...] + float32_log(s_run[...])
        target[...] = tgt_run[...]
        total[...] = tot_run[...]


def _dx_kernel(*, x, w, labels, lse, a, b, e, dx, acc, t: _Tiles):
    """Token block ``i``, vocabulary tile ``j``: ``dx += dz @ w_jᵀ``."""
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, F32)

    w_tile = t.weights(w[...], j)
    dz = t.dz(x[...], w_tile, j, labels=labels, lse=lse, a=a, b=b, e=e)
    acc[...] += t.dx_update(dz, w_tile)

    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        dx[...] = acc[...].astype(dx.dtype)


def _dw_kernel(*, x, w, labels, lse, a, b, e, dw, acc, t: _Tiles):
    """Vocabulary tile ``j``, token block ``i``: ``dw_j += x_iᵀ @ dz``."""
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        acc[...] = jnp.zeros(acc.shape, F32)

    xa = x[...]
    if t.ragged_t:
        rows = t.row_mask(i)
        xa = jnp.where(rows, xa, jnp.zeros_like(xa))
    dz = t.dz(xa, w[...], j, labels=labels, lse=lse, a=a, b=b, e=e)
    if t.ragged_t:
        dz = jnp.where(rows, dz, 0.0)
    acc[...] += t.dw_update(xa, dz)

    @pl.when(i == pl.num_programs(1) - 1)
    def _store():
        dw[...] = acc[...].astype(dw.dtype)


# -- entry points (see `base`) -------------------------------------------------------------------
def _column(v, dtype):
    return v.reshape(-1, 1).astype(dtype)


def forward_stats(x, w, labels, *, transpose_w, logit_soft_cap, config: LossTpuConfig, precision=HIGHEST):
    """``x [T, D]``, ``w [D, V]`` (``[V, D]``), ``labels [T]`` → ``(lse, target, total)`` float32 ``[T]``."""
    t = _Tiles(x, w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap, precision=precision, config=config)
    vec = t.vector_spec(0)
    stat = lambda: output((t.tokens, 1), F32, vec)
    outs = tpu_kernel_call(
        functools.partial(_forward_kernel, t=t), grid=(t.nt, t.nv), dimension_semantics=("parallel", "arbitrary"),
        name="stellax_linear_cross_entropy_forward_tpu",
        inputs=dict(x=operand(x, t.x_spec(0)), w=operand(w, t.w_spec(1)),
                    labels=operand(_column(labels, jnp.int32), vec)),
        outputs=dict(lse=stat(), target=stat(), total=stat()),
        scratch={name: pltpu.VMEM((t.bt, 1), F32) for name in ("m_run", "s_run", "tgt_run", "tot_run")},
        vmem_limit_bytes=t.vmem_limit,
    )
    return outs.lse[:, 0], outs.target[:, 0], outs.total[:, 0]


def backward(x, w, labels, lse, softmax_coef, target_coef, uniform_coef, *, transpose_w, logit_soft_cap,
             config: LossTpuConfig, precision=HIGHEST):
    """``(dx [T, D] in x.dtype, dw in w.dtype)``: the ``dx`` kernel and the ``dw`` kernel (module docstring)."""
    t = _Tiles(x, w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap, precision=precision, config=config)
    columns = dict(labels=_column(labels, jnp.int32), lse=_column(lse, F32), a=_column(softmax_coef, F32),
                   b=_column(target_coef, F32), e=_column(uniform_coef, F32))

    def inputs(t_axis, v_axis):
        vec = t.vector_spec(t_axis)
        return dict(x=operand(x, t.x_spec(t_axis)), w=operand(w, t.w_spec(v_axis)),
                    **{name: operand(v, vec) for name, v in columns.items()})

    dx = tpu_kernel_call(
        functools.partial(_dx_kernel, t=t), grid=(t.nt, t.nv), dimension_semantics=("parallel", "arbitrary"),
        name="stellax_linear_cross_entropy_dx_tpu", inputs=inputs(0, 1),
        outputs=dict(dx=output(x.shape, x.dtype, t.x_spec(0))),
        scratch=dict(acc=pltpu.VMEM((t.bt, t.features), F32)), vmem_limit_bytes=t.vmem_limit,
    ).dx
    dw_block = (t.bv, t.features) if transpose_w else (t.features, t.bv)
    dw = tpu_kernel_call(
        functools.partial(_dw_kernel, t=t), grid=(t.nv, t.nt), dimension_semantics=("parallel", "arbitrary"),
        name="stellax_linear_cross_entropy_dw_tpu", inputs=inputs(1, 0),
        outputs=dict(dw=output(w.shape, w.dtype, t.w_spec(0))),
        scratch=dict(acc=pltpu.VMEM(dw_block, F32)), vmem_limit_bytes=t.vmem_limit,
    ).dw
    return dx, dw
