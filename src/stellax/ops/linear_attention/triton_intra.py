"""Pallas Triton kernels of stages 1–4 (decay sums, scores, triangular solve,
W/U) for one chunk of 64 tokens, grid ``(NT, BH)``.

Arrays are heads-major, flattened to ``[BH, Tp, D]`` (``BH = Bs·HV``, ``Tp``
a multiple of the chunk ``C``, ``D`` padded with zeros to a power of two
≥ 16; `layout`). Notation as in `wy.py`.

* `gdn_wy_forward` (GDN's scalar decays ``g [BH, Tp]``, delta rule only): per
  chunk ``A = strict_lower(β_i exp(D_ij) k_i·k_j)``, ``T = (I + A)⁻¹`` by the
  nilpotent product ``(I − A)(I + A²)…(I + A³²)`` (its steps serialized:
  `solve.unit_lower_inverse`; below sm_90 in blocks of 32 rows,
  `solve.lazy_block_inverse`: the diagonal blocks by row-by-row forward
  substitution, the others by matmuls), then ``U = T(β⊙V)`` and
  ``W = T(β⊙Γ⊙K)``. SSD (no delta rule) skips this stage (``U = V``).
* `kda_intra_forward` (KDA's per-channel decays ``g [BH, Tp, K]``; padded
  channels and tokens have ``g = 0``, an identity step): the scores of q and
  k (`scores.channel_scores`, in blocks of 64 channels — the scores are sums
  over channels), ``A``, ``T``, ``U``, ``W`` (64 value columns at a time) and
  the factors the other stages need, which per channel cannot be recomputed
  cheaply: ``P`` (the causal decayed ``q·k`` scores), ``Q⊙Γ``,
  ``K̃ = K⊙exp(Σ_{t>j} g_t)`` and ``Γ_C = exp(Σ_t g_t)``.

The chunk matmuls (``K Kᵀ``, the inverse's products, ``T(β⊙V)``, ``T(β⊙Γ⊙K)``)
and KDA's channel scores, gathers and per-channel decay sums (0/1-mask
matmuls) run as `TF32X3` (three TF32 tensor-core passes, about float32
accuracy: an IEEE float32 dot is scalar FMA on a GPU); GDN's pair spans are a
cumulative sum (`decay.tile_spans`). Every exponent is ≤ 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import current_platform
from ...core.pallas import F32, TF32X3, dot, dot_nt, operand, output, square_iota, triton_kernel_call
from .configs import KDA_BLOCK_K, LinearAttentionConfig
from .decay import block_pair_spans, masked_decay, span_sum, tile_spans
from .layout import check_flat_layout
from .scores import channel_scores
from .solve import lazy_block_inverse, unit_lower_inverse

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
def _gdn_wy_kernel(*, k, v, g, beta, u, w, chunk):
    """One chunk: ``U = T(β⊙V)``, ``W = T(β⊙Γ⊙K)``, ``T = (I + strict_lower(β exp(D) K Kᵀ))⁻¹``;
    the ``[C, K]`` / ``[C, V]`` operands in blocks of `KDA_BLOCK_K` columns (loops:
    no dot holds a whole ``[C, 128]`` tile)."""
    kdim, vdim = k.shape[-1], v.shape[-1]
    bk, bv = min(kdim, KDA_BLOCK_K), min(vdim, KDA_BLOCK_K)
    b = beta[...]
    rows, cols = square_iota(chunk)

    def scores(i, kk):
        kb = k[:, pl.ds(i * bk, bk)].astype(F32)
        return kk + dot_nt(kb, kb, precision=TF32X3)

    kk = jax.lax.fori_loop(0, kdim // bk, scores, jnp.zeros((chunk, chunk), F32))
    spans, prefix, _, _ = tile_spans(g[...], chunk)
    inv = unit_lower_inverse(kk * masked_decay(spans, rows > cols) * b[:, None], rows, cols, chunk,
                             precision=TF32X3, serial=True)

    def u_block(i, _):
        vs = pl.ds(i * bv, bv)
        u[:, vs] = dot(inv, v[:, vs].astype(F32) * b[:, None], precision=TF32X3).astype(u.dtype)
        return 0

    scale = (b * jnp.exp(prefix))[:, None]

    def w_block(i, _):
        cs = pl.ds(i * bk, bk)
        w[:, cs] = dot(inv, k[:, cs].astype(F32) * scale, precision=TF32X3).astype(w.dtype)
        return 0

    jax.lax.fori_loop(0, vdim // bv, u_block, 0)
    jax.lax.fori_loop(0, kdim // bk, w_block, 0)


def _gdn_wy_blocked_kernel(*, k, v, g, beta, u, w, chunk):
    """`_gdn_wy_kernel` in blocks of `WY_BLOCK` rows (the kernel below sm_90):
    per block pair ``(a, c ≤ a)`` the scores ``A_ac = β_a exp(D_ac) k_a k_cᵀ``
    (`decay.block_pair_spans`; ``K`` in steps of `WY_SCORE_BLOCK_K` columns),
    the blocks of ``T`` by forward substitution (`solve.lazy_block_inverse`: the
    diagonal blocks row by row without matmuls, each off-diagonal block of ``A``
    formed only after them), then ``U_a = Σ_{c≤a} T_ac (β⊙V)_c`` and
    ``W_a = Σ_{c≤a} T_ac (β⊙Γ⊙K)_c`` (one loop per block row ``a``: only ``T``'s
    row ``a`` is live in it). Every matmul has a ``[32, ≤64]`` left and a
    ``[≤64, ≤64]`` right operand, so mma.sync's register operands stay small."""
    kdim, vdim = k.shape[-1], v.shape[-1]
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
            return acc + dot_nt(k[rows[a], cs].astype(F32), k[rows[c], cs].astype(F32), precision=TF32X3)

        kk = jax.lax.fori_loop(0, kdim // step_k, step, jnp.zeros((s, s), F32))
        mask = inner_rows > inner_cols if a == c else inner_rows >= 0
        return kk * masked_decay(block_pair_spans(blocks, a, c), mask) * betas[a][:, None]

    t = lazy_block_inverse(scores, nb, s, precision=TF32X3)

    def apply(out, src, scales):  # out[rows a] = Σ_{c≤a} T_ac (scale_c ⊙ src_c), by column blocks
        width = min(src.shape[-1], KDA_BLOCK_K)
        for a in range(nb):
            def block(i, _, a=a):
                cs = pl.ds(i * width, width)
                acc = jnp.zeros((s, width), F32)
                for c in range(a + 1):
                    acc = acc + dot(t[a][c], src[rows[c], cs].astype(F32) * scales[c][:, None], precision=TF32X3)
                out[rows[a], cs] = acc.astype(out.dtype)
                return 0

            jax.lax.fori_loop(0, src.shape[-1] // width, block, 0)

    apply(u, v, betas)
    apply(w, k, [b * jnp.exp(p) for b, p in zip(betas, prefix)])


def gdn_wy_forward(k, v, g, beta, *, chunk: int, config: LinearAttentionConfig):
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
        kernel = functools.partial(_gdn_wy_blocked_kernel, chunk=chunk)
        stages = stages if kdim > WY_SCORE_BLOCK_K or vdim > KDA_BLOCK_K else 1
    else:  # wgmma: whole-chunk matmuls, the inverse's steps serialized
        kernel = functools.partial(_gdn_wy_kernel, chunk=chunk)
    outs = triton_kernel_call(
        kernel, grid=(tp // chunk, bh),
        inputs=dict(k=operand(k, kspec), v=operand(v, vspec), g=operand(g, vec), beta=operand(beta, vec)),
        outputs=dict(u=output(v.shape, F32, vspec), w=output(k.shape, F32, kspec)),
        num_warps=config.num_warps, num_stages=stages, name="stellax_gdn_wy",
    )
    return outs.u, outs.w


# -- KDA: scores, WY representation, decay factors -----------------------------------
def _kda_intra_kernel(*, q, k, v, g, beta, u, w, p, qg, kg, gamma, t, sk, chunk, serial):
    """One chunk: the per-channel scores, ``T``, ``U``, ``W`` and the decay factors
    (``T`` and the strictly lower k scores too when ``t``/``sk`` are given)."""
    kdim, vdim = k.shape[-1], v.shape[-1]
    bk, bv = min(kdim, KDA_BLOCK_K), min(vdim, KDA_BLOCK_K)
    b = beta[...].astype(F32)
    rows, cols = square_iota(chunk)

    def load(i):
        cs = pl.ds(i * bk, bk)
        return cs, q[:, cs].astype(F32), k[:, cs].astype(F32), g[:, cs].astype(F32)

    def channels(i, carry):  # the scores are sums over channels: one block of channels at a time
        cs, qb, kb, gb = load(i)
        pq, pk = channel_scores(qb, kb, gb, chunk, precision=TF32X3)
        return carry[0] + pq, carry[1] + pk

    zeros = jnp.zeros((chunk, chunk), F32)
    pq, pk = jax.lax.fori_loop(0, kdim // bk, channels, (zeros, zeros))
    p[...] = pq
    if sk is not None:  # for the backward: the strictly lower k scores (A/β), written now so pk dies here
        sk[...] = jnp.where(rows > cols, pk, 0.0)
    a = jnp.where(rows > cols, pk, 0.0) * b[:, None]
    inv = unit_lower_inverse(a, rows, cols, chunk, precision=TF32X3, serial=serial)
    if t is not None:  # and T
        t[...] = inv

    def w_block(i, _):  # W and the decay factors, after the scores (fewer tiles live in their loop)
        cs, qb, kb, gb = load(i)
        gate = jnp.exp(span_sum(cols <= rows, gb, precision=TF32X3))  # Γ_i = exp(Σ_{t≤i} g_t)
        w[:, cs] = dot(inv, kb * gate * b[:, None], precision=TF32X3)
        qg[:, cs] = qb * gate  # Q⊙Γ
        kg[:, cs] = kb * jnp.exp(span_sum(cols > rows, gb, precision=TF32X3))  # K̃_j = k_j exp(Σ_{t>j} g_t)
        gamma[cs] = jnp.exp(jnp.sum(gb, axis=0))
        return 0

    def u_block(i, _):
        vs = pl.ds(i * bv, bv)
        u[:, vs] = dot(inv, v[:, vs].astype(F32) * b[:, None], precision=TF32X3)
        return 0

    jax.lax.fori_loop(0, kdim // bk, w_block, 0)
    jax.lax.fori_loop(0, vdim // bv, u_block, 0)


def kda_intra_forward(q, k, v, g, beta, *, chunk: int, config: LinearAttentionConfig, with_solve: bool = False):
    """The per-chunk factors, all float32.

    Args: ``q, k, g [BH, Tp, K]`` (q scaled), ``v [BH, Tp, V]``, ``beta [BH, Tp]``.
    Returns ``(U [BH, Tp, V], W [BH, Tp, K], P [BH, Tp, C], Q⊙Γ [BH, Tp, K],
    K̃ [BH, Tp, K], Γ_C [BH, NT, K])`` (``P`` row ``i`` of chunk ``c`` holds
    ``P_ij`` of that chunk's columns ``j``); ``with_solve`` adds ``T [BH, Tp, C]``
    and the strictly lower k scores ``A/β [BH, Tp, C]`` (for the backward).
    One stage whatever ``config.num_stages``: the kernel's loops run over the
    ``K/64`` channel blocks of one chunk (one or two trips at K ≤ 128), and a
    second stage found no load Triton pipelines (no cp.async; static tier).
    """
    bh, tp, kdim = k.shape
    check_flat_layout(chunk, k=(k, (None, None, None)), q=(q, k.shape), g=(g, k.shape), v=(v, (bh, tp, None)),
                      beta=(beta, (bh, tp)))
    vdim = v.shape[-1]
    nt = tp // chunk
    kspec, vspec, cspec = _chunk_spec(chunk, kdim), _chunk_spec(chunk, vdim), _chunk_spec(chunk, chunk)
    square = output((bh, tp, chunk), F32, cspec)
    outs = triton_kernel_call(
        functools.partial(_kda_intra_kernel, chunk=chunk, serial=not current_platform().nvidia_below((9, 0))), grid=(nt, bh),
        inputs=dict(q=operand(q, kspec), k=operand(k, kspec), v=operand(v, vspec), g=operand(g, kspec),
                    beta=operand(beta, _chunk_vec(chunk))),
        outputs=dict(u=output((bh, tp, vdim), F32, vspec), w=output((bh, tp, kdim), F32, kspec), p=square,
                     qg=output((bh, tp, kdim), F32, kspec), kg=output((bh, tp, kdim), F32, kspec),
                     gamma=output((bh, nt, kdim), F32, pl.BlockSpec((None, None, kdim), lambda c, h: (h, c, 0))),
                     t=square if with_solve else None, sk=square if with_solve else None),
        num_warps=config.num_warps, num_stages=1, name="stellax_kda_intra",
    )
    factors = (outs.u, outs.w, outs.p, outs.qg, outs.kg, outs.gamma)
    return factors + ((outs.t, outs.sk) if with_solve else ())
