"""Pallas Triton kernels of stages 1–4 (decay sums, scores, triangular solve,
W/U) for one chunk of 64 tokens, grid ``(NT, BH)``.

Arrays are heads-major, flattened to ``[BH, Tp, D]`` (``BH = Bs·HV``, ``Tp``
a multiple of the chunk ``C``, ``D`` padded with zeros to a power of two
≥ 16; `layout`). Notation as in `wy.py`.

* `gdn_wy_forward` (GDN's scalar decays ``g [BH, Tp]``, delta rule only): per
  chunk ``A = strict_lower(β_i exp(D_ij) k_i·k_j)``, ``T = (I + A)⁻¹`` by
  merging diagonal blocks of doubling size (`solve.merge_inverse`, accurate
  with correlated keys; below sm_90 in blocks of 32 rows,
  `solve.lazy_block_inverse`: the diagonal blocks by row-by-row forward
  substitution, the others by matmuls), then ``U = T(β⊙V)`` and
  ``W = T(β⊙Γ⊙K)``. SSD (no delta rule) skips this stage (``U = V``).
* `kda_intra_forward` (KDA's per-channel decays ``g [BH, Tp, K]``; padded
  channels and tokens have ``g = 0``, an identity step), two kernels with the
  k scores in HBM between them (fla's split): `stellax_kda_scores` forms the
  scores of q and k on sub-blocks of 16 rows (tiles ``[16, 16]`` and
  ``[16, channels]`` only: `scores.sub_block_spans`,
  `scores.diagonal_block_scores`) — ``P`` (the causal decayed ``q·k`` scores)
  and ``S_k`` (the strictly lower ``k·k`` ones, ``A = β⊙S_k``) — and the
  factors the other stages need, which per channel cannot be recomputed
  cheaply: ``Q⊙Γ``, ``K̃ = K⊙exp(Σ_{t>j} g_t)`` and ``Γ_C = exp(Σ_t g_t)``;
  `stellax_kda_intra` then forms ``T = (I + A)⁻¹``, ``U`` and ``W``. Both run
  on 4 warps whatever the config (`KDA_INTRA_WARPS`).

The chunk matmuls (``K Kᵀ``, the inverse's products, ``T(β⊙V)``, ``T(β⊙Γ⊙K)``),
KDA's sub-block scores and in-block tails (0/1-mask matmuls) run at the call's
precision as Triton takes it (`core.pallas.triton_precision`: `TF32X3`, three
TF32 tensor-core passes, about float32 accuracy, for ``high`` / ``highest``; one
TF32 pass for ``default``; an IEEE float32 dot is scalar FMA on a GPU); GDN's
pair spans and KDA's prefixes are cumulative sums (`decay.tile_spans`). Every
exponent is ≤ 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import current_platform
from ...core.pallas import F32, HIGHEST, dot, dot_nt, operand, output, square_iota, triton_kernel_call, triton_precision
from .configs import KDA_BLOCK_K, LinearAttentionConfig
from .decay import block_pair_spans, masked_decay, tile_spans
from .layout import check_flat_layout
from .scores import CHANNEL_SUB_BLOCK, diagonal_block_scores, sub_block_spans
from .solve import lazy_block_inverse, merge_inverse, sub_block

#: Rows per block of the GDN WY kernel below sm_90 (`_gdn_wy_blocked_kernel`). sm_80,
#: spill stores per thread at the heuristic's configs (K=V=128 / K=32, V=16 / K=16, V=32):
#: whole-chunk kernel 2592 / 2640 / 1916 B; blocks of 16 rows 608 / 12 / 296 B; of 32 rows 0 / 12 / 12 B
#: with the nilpotent product on the diagonal blocks, 0 / 0 / 0 B by row-by-row substitution.
WY_BLOCK = 32
#: Key columns per step of the blocked kernel's score loop (64 at K = 128: 40 B of spills; 32: none).
WY_SCORE_BLOCK_K = 32


def _chunk_spec(chunk: int, d: int):
    """One chunk's ``[C, d]`` rows of a ``[BH, Tp, d]`` array, grid ``(NT, BH)``."""
    return pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))


def _chunk_vec(chunk: int):
    """One chunk's ``[C]`` scalars of a ``[BH, Tp]`` array, grid ``(NT, BH)``."""
    return pl.BlockSpec((None, chunk), lambda c, h: (h, c))


# -- GDN: the WY representation ------------------------------------------------------
def _gdn_wy_kernel(*, k, v, g, beta, u, w, chunk, precision):
    """One chunk: ``U = T(β⊙V)``, ``W = T(β⊙Γ⊙K)``, ``T = (I + strict_lower(β exp(D) K Kᵀ))⁻¹``;
    the ``[C, K]`` / ``[C, V]`` operands in blocks of `KDA_BLOCK_K` columns (loops:
    no dot holds a whole ``[C, 128]`` tile)."""
    kdim, vdim = k.shape[-1], v.shape[-1]
    bk, bv = min(kdim, KDA_BLOCK_K), min(vdim, KDA_BLOCK_K)
    b = beta[...]
    rows, cols = square_iota(chunk)

    def scores(i, kk):
        kb = k[:, pl.ds(i * bk, bk)].astype(F32)
        return kk + dot_nt(kb, kb, precision=precision)

    kk = jax.lax.fori_loop(0, kdim // bk, scores, jnp.zeros((chunk, chunk), F32))
    spans, prefix, _, _ = tile_spans(g[...], chunk)
    a = kk * masked_decay(spans, rows > cols) * b[:, None]
    inv = merge_inverse(a, rows, cols, chunk, precision=precision)

    def u_block(i, _):
        vs = pl.ds(i * bv, bv)
        u[:, vs] = dot(inv, v[:, vs].astype(F32) * b[:, None], precision=precision).astype(u.dtype)
        return 0

    scale = (b * jnp.exp(prefix))[:, None]

    def w_block(i, _):
        cs = pl.ds(i * bk, bk)
        w[:, cs] = dot(inv, k[:, cs].astype(F32) * scale, precision=precision).astype(w.dtype)
        return 0

    jax.lax.fori_loop(0, vdim // bv, u_block, 0)
    jax.lax.fori_loop(0, kdim // bk, w_block, 0)


def _gdn_wy_blocked_kernel(*, k, v, g, beta, u, w, chunk, precision):
    """`_gdn_wy_kernel` in blocks of `WY_BLOCK` rows (the kernel below sm_90):
    per block pair ``(a, c ≤ a)`` the scores ``A_ac = β_a exp(D_ac) k_a k_cᵀ``
    (`decay.block_pair_spans`; ``K`` in steps of `WY_SCORE_BLOCK_K` columns),
    the blocks of ``T`` by forward substitution (`solve.lazy_block_inverse`: the
    diagonal blocks row by row without matmuls, each off-diagonal block of ``A``
    formed only after them), then ``U_a = Σ_{c≤a} T_ac (β⊙V)_c`` and
    ``W_a = Σ_{c≤a} T_ac (β⊙Γ⊙K)_c`` (one loop per block row ``a``: only ``T``'s
    row ``a`` is live in it). Every matmul has a ``[32, ≤64]`` left and a
    ``[≤64, ≤64]`` right operand, so mma.sync's register operands stay small."""
    kdim = k.shape[-1]
    s, step_k = WY_BLOCK, min(kdim, WY_SCORE_BLOCK_K)
    nb = chunk // s
    rows = [pl.ds(a * s, s) for a in range(nb)]
    betas = [beta[r] for r in rows]
    blocks = [tile_spans(g[r], s) for r in rows]  # (D, G, tail, total) within each block
    prefix, start = [], 0.0  # G_i = Σ_{t≤i} g_t: the totals of the earlier blocks + the block's own prefix
    for a in range(nb):
        prefix.append(start + blocks[a][1])
        start = start + blocks[a][3]
    inner_rows, inner_cols = square_iota(s)

    def scores(a, c):
        def step(i, acc):
            cs = pl.ds(i * step_k, step_k)
            return acc + dot_nt(k[rows[a], cs].astype(F32), k[rows[c], cs].astype(F32), precision=precision)

        kk = jax.lax.fori_loop(0, kdim // step_k, step, jnp.zeros((s, s), F32))
        mask = inner_rows > inner_cols if a == c else inner_rows >= 0
        return kk * masked_decay(block_pair_spans(blocks, a, c), mask) * betas[a][:, None]

    t = lazy_block_inverse(scores, nb, s, precision=precision)

    def apply(out, src, scales):  # out[rows a] = Σ_{c≤a} T_ac (scale_c ⊙ src_c), by column blocks
        width = min(src.shape[-1], KDA_BLOCK_K)
        for a in range(nb):
            def block(i, _, a=a):
                cs = pl.ds(i * width, width)
                acc = jnp.zeros((s, width), F32)
                for c in range(a + 1):
                    acc = acc + dot(t[a][c], src[rows[c], cs].astype(F32) * scales[c][:, None], precision=precision)
                out[rows[a], cs] = acc.astype(out.dtype)
                return 0

            jax.lax.fori_loop(0, src.shape[-1] // width, block, 0)

    apply(u, v, betas)
    apply(w, k, [b * jnp.exp(p) for b, p in zip(betas, prefix)])


def gdn_wy_forward(k, v, g, beta, *, chunk: int, config: LinearAttentionConfig, precision=HIGHEST):
    """The delta rule's ``(U [BH, Tp, V], W [BH, Tp, K])`` float32 per chunk.

    Args: ``k [BH, Tp, K]``, ``v [BH, Tp, V]`` (any float dtype), float32 log
    decays ``g [BH, Tp]`` and ``beta [BH, Tp]``.
    Below sm_90 one stage whatever ``config.num_stages`` when the kernel's loops over
    columns run once (``K ≤ WY_SCORE_BLOCK_K``, ``V ≤ KDA_BLOCK_K``): the loop left,
    the diagonal blocks' substitution, loads nothing a second stage could prefetch
    (no cp.async; static tier).
    """
    bh, tp, kdim = k.shape
    vdim = v.shape[-1]
    kspec, vspec, vec = _chunk_spec(chunk, kdim), _chunk_spec(chunk, vdim), _chunk_vec(chunk)
    stages = config.num_stages
    if current_platform().nvidia_below((9, 0)):  # mma.sync: small register operands (see the kernel)
        kernel = functools.partial(_gdn_wy_blocked_kernel, chunk=chunk, precision=triton_precision(precision))
        stages = stages if kdim > WY_SCORE_BLOCK_K or vdim > KDA_BLOCK_K else 1
    else:  # wgmma: whole-chunk matmuls
        kernel = functools.partial(_gdn_wy_kernel, chunk=chunk, precision=triton_precision(precision))
    outs = triton_kernel_call(
        kernel, grid=(tp // chunk, bh),
        inputs=dict(k=operand(k, kspec), v=operand(v, vspec), g=operand(g, vec), beta=operand(beta, vec)),
        outputs=dict(u=output(v.shape, F32, vspec), w=output(k.shape, F32, kspec)),
        num_warps=config.num_warps, num_stages=stages, name="stellax_gdn_wy",
    )
    return outs.u, outs.w


# -- KDA: scores and decay factors, then the WY representation ----------------------
#: Channels per step of KDA's score kernel over the off-diagonal sub-block pairs
#: (`_kda_scores_kernel`); sm_90 at K = 128: 32 spilled 8 B, 16 none (231 registers).
KDA_SCORE_BLOCK_K = 16
#: Channels per step of its diagonal sub-blocks. Each step is a serial elementwise loop
#: over the sub-block's 16 columns, so the steps are wide: at K = 128, 4·16 serial
#: iterations per chunk instead of 4·8·16 at 16 channels (231 registers; 219 at 64).
KDA_DIAGONAL_BLOCK_K = 128
#: Channels / value columns per step of KDA's WY kernel (`_kda_wy_kernel`); sm_90 with
#: ``T`` stored: 64 took 253–255 registers and spilled 128 B at K = V = 64, 32 at most 247, none.
KDA_WY_BLOCK = 32
#: Warps of both KDA forward kernels. sm_90, K = V = 64 with ``T`` stored: on 8 warps
#: the WY kernel spilled 176 B (wgmma splits the ``[64, 64]`` tiles' columns, so each
#: warpgroup holds all of the inverse's register operand); on 4 none.
KDA_INTRA_WARPS = 4


def _kda_scores_kernel(*, q, k, g, p, sk, qg, kg, gamma, chunk, precision):
    """One chunk's per-channel decayed scores and decay factors on sub-blocks of
    ``s = 16`` rows (every tile ``[s, s]`` or ``[s, channels]``):

        P_ij   = Σ_c q_ic k_jc exp(Σ_{j<t≤i} g_tc)   (j ≤ i)       → p   [C, C]
        S_k,ij = Σ_c k_ic k_jc exp(Σ_{j<t≤i} g_tc)   (j < i)       → sk  [C, C]  (A = β⊙S_k)
        Q⊙Γ,  K̃_j = k_j exp(Σ_{t>j} g_t),  Γ_C = exp(Σ_t g_t)      → qg, kg [C, K], gamma [K]

    Sub-block ``a`` of rows against an earlier one ``c`` splits the decay at the
    start of ``a``: ``exp(Σ_{a·s≤t≤i} g)·exp(Σ_{j<t<(c+1)·s} g + Σ_{c<b<a} Σ_{t∈b} g)``
    (one ``[s, bk]·[bk, s]`` matmul per pair, `KDA_SCORE_BLOCK_K` channels a step:
    only the ``[s, s]`` sums of block row ``a`` live); the diagonal sub-blocks go
    elementwise (`scores.diagonal_block_scores`, `KDA_DIAGONAL_BLOCK_K` channels a
    step). Every matmul is ``[16, 16]`` (mma.sync, as fla's sub-chunk kernels);
    every exponent is a sum of direct span sums ≤ 0.
    """
    kdim = k.shape[-1]
    bk, bd = min(kdim, KDA_SCORE_BLOCK_K), min(kdim, KDA_DIAGONAL_BLOCK_K)
    s = sub_block(chunk, CHANNEL_SUB_BLOCK)
    nb = chunk // s
    blocks = [pl.ds(a * s, s) for a in range(nb)]
    zero = jnp.zeros((bk,), F32)

    def factors(i, _):
        cs = pl.ds(i * bk, bk)
        prefix, tail, total = zip(*(sub_block_spans(g[r, cs].astype(F32), precision) for r in blocks))
        before = zero  # Σ_{t<a·s} g_t
        for a in range(nb):
            after = functools.reduce(jnp.add, total[a + 1:], zero)
            qg[blocks[a], cs] = q[blocks[a], cs].astype(F32) * jnp.exp(prefix[a] + before[None, :])
            kg[blocks[a], cs] = k[blocks[a], cs].astype(F32) * jnp.exp(tail[a] + after[None, :])
            before = before + total[a]
        gamma[cs] = jnp.exp(before)
        return 0

    def block_row(a):
        def earlier(i, acc):  # the pairs (a, c < a)
            cs = pl.ds(i * bk, bk)
            prefix, tail, total = zip(*(sub_block_spans(g[r, cs].astype(F32), precision) for r in blocks[:a + 1]))
            inner = jnp.exp(prefix[a])
            xs = (q[blocks[a], cs].astype(F32) * inner, k[blocks[a], cs].astype(F32) * inner)
            acc = list(acc)
            between = zero  # Σ_{c<b<a} Σ_{t∈b} g_t
            for c in reversed(range(a)):
                y = k[blocks[c], cs].astype(F32) * jnp.exp(tail[c] + between[None, :])
                acc[c] = tuple(o + dot_nt(x, y, precision=precision) for o, x in zip(acc[c], xs))
                between = between + total[c]
            return tuple(acc)

        def diagonal(i, acc):
            cs = pl.ds(i * bd, bd)
            xs = (q[blocks[a], cs].astype(F32), k[blocks[a], cs].astype(F32))
            return diagonal_block_scores(xs, k, g, a * s, cs, acc)

        zeros = jnp.zeros((s, s), F32)
        acc = jax.lax.fori_loop(0, kdim // bk, earlier, tuple((zeros, zeros) for _ in range(a))) if a else ()
        acc = acc + (jax.lax.fori_loop(0, kdim // bd, diagonal, (zeros, zeros)),)
        rows, cols = square_iota(s)
        for c in range(nb):
            pq, pk = acc[c] if c <= a else (zeros, zeros)
            p[blocks[a], blocks[c]] = pq
            sk[blocks[a], blocks[c]] = jnp.where(rows > cols, pk, 0.0) if c == a else pk

    jax.lax.fori_loop(0, kdim // bk, factors, 0)
    for a in range(nb):
        block_row(a)


def _kda_wy_kernel(*, k, v, g, beta, sk, u, w, t, chunk, precision):
    """One chunk's WY representation: ``T = (I + β⊙S_k)⁻¹`` (`solve.merge_inverse`),
    ``U = T(β⊙V)``, ``W = T(β⊙Γ⊙K)`` (``Γ_i = exp(Σ_{t≤i} g_t)``, a
    cumulative sum), in blocks of `KDA_WY_BLOCK` channels / value columns; ``T`` is
    written when ``t`` is given."""
    kdim, vdim = k.shape[-1], v.shape[-1]
    bk, bv = min(kdim, KDA_WY_BLOCK), min(vdim, KDA_WY_BLOCK)
    b = beta[...].astype(F32)
    rows, cols = square_iota(chunk)
    inv = merge_inverse(sk[...] * b[:, None], rows, cols, chunk, precision=precision)
    if t is not None:
        t[...] = inv

    def w_block(i, _):
        cs = pl.ds(i * bk, bk)
        gate = jnp.exp(jnp.cumsum(g[:, cs].astype(F32), axis=0))
        w[:, cs] = dot(inv, k[:, cs].astype(F32) * gate * b[:, None], precision=precision)
        return 0

    def u_block(i, _):
        vs = pl.ds(i * bv, bv)
        u[:, vs] = dot(inv, v[:, vs].astype(F32) * b[:, None], precision=precision)
        return 0

    jax.lax.fori_loop(0, kdim // bk, w_block, 0)
    jax.lax.fori_loop(0, vdim // bv, u_block, 0)


def kda_intra_forward(q, k, v, g, beta, *, chunk: int, config: LinearAttentionConfig, with_solve: bool = False,
                      precision=HIGHEST):
    """The per-chunk factors, all float32, by two kernels over the grid ``(NT, BH)``:
    `_kda_scores_kernel` (``P``, the strictly lower k scores ``S_k`` and the decay
    factors) then `_kda_wy_kernel` (``T``, ``U``, ``W`` from ``S_k`` in HBM).

    Args: ``q, k, g [BH, Tp, K]`` (q scaled), ``v [BH, Tp, V]``, ``beta [BH, Tp]``.
    Returns ``(U [BH, Tp, V], W [BH, Tp, K], P [BH, Tp, C], Q⊙Γ [BH, Tp, K],
    K̃ [BH, Tp, K], Γ_C [BH, NT, K])`` (``P`` row ``i`` of chunk ``c`` holds
    ``P_ij`` of that chunk's columns ``j``); ``with_solve`` adds ``T [BH, Tp, C]``
    and the strictly lower k scores ``A/β = S_k [BH, Tp, C]`` (for the backward).
    ``config`` is not used: one stage (the kernels' loops run over a few channel
    blocks of one chunk, and a second stage found no load Triton pipelines: no
    cp.async; static tier) and `KDA_INTRA_WARPS`.
    """
    bh, tp, kdim = k.shape
    check_flat_layout(chunk, k=(k, (None, None, None)), q=(q, k.shape), g=(g, k.shape), v=(v, (bh, tp, None)),
                      beta=(beta, (bh, tp)))
    vdim = v.shape[-1]
    nt = tp // chunk
    kspec, vspec, cspec = _chunk_spec(chunk, kdim), _chunk_spec(chunk, vdim), _chunk_spec(chunk, chunk)
    tf32 = triton_precision(precision)
    square = output((bh, tp, chunk), F32, cspec)
    per_channel = output((bh, tp, kdim), F32, kspec)
    scores = triton_kernel_call(
        functools.partial(_kda_scores_kernel, chunk=chunk, precision=tf32), grid=(nt, bh),
        inputs=dict(q=operand(q, kspec), k=operand(k, kspec), g=operand(g, kspec)),
        outputs=dict(p=square, sk=square, qg=per_channel, kg=per_channel,
                     gamma=output((bh, nt, kdim), F32, pl.BlockSpec((None, None, kdim), lambda c, h: (h, c, 0)))),
        num_warps=KDA_INTRA_WARPS, num_stages=1, name="stellax_kda_scores",
    )
    wy = triton_kernel_call(
        functools.partial(_kda_wy_kernel, chunk=chunk, precision=tf32), grid=(nt, bh),
        inputs=dict(k=operand(k, kspec), v=operand(v, vspec), g=operand(g, kspec),
                    beta=operand(beta, _chunk_vec(chunk)), sk=operand(scores.sk, cspec)),
        outputs=dict(u=output((bh, tp, vdim), F32, vspec), w=per_channel, t=square if with_solve else None),
        num_warps=KDA_INTRA_WARPS, num_stages=1, name="stellax_kda_intra",
    )
    out = (wy.u, wy.w, scores.p, scores.qg, scores.kg, scores.gamma)
    return out + ((wy.t, scores.sk) if with_solve else ())
