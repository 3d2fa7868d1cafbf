"""Pallas Mosaic TPU kernels for linear cross-entropy: the logits are built as
``[bt, bv]`` float32 tiles in VMEM, never as a float32 ``[T, V]`` array in HBM.

Every kernel that multiplies ``x`` by ``w`` builds its logits tile the same way
(`_Tiles.logits`): token rows ``i`` (a ``[bt, D]`` block, the whole hidden
size) against vocabulary columns ``j`` (a ``[D, bv]`` weight tile, ``[bv, D]``
for ``[V, D]`` weights), one MXU contraction over ``D`` with float32
accumulation, then ``c = cap·tanh(z/cap)`` when soft-capped. The forward step
over a tile is the online log-sum-exp

    m' = max(m, rowmax c);   s = s·e^{m−m'} + Σ_j e^{c_j−m'};   m = m'

plus the label's logit (picked up in the tile that holds it) and the logit
sum; after the last tile ``lse = m + log s``, ``target``, ``total`` (float32
``[T]``). The gradient of a tile, from ``lse`` and the per-token coefficients
``(a, b, e)`` (`reduction.coefficients`), is

    dc = a·e^{c−lse} + b·onehot(y) + e,   dz = dc·(1 − (c/cap)²),
    dx = dz @ wᵀ,   dw = xᵀ @ dz.

**The fused training sweep** (`fused_forward_backward`: a scalar loss —
``"mean"``/``"sum"`` without ``lse``/z-loss outputs — under differentiation;
the cotangent only scales the result) computes each logits tile once. Tokens
go in chunks of ``chunk`` rows (`configs.tpu_chunk`, 2048 by default), and per
chunk three kernels run:

1. logits forward, grid ``(chunk/bt parallel, V/bv arbitrary)``: the forward
   step above, and the tile kept in HBM as ``c − m_j`` (the running max after
   tile ``j``; ``x``'s dtype, ``[chunk, V]``) with ``m_j`` in lane ``j mod 128``
   of a float32 ``[chunk, 128·⌈V/(128·bv)⌉]`` array. Shifted, a kept bfloat16
   logit is exact to ``2⁻⁹·|c − m_j|``: the logits that carry probability are
   near the row's max, so the error in ``e^{c−lse}`` is that of rounding ``dz``
   to bfloat16, not the ``2⁻⁹·|c|`` of a raw bfloat16 logit;
2. ``dz``/``dx``, grid ``(chunk/bt parallel, V/bv arbitrary)``, after the
   chunk's coefficients (from its ``lse``): reads the kept tile back,
   ``e^{c−lse} = e^{(c − m_j) + (m_j − lse)}``, writes ``dz`` (``x``'s dtype)
   over it in place and accumulates ``dx += dz @ w_jᵀ`` in the float32 ``dx``
   block;
3. ``dw``, grid ``(D/bd parallel, V/bv parallel)``: a ``dw`` tile
   ``x_{:, d}ᵀ @ dz_{:, j}`` in one contraction over the chunk's tokens, added
   to the running ``dw`` in place. The running ``dw`` is two bfloat16 arrays
   ``hi + lo`` (``hi`` rounded, ``lo`` the remainder: 16 significant bits,
   so the sum over chunks rounds once, like a float32 accumulator, in half its
   bytes; ``hi`` is the gradient) or one float32 array for float32 weights. The
   first chunk writes it without reading.

A training step then costs three ``2·T·D·V`` matmuls (logits, ``dx``, ``dw``),
as the full-logits version differentiated by JAX, without its float32
``[T, V]`` logits and gradient. The HBM traffic (`base.fused_sweep_cost`,
summed over the chunks, ``s``-byte operands, ``nb = T/bt`` token blocks):

* logits kernel: the weights once per token block (``nb·V·D·s``), the kept
  logits written (``T·V·s``);
* ``dz``/``dx`` kernel: the weights again (``nb·V·D·s``), the logits read and
  ``dz`` written (``2·T·V·s``), ``dx`` (``T·D·4``);
* ``dw`` kernel: ``dz`` read once per hidden slice (``(D/bd)·T·V·s``), the
  running ``dw`` written by the first chunk and read and written by each
  later one (``4·V·D`` bytes each way).

At T=8192, D=4096, V=131072 in bfloat16 (``bt = bv = 512``, four chunks of
2048, ``bd = 2048``): 8.8 TFLOP per kernel, 134 ms of MXU work at a v5e's
197 TFLOP/s, and 18, 20 and 18 GiB of HBM traffic (16 GiB of it the weights
in each of the first two, 14 GiB the running ``dw`` in the third): 56 GiB,
73 ms at 819 GB/s, so each kernel's DMAs take ~55 % of its MXU time and
all three stay MXU-bound (the first two do ``bt`` = 512 flop per weight
byte; a v5e needs ~240). At the 88 % of peak the forward kernel measured,
that is ~152 ms forward + backward against 184 ms measured for the
full-logits version (~1.2x) and 232 ms for the recompute path below; not
yet measured on a chip. The HBM held: one chunk's logits (``Tc·V·s``,
512 MiB there), the running ``lo`` (``V·D·2``, 1 GiB) and ``dw`` itself;
compiled for a v5e (libtpu 0.0.42, ``memory_analysis``) the gradient's
temporaries are 2.1 GiB against the full-logits version's 8.0 GiB.

**Per-token cotangents** (``reduction="none"``, ``return_lse``,
``return_z_loss``) and the backward op (`backward`) recompute the logits:

* forward, grid ``(T/bt parallel, V/bv arbitrary)``: the token block stays in
  VMEM while the weight tiles stream past it (`forward_stats`);
* ``dx`` kernel, grid ``(T/bt parallel, V/bv arbitrary)``: ``dx += dz @ wᵀ``
  over the vocabulary tiles in a ``[bt, D]`` float32 VMEM accumulator;
* ``dw`` kernel, grid ``(V/bv parallel, T/bt arbitrary)``: ``dw += xᵀ @ dz``
  over the token blocks in a ``[D, bv]`` float32 VMEM accumulator;

five ``2·T·D·V`` matmuls per training step (forward 1, ``dx`` 2, ``dw`` 2);
on a v5e forward + backward measured 0.79x the full-logits version
(docs/loss.md). Every sum runs in a fixed order (deterministic, no atomics).

Ragged edges: a partial last vocabulary tile reads columns past ``V``; they are
excluded from every sum (``-inf`` in the max and exponentials, 0 in the sums
and in ``dz``) and, in the ``dx`` kernels, zeroed in the weight tile itself (a
stale NaN times a zero ``dz`` would still be NaN); the ``dw`` tiles they reach
are never written back. A partial last token block of the recompute path reads
rows past ``T``: their outputs are never written back, and the ``dw`` kernel
zeroes them in ``x`` and ``dz`` before they enter its sum. The fused sweep pads
the tokens to whole chunks instead (zero rows, zero coefficients: ``dz = 0``).

Precision (`stellax.core.precision`): bfloat16 operands go to the MXU as they
are (``dz`` rounded to bfloat16 for the gradient products), float32 operands at
the call's resolved precision (`mxu_dot`: one or three bfloat16 passes, or
Mosaic's ``fp32``; the fused sweep keeps float32 logits); at ``HIGHEST`` the
soft cap's ``tanh`` and the exponentials are `float32_tanh` / `float32_exp`,
the row's log is always `float32_log`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import mxu_dot, mxu_dot_nt, mxu_dot_tn, operand, output, pad_axis, tpu_kernel_call
from ...core.precision import HIGHEST, accurate_functions, float32_exp, float32_log, soft_cap_tanh
from .configs import LossTpuConfig, dw_slice, loss_tpu_vmem_bytes, loss_tpu_vmem_limit, tpu_chunk, tpu_tile

F32 = jnp.float32
LANES = 128


class _Tiles:
    """The sizes of one launch and the tile math every kernel shares (``x`` may be a chunk)."""

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

    def tile_spec(self):
        """A ``[bt, bv]`` tile of a ``[T, V]`` array, grid ``(T/bt, V/bv)``."""
        return pl.BlockSpec((self.bt, self.bv), lambda i, j: (i, j))

    def maxes_spec(self):
        """The 128 lanes of a ``[T, 128·⌈nv/128⌉]`` array holding tile ``j``'s running max."""
        return pl.BlockSpec((self.bt, LANES), lambda i, j: (i, jax.lax.div(j, LANES)))

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

    def gradient(self, p, th, j, *, labels, a, b, e):
        """``dz [bt, bv]`` float32 from ``p = e^{c−lse}`` and ``th = c/cap`` (None without a
        soft cap): ``(a·p + b·onehot(y) + e)·(1 − th²)``, 0 on columns past ``V``."""
        cols = self.columns(j)
        dc = a[...] * p + jnp.where(cols == labels[...], b[...], 0.0) + e[...]
        if th is not None:
            dc = dc * (1.0 - th * th)
        if self.ragged_v:
            dc = jnp.where(cols < self.vocab, dc, 0.0)
        return dc

    def dz(self, x, w, j, *, labels, lse, a, b, e):
        """``dz [bt, bv]`` float32 of recomputed logits (0 on columns past ``V``)."""
        c, th = self.logits(x, w)
        return self.gradient(self.exp(c - lse[...]), th, j, labels=labels, a=a, b=b, e=e)

    def dx_update(self, dz, w):
        """``dz [bt, bv] @ w_tileᵀ`` → ``[bt, D]``."""
        return (mxu_dot if self.transpose_w else mxu_dot_nt)(dz.astype(self.dtype), w, self.precision)

    def dw_update(self, x, dz):
        """``x [n, D']ᵀ @ dz [n, bv]`` as the weight tile's layout (``[D', bv]`` or ``[bv, D']``)."""
        dz = dz.astype(self.dtype)
        return mxu_dot_tn(dz, x, self.precision) if self.transpose_w else mxu_dot_tn(x, dz, self.precision)


# -- kernel bodies -------------------------------------------------------------------------
def _lse_step(t: _Tiles, c, j, *, labels, m_run, s_run, tgt_run, tot_run):
    """Vocabulary tile ``j`` of the online log-sum-exp over the logits tile ``c``; returns the
    running max after it (``[bt, 1]``)."""
    @pl.when(j == 0)
    def _init():
        m_run[...] = jnp.full(m_run.shape, -jnp.inf, F32)
        for ref in (s_run, tgt_run, tot_run):
            ref[...] = jnp.zeros(ref.shape, F32)

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
    return m_new


def _store_stats(j, *, lse, target, total, m_run, s_run, tgt_run, tot_run):
    @pl.when(j == pl.num_programs(1) - 1)
    def _store():
        lse[...] = m_run[...] + float32_log(s_run[...])
        target[...] = tgt_run[...]
        total[...] = tot_run[...]


def _forward_kernel(*, x, w, labels, lse, target, total, t: _Tiles, **running):
    """Token block ``i``, vocabulary tile ``j``: one online log-sum-exp step."""
    j = pl.program_id(1)
    c, _ = t.logits(x[...], w[...])
    _lse_step(t, c, j, labels=labels, **running)
    _store_stats(j, lse=lse, target=target, total=total, **running)


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


def _lane(j):
    """``[1, 128]``: true in the lane of ``maxes`` that holds tile ``j``'s running max."""
    return jax.lax.broadcasted_iota(jnp.int32, (1, LANES), 1) == jax.lax.rem(j, LANES)


def _logits_forward_kernel(*, x, w, labels, lse, target, total, logits, maxes, t: _Tiles, **running):
    """Token block ``i``, vocabulary tile ``j``: the forward step, and the tile kept as
    ``logits_ij = c − m_j`` with ``m_j`` (the running max after it) in ``maxes``."""
    j = pl.program_id(1)
    c, _ = t.logits(x[...], w[...])
    m_new = _lse_step(t, c, j, labels=labels, **running)
    logits[...] = (c - m_new).astype(logits.dtype)

    @pl.when(jax.lax.rem(j, LANES) == 0)
    def _fresh_lanes():
        maxes[...] = jnp.zeros(maxes.shape, F32)

    maxes[...] = jnp.where(_lane(j), m_new, maxes[...])
    _store_stats(j, lse=lse, target=target, total=total, **running)


def _dz_dx_kernel(*, logits, maxes, w, labels, lse, a, b, e, dz, dx, t: _Tiles):
    """Token block ``i``, vocabulary tile ``j``: ``dz`` from the kept tile (written over it)
    and ``dx += dz @ w_jᵀ`` in the float32 ``dx`` block."""
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dx[...] = jnp.zeros(dx.shape, F32)

    m_j = jnp.sum(jnp.where(_lane(j), maxes[...], 0.0), axis=1, keepdims=True)
    shifted = logits[...].astype(F32)
    th = None if t.cap is None else (shifted + m_j) * (1.0 / t.cap)
    p = t.exp(shifted + (m_j - lse[...]))
    tile = t.gradient(p, th, j, labels=labels, a=a, b=b, e=e).astype(dz.dtype)
    dz[...] = tile
    dx[...] += t.dx_update(tile, t.weights(w[...], j))


def _dw_chunk_kernel(*, x, dz, run_hi, run_lo, hi, lo, t: _Tiles):
    """Hidden slice ``d``, vocabulary tile ``j``: the chunk's ``dw`` tile over all its tokens —
    ``dz_{:, j}ᵀ @ x_{:, d}`` (``[bv, bd]``, ``x`` block ``[Tc, bd]``) for ``[V, D]`` weights,
    ``xᵀ_{d, :} @ dz_{:, j}`` (``[bd, bv]``, ``x`` passed transposed, block ``[bd, Tc]``: a
    plain MXU product) for ``[D, V]`` — plus the running tile (``run_hi + run_lo``; none for
    the first chunk), written as ``hi`` rounded to the weights' dtype and ``lo`` the remainder
    (no ``lo`` for float32 weights or the last chunk)."""
    if t.transpose_w:
        total = mxu_dot_tn(dz[...], x[...], t.precision)
    else:
        total = mxu_dot(x[...], dz[...], t.precision)
    if run_hi is not None:
        total = total + run_hi[...].astype(F32)
    if run_lo is not None:
        total = total + run_lo[...].astype(F32)
    rounded = total.astype(hi.dtype)
    hi[...] = rounded
    if lo is not None:
        lo[...] = (total - rounded.astype(F32)).astype(lo.dtype)


# -- entry points (see `base`) -------------------------------------------------------------------
def _column(v, dtype):
    return v.reshape(-1, 1).astype(dtype)


def _running_scratch(t: _Tiles):
    return {name: pltpu.VMEM((t.bt, 1), F32) for name in ("m_run", "s_run", "tgt_run", "tot_run")}


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
        scratch=_running_scratch(t), vmem_limit_bytes=t.vmem_limit,
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


# -- the fused training sweep: one chunk's three kernels, then the loop over chunks ---------------
def _logits_forward(t: _Tiles, x_c, w, y_c):
    """Kernel 1: ``((lse, target, total) float32 [Tc], logits [Tc, V] in x.dtype, maxes [Tc, 128·k])``."""
    vec = t.vector_spec(0)
    stat = lambda: output((t.tokens, 1), F32, vec)
    lanes = pl.cdiv(t.nv, LANES) * LANES
    outs = tpu_kernel_call(
        functools.partial(_logits_forward_kernel, t=t), grid=(t.nt, t.nv),
        dimension_semantics=("parallel", "arbitrary"), name="stellax_linear_cross_entropy_logits_tpu",
        inputs=dict(x=operand(x_c, t.x_spec(0)), w=operand(w, t.w_spec(1)),
                    labels=operand(_column(y_c, jnp.int32), vec)),
        outputs=dict(lse=stat(), target=stat(), total=stat(),
                     logits=output((t.tokens, t.vocab), t.dtype, t.tile_spec()),
                     maxes=output((t.tokens, lanes), F32, t.maxes_spec())),
        scratch=_running_scratch(t), vmem_limit_bytes=t.vmem_limit,
    )
    return (outs.lse[:, 0], outs.target[:, 0], outs.total[:, 0]), outs.logits, outs.maxes


def _dz_dx(t: _Tiles, logits, maxes, w, y_c, lse, a, b, e):
    """Kernel 2: ``(dx [Tc, D] float32, dz [Tc, V] in x.dtype, written over logits)``."""
    vec = t.vector_spec(0)
    columns = dict(labels=_column(y_c, jnp.int32), lse=_column(lse, F32), a=_column(a, F32), b=_column(b, F32),
                   e=_column(e, F32))
    outs = tpu_kernel_call(
        functools.partial(_dz_dx_kernel, t=t), grid=(t.nt, t.nv), dimension_semantics=("parallel", "arbitrary"),
        name="stellax_linear_cross_entropy_dz_dx_tpu",
        inputs=dict(logits=operand(logits, t.tile_spec()), maxes=operand(maxes, t.maxes_spec()),
                    w=operand(w, t.w_spec(1)), **{name: operand(v, vec) for name, v in columns.items()}),
        outputs=dict(dz=output(logits.shape, logits.dtype, t.tile_spec()),
                     dx=output((t.tokens, t.features), F32, t.x_spec(0))),
        aliases=dict(logits="dz"), vmem_limit_bytes=t.vmem_limit,
    )
    return outs.dx, outs.dz


def _dw_accumulate(t: _Tiles, x_c, dz, running, *, last: bool):
    """Kernel 3: the running ``dw`` (a tuple: ``(hi, lo)`` bfloat16, ``(dw,)`` float32; ``None``
    before the first chunk) plus ``x_cᵀ @ dz``, updated in place (``lo`` not written for the
    ``last`` chunk: ``(hi,)``)."""
    bd = dw_slice(t.tokens, t.features, t.bv, t.dtype.itemsize)
    if t.transpose_w:
        w_shape, dw_spec = (t.vocab, t.features), pl.BlockSpec((t.bv, bd), lambda d, j: (j, d))
        x_in = operand(x_c, pl.BlockSpec((t.tokens, bd), lambda d, j: (0, d)))
    else:
        w_shape, dw_spec = (t.features, t.vocab), pl.BlockSpec((bd, t.bv), lambda d, j: (d, j))
        x_in = operand(x_c.T, pl.BlockSpec((bd, t.tokens), lambda d, j: (d, 0)))
    split = t.dtype.itemsize < 4 and not last  # a bfloat16 (float16) running dw is two parts
    run_hi, run_lo = (*(running or ()), None, None)[:2]
    part = lambda: output(w_shape, t.dtype, dw_spec)
    outs = tpu_kernel_call(
        functools.partial(_dw_chunk_kernel, t=t), grid=(pl.cdiv(t.features, bd), t.nv),
        dimension_semantics=("parallel", "parallel"), name="stellax_linear_cross_entropy_dw_chunk_tpu",
        inputs=dict(x=x_in, dz=operand(dz, pl.BlockSpec((t.tokens, t.bv), lambda d, j: (0, j))),
                    run_hi=operand(run_hi, dw_spec), run_lo=operand(run_lo, dw_spec)),
        outputs=dict(hi=part(), lo=part() if split else None),
        aliases=dict(run_hi="hi", **({"run_lo": "lo"} if split else {})) if running is not None else {},
        vmem_limit_bytes=t.vmem_limit,
    )
    return (outs.hi, outs.lo) if split else (outs.hi,)


def fused_forward_backward(x, w, labels, coefficients_of, *, transpose_w, logit_soft_cap, config: LossTpuConfig,
                           precision=HIGHEST):
    """The stats and the gradients of a scalar loss in one sweep over token chunks (module
    docstring): three matmuls, each logits tile computed once.

    ``coefficients_of(lse_c, labels_c, rows_c) -> (a, b, e)`` gives one chunk's coefficients
    of a unit cotangent (``rows_c`` is False on padding rows). Returns
    ``((lse, target, total) float32 [T], (dx [T, D] float32, dw in w.dtype))``."""
    tokens, features = x.shape
    chunks, chunk = tpu_chunk(tokens, config.block_t, config.chunk_t)
    xs = pad_axis(x, 0, chunks * chunk).reshape(chunks, chunk, features)
    ys = pad_axis(labels, 0, chunks * chunk, value=-1).reshape(chunks, chunk)
    rows = (jnp.arange(chunks * chunk) < tokens).reshape(chunks, chunk)
    t = _Tiles(xs[0], w, transpose_w=transpose_w, logit_soft_cap=logit_soft_cap, precision=precision,
               config=config)

    def sweep(x_c, y_c, rows_c, running, last=False):
        (lse, target, total), logits, maxes = _logits_forward(t, x_c, w, y_c)
        a, b, e = coefficients_of(lse, y_c, rows_c)
        dx_c, dz = _dz_dx(t, logits, maxes, w, y_c, lse, a, b, e)
        return (lse, target, total, dx_c), _dw_accumulate(t, x_c, dz, running, last=last)

    def step(running, inputs):
        out, running = sweep(*inputs, running)
        return running, out

    first, running = sweep(xs[0], ys[0], rows[0], None, last=chunks == 1)
    outs = jax.tree.map(lambda v: v[None], first)
    if chunks > 1:
        running, rest = jax.lax.scan(step, running, (xs[1:], ys[1:], rows[1:]))
        outs = jax.tree.map(lambda a, b: jnp.concatenate([a, b]), outs, rest)
    lse, target, total, dx = (v.reshape(chunks * chunk, *v.shape[2:])[:tokens] for v in outs)
    return (lse, target, total), (dx, running[0])
