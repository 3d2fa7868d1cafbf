"""Pallas Triton kernel for KDA's per-chunk gradients (per-channel decays), chunk 64:
stages 4 → 1 backwards, after the reverse state scan.

`kda_intra_backward` — grid ``(NT, BH)`` — backpropagates, for one chunk, the
cotangents of the per-chunk factors (`triton_intra.kda_intra_forward`'s outputs)
that the scans give (`backward.factor_cotangents`):
``d(Q⊙Γ)``, ``dK̃``, ``dΓ_C``, ``dP``, ``dU``, ``dW``, to ``dq, dk, dv, dg, dβ``.

The WY solve ``X = T R`` (``X = [U, W]``, ``R = [β⊙V, β⊙Γ⊙K]``, ``T = (I + A)⁻¹``):
``dR = Tᵀ dX``, ``dA = −strict_lower(dR Xᵀ)``, so ``dv = β⊙dR_V``,
``dβ_i = Σ dR_V⊙v + Σ dR_W⊙Γ⊙k + Σ_j dA_ij (A/β)_ij`` and the k scores get
``dS_k = β_i dA_ij``.

The decayed scores ``S_x[i,j] = Σ_c x_ic k_jc E_ijc``, ``E_ijc = exp(Σ_{j<t≤i} g_tc)``,
backpropagate with the sub-blocks of the forward (`scores.channel_scores`):
``dx_i = Σ_j dS_ij k_j E_ij``, ``dk_j = Σ_i dS_ij x_i E_ij`` and, per pair, its
contribution ``M_ij = dS_ij x_i k_j E_ij`` goes to ``dg_t`` for every ``t`` of its
span ``j < t ≤ i``. That sum is formed directly: for rows of block ``a``
against earlier columns, the row sums of ``M`` over those columns go to the
block's ``t ≤ i`` and the column sums to the ``t < a·s`` after ``j`` (each a
0/1-mask matmul); for the diagonal blocks, per column offset, ``M_i`` goes to
the ``t`` of its block after the column and up to ``i``. No gradient is a
difference of prefix sums, so decays of −20 per step lose no digits.

The decay factors: ``Q⊙Γ`` and ``W``'s ``Γ`` send their cotangents to every
``g_t`` with ``t ≤ i``, ``K̃``'s tail to ``t > j`` and ``Γ_C`` to every ``t``.
Channels are handled 64 at a time (the ``[C, K]`` work is separable by
channel once ``dA`` is known), value columns 64 at a time. Each distinct
``[C, C]`` matmul operand (the 0/1 span masks, ``T``, ``dP``, ``dS_k``) stays in
shared memory across those loops, so the kernel reuses few of them (masks
transposed rather than rebuilt): 177 KiB at K = V = 128 and 256 (sm_90: 227 KiB;
it does not fit sm_80's 163 KiB).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import pallas
from ...core.pallas import F32, TF32X3, operand, output, square_iota, triton_kernel_call
from .configs import KDA_BLOCK_K, LinearAttentionConfig
from .decay import span_sum
from .layout import check_flat_layout
from .scores import CHANNEL_SUB_BLOCK

#: Every matmul of this module runs as `TF32X3` (three TF32 tensor-core passes,
#: about float32 accuracy; an IEEE float32 dot is scalar FMA on a GPU). The 0/1
#: masks and gathers are exact in TF32; their other operand carries < 2⁻²⁰ relative error.
dot = functools.partial(pallas.dot, precision=TF32X3)
dot_nt = functools.partial(pallas.dot_nt, precision=TF32X3)
dot_tn = functools.partial(pallas.dot_tn, precision=TF32X3)


def _scores_backward(q, k, g, dp, dsk, chunk):
    """``(dq, dk, dg)`` ``[C, K]`` of ``Σ dP⊙P_q + Σ dS_k⊙S_k`` for one block of
    channels (``P_q``/``S_k`` the decayed scores of q/k against k; ``dp``
    lower, ``dsk`` strictly lower ``[C, C]``).

    Few distinct ``[C, C]`` operands (each costs shared memory): the column
    factors ``exp(Σ_{j<t<a·s} g)`` are the in-block tail of ``j`` plus the
    totals of the blocks in between (same-sign sums), and the ``dg`` of the
    off-diagonal blocks is summed over all blocks before its two mask matmuls.
    """
    s = CHANNEL_SUB_BLOCK if chunk % CHANNEL_SUB_BLOCK == 0 else chunk
    nb = chunk // s
    rows, cols = square_iota(chunk)
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    start = (row // s) * s
    same = (cols // s) * s == start
    lower = (same & (cols <= rows)).astype(F32)  # [i, t]: t ≤ i in i's block
    later = (same & (cols > rows)).astype(F32)  # [j, t]: t > j in j's block
    inner = jnp.exp(dot(lower, g))  # exp(Σ_{start(i)≤t≤i} g)
    qi, ki = q * inner, k * inner
    in_tail = dot(later, g)  # Σ_{j<t<end(j)} g
    totals = [jnp.sum(jnp.where(start == b * s, g, 0.0), axis=0, keepdims=True) for b in range(nb)]
    zeros = jnp.zeros(q.shape, F32)
    dq, dk, dg, r_all, col_all = zeros, zeros, zeros, zeros, zeros
    for a in range(1, nb):
        span = in_tail
        for b in range(1, a):  # whole blocks between j's block and block a
            span = span + jnp.where(start < b * s, totals[b], 0.0)
        before = jnp.exp(jnp.where(row < a * s, span, -jnp.inf))  # exp(Σ_{j<t<a·s} g), 0 for j ≥ a·s
        y = k * before
        in_a = start == a * s
        ry_q = jnp.where(in_a, dot(dp, y), 0.0)
        ry_k = jnp.where(in_a, dot(dsk, y), 0.0)
        dq = dq + inner * ry_q
        dk = dk + inner * ry_k
        r_all = r_all + qi * ry_q + ki * ry_k  # Σ_{j<a·s} M_ij, rows i of block a
        cx = jnp.where(row < a * s, dot_tn(dp, jnp.where(in_a, qi, 0.0)) + dot_tn(dsk, jnp.where(in_a, ki, 0.0)),
                       0.0)
        dk = dk + before * cx
        col_m = y * cx  # Σ_{i in block a} M_ij per column j < a·s
        col_all = col_all + col_m
        for b in range(1, a):  # t in a whole block b between: Σ_{j<b·s} col_m_j
            dg = dg + jnp.where(start == b * s, jnp.sum(jnp.where(row < b * s, col_m, 0.0), axis=0, keepdims=True),
                                0.0)
    # The same masks transposed (fewer distinct [C, C] operands):
    dg = dg + dot_tn(lower, r_all)  # t ≤ i in i's block
    dg = dg + dot_tn(later, col_all)  # j < t in j's block

    def diagonal(d, carry):
        dq, dk, dg = carry
        col = start + d
        pick = cols == col
        kd = dot(pick.astype(F32), k)
        valid = col <= row
        e = jnp.exp(jnp.where(valid, span_sum((cols > col) & (cols <= rows), g, precision=TF32X3), -jnp.inf))
        dpd = jnp.sum(jnp.where(pick, dp, 0.0), axis=1, keepdims=True)
        dskd = jnp.sum(jnp.where(pick, dsk, 0.0), axis=1, keepdims=True)
        ke = kd * e
        dq = dq + dpd * ke
        cz = (dpd * q + dskd * k) * e
        dk = dk + dskd * ke + dot_tn(pick.astype(F32), cz)
        # M_i goes to the t of its block with col_i < t ≤ i.
        dg = dg + dot((same & (cols >= rows) & (row > col)).astype(F32), kd * cz)
        return dq, dk, dg

    return jax.lax.fori_loop(0, s, diagonal, (dq, dk, dg))


def _kda_intra_backward_kernel(*, q, k, v, g, beta, t, sk, u, w, dqg, dkg, dgamma, dp, du, dw, dq, dk, dv, dg,
                               dbeta, chunk):
    """One chunk: ``dq, dk, dv, dg, dβ`` from the cotangents of its factors (module docstring)."""
    kdim, vdim = k.shape[-1], v.shape[-1]
    bk, bv = min(kdim, KDA_BLOCK_K), min(vdim, KDA_BLOCK_K)
    b = beta[...].astype(F32)
    tc = t[...]
    rows, cols = square_iota(chunk)
    upto = (cols <= rows).astype(F32)  # [i, t]: t ≤ i
    after = (cols > rows).astype(F32)  # [j, t]: t > j

    def v_block(i, carry):
        da, db = carry
        vs = pl.ds(i * bv, bv)
        dr = dot_tn(tc, du[:, vs])
        dv[:, vs] = dr * b[:, None]
        return da + dot_nt(dr, u[:, vs]), db + jnp.sum(dr * v[:, vs].astype(F32), axis=1)

    def w_block(i, carry):
        da, db = carry
        cs = pl.ds(i * bk, bk)
        dr = dot_tn(tc, dw[:, cs])
        gk = k[:, cs].astype(F32) * jnp.exp(dot(upto, g[:, cs].astype(F32)))
        return da + dot_nt(dr, w[:, cs]), db + jnp.sum(dr * gk, axis=1)

    zeros = (jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk,), F32))
    carry = jax.lax.fori_loop(0, vdim // bv, v_block, zeros)
    da, db = jax.lax.fori_loop(0, kdim // bk, w_block, carry)
    da = -jnp.where(rows > cols, da, 0.0)
    dbeta[...] = db + jnp.sum(da * sk[...], axis=1)
    dsk = da * b[:, None]
    dpc = dp[...]

    def channels(i, _):
        cs = pl.ds(i * bk, bk)
        qb = q[:, cs].astype(F32)
        kb = k[:, cs].astype(F32)
        gb = g[:, cs].astype(F32)
        gate = jnp.exp(dot(upto, gb))  # Γ_i
        tail = jnp.exp(dot(after, gb))  # exp(Σ_{t>j} g_t)
        dqg_b, dkg_b = dqg[:, cs], dkg[:, cs]
        dr_w = dot_tn(tc, dw[:, cs]) * b[:, None]  # β ⊙ dR_W
        dq_b, dk_b, dg_b = _scores_backward(qb, kb, gb, dpc, dsk, chunk)
        dq[:, cs] = dq_b + dqg_b * gate
        dk[:, cs] = dk_b + dkg_b * tail + dr_w * gate
        prefix = (dqg_b * qb + dr_w * kb) * gate  # cotangent of G_i = Σ_{t≤i} g_t
        suffix = dkg_b * kb * tail  # cotangent of Σ_{t>j} g_t
        total = dgamma[cs] * jnp.exp(jnp.sum(gb, axis=0))  # cotangent of Σ_t g_t
        dg[:, cs] = dg_b + dot_tn(upto, prefix) + dot_tn(after, suffix) + total[None, :]
        return 0

    jax.lax.fori_loop(0, kdim // bk, channels, 0)


def kda_intra_backward(q, k, v, g, beta, t, sk, u, w, cot, *, chunk: int, config: LinearAttentionConfig):
    """The per-chunk gradients, float32 ``(dq, dk [BH, Tp, K], dv [BH, Tp, V], dg [BH, Tp, K], dβ [BH, Tp])``.

    Args: ``q, k, g [BH, Tp, K]``, ``v [BH, Tp, V]``, ``beta [BH, Tp]`` (as in
    `triton_intra.kda_intra_forward`); its ``t``, ``sk [BH, Tp, C]`` (``with_solve``),
    ``u [BH, Tp, V]``, ``w [BH, Tp, K]``; ``cot`` the cotangents of its outputs:
    ``qg, kg, W [BH, Tp, K]``, ``gamma [BH, NT, K]``, ``P [BH, Tp, C]`` (lower),
    ``U [BH, Tp, V]``. One stage whatever ``config.num_stages`` (loops over the
    ``K/64`` channel blocks of one chunk; a second stage adds shared memory to
    a kernel at 177 KiB and found nothing to pipeline).
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
    outs = triton_kernel_call(
        functools.partial(_kda_intra_backward_kernel, chunk=chunk), grid=(nt, bh),
        inputs=dict(q=operand(q, kspec), k=operand(k, kspec), v=operand(v, vspec), g=operand(g, kspec),
                    beta=operand(beta, vec), t=operand(t, cspec), sk=operand(sk, cspec), u=operand(u, vspec),
                    w=operand(w, kspec), dqg=operand(cot["qg"], kspec), dkg=operand(cot["kg"], kspec),
                    dgamma=operand(cot["gamma"], pl.BlockSpec((None, None, kdim), lambda c, h: (h, c, 0))),
                    dp=operand(cot["P"], cspec), du=operand(cot["U"], vspec), dw=operand(cot["W"], kspec)),
        outputs=dict(dq=output((bh, tp, kdim), F32, kspec), dk=output((bh, tp, kdim), F32, kspec),
                     dv=output((bh, tp, vdim), F32, vspec), dg=output((bh, tp, kdim), F32, kspec),
                     dbeta=output((bh, tp), F32, vec)),
        num_warps=config.num_warps, num_stages=1, name="stellax_kda_intra_bwd",
    )
    return outs.dq, outs.dk, outs.dv, outs.dg, outs.dbeta
