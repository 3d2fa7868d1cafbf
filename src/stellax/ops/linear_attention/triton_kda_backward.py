"""Pallas Triton kernels for KDA's per-chunk gradients (per-channel decays), chunk 64:
stages 4 → 1 backwards, after the reverse state scan.

`kda_intra_backward` backpropagates, per chunk, the cotangents of the per-chunk
factors (`triton_intra.kda_intra_forward`'s outputs) that the scans give
(`pipeline.factor_cotangents`): ``d(Q⊙Γ)``, ``dK̃``, ``dΓ_C``, ``dP``, ``dU``,
``dW``, to ``dq, dk, dv, dg, dβ``. Two kernels, the second reading the
first's ``dS_k`` and ``dR_W`` from HBM:

* `_wy_backward_kernel` — grid ``(NT, BH)`` — the WY solve ``X = T R``
  (``X = [U, W]``, ``R = [β⊙V, β⊙Γ⊙K]``, ``T = (I + A)⁻¹``) backwards:
  ``dR = Tᵀ dX``, ``dA = −strict_lower(dR Xᵀ)``, so ``dv = β⊙dR_V``,
  ``dβ_i = Σ dR_V⊙v + Σ dR_W⊙Γ⊙k + Σ_j dA_ij (A/β)_ij`` and the k scores
  get ``dS_k = β_i dA_ij``. Value columns and channels `WY_BLOCK` at a time.
  ``R_W``'s per-channel terms (``dk``'s ``β⊙dR_W⊙Γ``, its ``dβ`` term and
  its cotangent of ``Γ``) are left to the scores kernel, which forms ``Γ``
  anyway, so this one reads neither ``k`` nor ``g``.
* `_scores_backward_kernel` — grid ``(K/bk, NT, BH)``, `SCORES_BLOCK_K`
  channels per program (the rest is separable by channel once ``dS_k`` is
  known) — the decayed scores ``S_x[i,j] = Σ_c x_ic k_jc E_ijc``,
  ``E_ijc = exp(Σ_{j<t≤i} g_tc)`` (``P = S_q`` with ``dP``, ``S_k`` with
  ``dS_k``) and the decay factors backwards: ``dx_i = Σ_j dS_ij k_j E_ij``,
  ``dk_j = Σ_i dS_ij x_i E_ij``, and each pair's ``M_ij = dS_ij x_i k_j E_ij``
  goes to ``dg_t`` for every ``t`` of its span ``j < t ≤ i``.

The scores kernel works on sub-blocks of ``s`` = 16 rows (as the forward's
`scores.channel_scores`), every tile ``[s, bk]`` or ``[s, s]`` (its matmuls
are ``[16, 16]`` blocks of ``dP``, ``dS_k`` and 0/1 masks: mma.sync, no
``[C, C]`` operand in registers). For rows of block ``a`` against columns of
an earlier block ``b`` the decay splits at the start of block ``a``:
``E_ij = exp(Σ_{a·s≤t≤i} g) · exp(Σ_{j<t<a·s} g)``, one matmul each way. The
span of such a pair covers the ``t ≤ i`` of block ``a`` (the row sums of ``M``
over earlier columns), the ``t > j`` of block ``b`` (the column sums over
later rows) and every ``t`` of the blocks in between (the pair's total).
Within a diagonal block, one column ``j`` at a time, ``E_ij`` is elementwise;
a running sum over the columns gives ``t`` its ``Σ_{i≥t} Σ_{j<t} M_ij``. The
decay factors: ``Q⊙Γ`` and ``R_W``'s ``Γ`` send their cotangents to every ``g_t``
with ``t ≤ i`` (added to the row sums), ``K̃``'s tail to ``t > j`` (to the
column sums) and ``Γ_C`` to every ``t``. Every exponent and every sum that
reaches ``dg`` is a direct sum over its span (same-sign terms, never a
difference of prefix sums), so decays of −20 per step lose no digits.

Shared memory (sm_90, K = V = 128): 48 KiB and 4 KiB (the fused kernel these
replace took 224 KiB and spilled 7–11 KB per thread). The scores kernel runs
its blocks, pairs and columns as loops, the later rows before the earlier
columns (fewer values live across each loop): unrolled, it spilled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import pallas
from ...core.pallas import F32, HIGHEST, operand, output, square_iota, triton_kernel_call, triton_precision
from .configs import LinearAttentionConfig
from .layout import check_flat_layout
from .scores import CHANNEL_SUB_BLOCK

#: Every matmul of this module runs at the call's precision as Triton takes it
#: (`core.pallas.triton_precision`): `TF32X3` (three TF32 tensor-core passes, about
#: float32 accuracy; an IEEE float32 dot is scalar FMA on a GPU) for ``high`` /
#: ``highest``, one TF32 pass for ``default``. The 0/1 masks are exact in TF32; at
#: `TF32X3` their other operand carries < 2⁻²⁰ relative error.
dot, dot_nt, dot_tn = pallas.dot, pallas.dot_nt, pallas.dot_tn

#: Value columns and channels per step of the WY backward's loops (static tier, sm_90,
#: K = V = 128, 4 warps: 64 spilled 28 B; 32 none, ptxas needs at most 214 registers).
WY_BLOCK = 32
#: Channels per program of the scores backward (K = V = 128: 64 spilled 16 B; 32 none,
#: at most 214 registers needed at any head size of the examples).
SCORES_BLOCK_K = 32


def _wy_backward_kernel(*, v, beta, t, sk, u, w, du, dw, dv, dbeta, dsk, drw, chunk, precision):
    """One chunk, the WY solve backwards: ``dv [C, V]``, ``dS_k [C, C]``,
    ``dR_W [C, K]`` and the part of ``dβ [C]`` that is not per channel.

    ``dR = Tᵀ dX`` (``X = [U, W]``), ``dA = −strict_lower(dR_V Uᵀ + dR_W Wᵀ)``;
    ``dv = β⊙dR_V``, ``dβ_i = Σ dR_V⊙v + Σ_j dA_ij (A/β)_ij`` (the scores
    kernel adds ``Σ dR_W⊙Γ⊙k``) and ``dS_k = β_i dA_ij`` (the k scores'
    cotangent). Value columns and channels `WY_BLOCK` at a time; ``T`` is the
    one ``[C, C]`` matmul operand.
    """
    kdim, vdim = w.shape[-1], v.shape[-1]
    bk, bv = min(kdim, WY_BLOCK), min(vdim, WY_BLOCK)
    b = beta[...].astype(F32)
    tc = t[...]
    rows, cols = square_iota(chunk)

    def v_block(i, carry):
        da, db = carry
        vs = pl.ds(i * bv, bv)
        dr = dot_tn(tc, du[:, vs], precision=precision)
        dv[:, vs] = dr * b[:, None]
        return da + dot_nt(dr, u[:, vs], precision=precision), db + jnp.sum(dr * v[:, vs].astype(F32), axis=1)

    def w_block(i, da):
        cs = pl.ds(i * bk, bk)
        dr = dot_tn(tc, dw[:, cs], precision=precision)
        drw[:, cs] = dr
        return da + dot_nt(dr, w[:, cs], precision=precision)

    zeros = (jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk,), F32))
    da, db = jax.lax.fori_loop(0, vdim // bv, v_block, zeros)
    da = jax.lax.fori_loop(0, kdim // bk, w_block, da)
    da = -jnp.where(rows > cols, da, 0.0)
    dbeta[...] = db + jnp.sum(da * sk[...], axis=1)
    dsk[...] = da * b[:, None]


def _row(x, d, row):
    """Row ``d`` of a tile (``row`` its ``[R, 1]`` row iota), ``[1, bk]``."""
    return jnp.sum(jnp.where(row == d, x, 0.0), axis=0, keepdims=True)


def _diagonal_block(qa, ka, ga, dp_aa, dsk_aa, k, start, col_sums, init):
    """The pairs ``j ≤ i`` of one diagonal block of ``s`` rows (from ``start``),
    one column ``j = start + d`` at a time, ``E_ij = exp(Σ_{j<t≤i} g)``
    elementwise, added to ``init = (dq, dk, dg, row_sums)`` (``[s, bk]`` each;
    ``row_sums`` those of ``M`` over the columns before the block, ``col_sums``
    those over the rows after it); returns ``(dq, dk, dg)``. ``t = j`` gets
    ``Σ_{i≥t} Σ_{j'<t} M_ij'`` from the running row sums and ``Σ_{j'<t}`` of ``col_sums``."""
    s = qa.shape[0]
    row = jax.lax.broadcasted_iota(jnp.int32, (s, 1), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (1, s), 1)

    def column(d, c):
        dq_a, dk_a, dg_a, row_sums, run = c
        kd = k[pl.ds(start + d, 1), :].astype(F32)
        e = jnp.exp(jnp.where(row >= d, jnp.cumsum(jnp.where(row > d, ga, 0.0), axis=0), -jnp.inf))
        dpd = jnp.sum(jnp.where(col == d, dp_aa, 0.0), axis=1, keepdims=True)
        dskd = jnp.sum(jnp.where(col == d, dsk_aa, 0.0), axis=1, keepdims=True)
        ke = kd * e
        cz = (dpd * qa + dskd * ka) * e
        dk_a = dk_a + dskd * ke + jnp.where(row == d, jnp.sum(cz, axis=0, keepdims=True), 0.0)
        hit = jnp.sum(jnp.where(row >= d, row_sums, 0.0), axis=0, keepdims=True) + run  # to t = j
        dg_a = dg_a + jnp.where(row == d, hit, 0.0)
        return dq_a + dpd * ke, dk_a, dg_a, row_sums + cz * kd, run + _row(col_sums, d, row)

    dq_a, dk_a, dg_a, _, _ = jax.lax.fori_loop(0, s, column, init + (jnp.zeros((1, qa.shape[1]), F32),))
    return dq_a, dk_a, dg_a


class _SubBlocks:
    """The sub-blocks of ``s`` rows of one chunk of `_scores_backward_kernel` and the
    decay sums over them, from the chunk's log decays ``g [C, bk]``."""

    def __init__(self, g, chunk: int, precision):
        self.s = s = CHANNEL_SUB_BLOCK
        self.nb = nb = chunk // s
        self.g, self.precision = g, precision
        rows, cols = square_iota(s)
        self.blocks = jax.lax.broadcasted_iota(jnp.int32, (nb, 1), 0)
        self.later = (cols > rows).astype(F32)  # [j, t]: t > j, both in one block
        self.totals = jnp.sum(g[...].astype(F32).reshape(nb, s, g.shape[-1]), axis=1)  # [nb, bk]: Σ_{t in block} g

    def rows(self, ref, a):
        """Rows of block ``a`` of ``ref``, float32."""
        return ref[pl.ds(a * self.s, self.s), :].astype(F32)

    def square(self, ref, a, b):
        """The ``[s, s]`` block ``(a, b)`` of ``ref``."""
        return ref[pl.ds(a * self.s, self.s), pl.ds(b * self.s, self.s)]

    def whole(self, lo, hi):
        """Σ g over the whole blocks lo..hi-1, ``[1, bk]`` (same-sign terms)."""
        inside = (self.blocks >= lo) & (self.blocks < hi)
        return jnp.sum(jnp.where(inside, self.totals, 0.0), axis=0, keepdims=True)

    def tail(self, a):
        """Σ_{j<t<(a+1)·s} g for the rows j of block a."""
        return dot(self.later, self.rows(self.g, a), precision=self.precision)


def _scores_backward_kernel(*, q, k, g, beta, dp, dsk, dqg, dkg, drw, dgamma, dq, dk, dg, dbeta, chunk, precision):
    """One chunk, ``bk`` channels: ``dq, dk, dg [C, bk]`` of ``Σ dP⊙P + Σ dS_k⊙S_k``
    and of the decay factors ``Q⊙Γ`` (cotangent ``dqg``), ``K̃`` (``dkg``),
    ``Γ_C`` (``dgamma [bk]``) and ``R_W = β⊙Γ⊙K`` (``dR_W``: ``dk`` gets
    ``β⊙dR_W⊙Γ``, ``dβ [C]`` these channels' ``Σ dR_W⊙Γ⊙k``), in sub-blocks of
    ``s`` rows (module docstring); ``dp`` lower, ``dsk`` strictly lower ``[C, C]``.

    The blocks run last to first, each written once: the pair totals of the rows
    of block ``a`` go to the blocks before it (``between``), and the prefix
    cotangents of the blocks after ``a`` to every ``t`` of it (``prefix_later``).
    Loops rather than unrolled blocks, so no block's operands are live in another's.
    """
    sub = _SubBlocks(g, chunk, precision)
    s, nb, bk, blocks = sub.s, sub.nb, k.shape[-1], sub.blocks
    rows_of, square, whole, tail = sub.rows, sub.square, sub.whole, sub.tail

    def suffix_sum(m, sums):  # Σ over block m of K̃'s cotangent of Σ_{t>j} g
        decay = jnp.exp(tail(m) + whole(m + 1, nb))
        part = jnp.sum(dkg[pl.ds(m * s, s), :] * rows_of(k, m) * decay, axis=0, keepdims=True)
        return sums + jnp.where(blocks == m, part, 0.0)

    zeros = jnp.zeros((nb, bk), F32)
    suffix_sums = jax.lax.fori_loop(0, nb, suffix_sum, zeros)
    dg_total = dgamma[...][None, :] * jnp.exp(whole(0, nb))  # Γ_C's cotangent, to every t

    def block(i, carry):
        between, prefix_later = carry
        a = nb - 1 - i
        ka = rows_of(k, a)
        tail_a = tail(a)
        dk_tail = dkg[pl.ds(a * s, s), :] * jnp.exp(tail_a + whole(a + 1, nb))  # from K̃_j = k_j exp(Σ_{t>j} g)

        def later_rows(c_, c):  # the columns of block a against the rows of block c_ > a
            dk_a, col_sums = c
            inner_c = jnp.exp(jnp.cumsum(rows_of(g, c_), axis=0))
            cx = (dot_tn(square(dp, c_, a), rows_of(q, c_) * inner_c, precision=precision)
                  + dot_tn(square(dsk, c_, a), rows_of(k, c_) * inner_c, precision=precision))
            kx = jnp.exp(tail_a + whole(a + 1, c_)) * cx  # Σ_{i in c_} M_ij / k_j
            return dk_a + kx, col_sums + ka * kx

        dk_a, col_sums = jax.lax.fori_loop(a + 1, nb, later_rows, (dk_tail, dk_tail * ka))
        qa, ga = rows_of(q, a), rows_of(g, a)
        head = jnp.cumsum(ga, axis=0)  # Σ_{a·s≤t≤i} g
        inner = jnp.exp(head)
        gate = jnp.exp(head + whole(0, a))  # Γ_i
        drw_gate = drw[pl.ds(a * s, s), :] * gate
        dbeta[pl.ds(a * s, s)] = jnp.sum(drw_gate * ka, axis=1)
        dkw_a = beta[pl.ds(a * s, s)].astype(F32)[:, None] * drw_gate  # W's share of dk
        dqg_a = dqg[pl.ds(a * s, s), :]
        prefix = dqg_a * qa * gate + dkw_a * ka  # cotangent of G_i = Σ_{t≤i} g
        xq, xk = qa * inner, ka * inner

        def earlier_columns(b, c):  # the rows of block a against the columns of block b < a
            dq_a, dk_a, row_sums, between = c
            y = rows_of(k, b) * jnp.exp(tail(b) + whole(b + 1, a))  # k_j exp(Σ_{j<t<a·s} g)
            ry_q = dot(square(dp, a, b), y, precision=precision)
            ry_k = dot(square(dsk, a, b), y, precision=precision)
            m = xq * ry_q + xk * ry_k  # Σ_{j in b} M_ij
            pair = jnp.sum(m, axis=0, keepdims=True)
            between = between + jnp.where((blocks > b) & (blocks < a), pair, 0.0)
            return dq_a + inner * ry_q, dk_a + inner * ry_k, row_sums + m, between

        prefix_later_next = prefix_later + jnp.sum(prefix, axis=0, keepdims=True)
        dq_a, dk_a, row_sums, between = jax.lax.fori_loop(
            0, a, earlier_columns, (dqg_a * gate, dk_a + dkw_a, prefix, between))
        base = (_row(between, a, blocks) + prefix_later + dg_total
                + jnp.sum(jnp.where(blocks < a, suffix_sums, 0.0), axis=0, keepdims=True))
        # Block a's operands reloaded: only what the loops carry is live across them.
        dq_a, dk_a, dg_a = _diagonal_block(rows_of(q, a), rows_of(k, a), rows_of(g, a), square(dp, a, a),
                                           square(dsk, a, a), k, a * s, col_sums,
                                           (dq_a, dk_a, jnp.zeros_like(dq_a) + base, row_sums))
        dq[pl.ds(a * s, s), :] = dq_a
        dk[pl.ds(a * s, s), :] = dk_a
        dg[pl.ds(a * s, s), :] = dg_a
        return between, prefix_later_next

    jax.lax.fori_loop(0, nb, block, (zeros, jnp.zeros((1, bk), F32)))


def kda_intra_backward(q, k, v, g, beta, t, sk, u, w, cot, *, chunk: int, config: LinearAttentionConfig,
                       precision=HIGHEST):
    """The per-chunk gradients, float32 ``(dq, dk [BH, Tp, K], dv [BH, Tp, V], dg [BH, Tp, K], dβ [BH, Tp])``.

    Args: ``q, k, g [BH, Tp, K]``, ``v [BH, Tp, V]``, ``beta [BH, Tp]`` (as in
    `triton_intra.kda_intra_forward`); its ``t``, ``sk [BH, Tp, C]`` (``with_solve``),
    ``u [BH, Tp, V]``, ``w [BH, Tp, K]``; ``cot`` the cotangents of its outputs:
    ``qg, kg, W [BH, Tp, K]``, ``gamma [BH, NT, K]``, ``P [BH, Tp, C]`` (lower),
    ``U [BH, Tp, V]``. Two kernels (module docstring) with ``dS_k [BH, Tp, C]``
    and ``dR_W [BH, Tp, K]`` (float32) between them in HBM, and ``dβ`` the sum of
    the WY kernel's part and one part per block of channels. One stage each
    whatever ``config.num_stages`` (their loops run over one chunk's blocks and
    found nothing to pipeline). ``precision`` (resolved) of every matmul, as Triton
    runs it (`core.pallas.triton_precision`).
    """
    bh, tp, kdim = k.shape
    vdim = v.shape[-1]
    nt = tp // chunk
    check_flat_layout(chunk, k=(k, (None, None, None)), q=(q, k.shape), g=(g, k.shape), v=(v, (bh, tp, None)),
                      beta=(beta, (bh, tp)), t=(t, (bh, tp, chunk)), sk=(sk, (bh, tp, chunk)), u=(u, v.shape),
                      w=(w, k.shape), **{f"cot[{n!r}]": (cot[n], shape) for n, shape in (
                          ("qg", k.shape), ("kg", k.shape), ("W", k.shape), ("gamma", (bh, nt, kdim)),
                          ("P", (bh, tp, chunk)), ("U", v.shape))})
    spec = lambda d: pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))
    kspec, vspec, cspec = spec(kdim), spec(vdim), spec(chunk)
    vec = pl.BlockSpec((None, chunk), lambda c, h: (h, c))
    wy = triton_kernel_call(
        functools.partial(_wy_backward_kernel, chunk=chunk, precision=triton_precision(precision)), grid=(nt, bh),
        inputs=dict(v=operand(v, vspec), beta=operand(beta, vec), t=operand(t, cspec), sk=operand(sk, cspec),
                    u=operand(u, vspec), w=operand(w, kspec), du=operand(cot["U"], vspec),
                    dw=operand(cot["W"], kspec)),
        outputs=dict(dv=output((bh, tp, vdim), F32, vspec), dbeta=output((bh, tp), F32, vec),
                     dsk=output((bh, tp, chunk), F32, cspec), drw=output((bh, tp, kdim), F32, kspec)),
        num_warps=config.num_warps, num_stages=1, name="stellax_kda_wy_bwd",
    )
    # Channel blocks first: the programs of one chunk run together and share its dP, dS_k in L2.
    bk = min(kdim, SCORES_BLOCK_K)
    nk = kdim // bk
    channels = pl.BlockSpec((None, chunk, bk), lambda j, c, h: (h, c, j))
    square = pl.BlockSpec((None, chunk, chunk), lambda j, c, h: (h, c, 0))
    grads = triton_kernel_call(
        functools.partial(_scores_backward_kernel, chunk=chunk, precision=triton_precision(precision)),
        grid=(nk, nt, bh),
        inputs=dict(q=operand(q, channels), k=operand(k, channels), g=operand(g, channels),
                    beta=operand(beta, pl.BlockSpec((None, chunk), lambda j, c, h: (h, c))),
                    dp=operand(cot["P"], square), dsk=operand(wy.dsk, square), dqg=operand(cot["qg"], channels),
                    dkg=operand(cot["kg"], channels), drw=operand(wy.drw, channels),
                    dgamma=operand(cot["gamma"], pl.BlockSpec((None, None, bk), lambda j, c, h: (h, c, j)))),
        outputs=dict(dq=output((bh, tp, kdim), F32, channels), dk=output((bh, tp, kdim), F32, channels),
                     dg=output((bh, tp, kdim), F32, channels),
                     dbeta=output((nk, bh, tp), F32, pl.BlockSpec((None, None, chunk), lambda j, c, h: (j, h, c)))),
        num_warps=config.num_warps, num_stages=1, name="stellax_kda_intra_bwd",
    )
    return grads.dq, grads.dk, wy.dv, grads.dg, wy.dbeta + jnp.sum(grads.dbeta, axis=0)
