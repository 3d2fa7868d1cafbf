"""Pallas Triton kernels of stages 1–4 (decay sums, scores, triangular solve,
W/U) for one chunk of 64 tokens, grid ``(NT, BH)``.

Arrays are heads-major, flattened to ``[BH, Tp, D]`` (``BH = Bs·HV``, ``Tp``
a multiple of the chunk ``C``, ``D`` padded with zeros to a power of two
≥ 16; `layout`). Notation as in `wy.py`.

* `gdn_wy_forward` (GDN's scalar decays ``g [BH, Tp]``, delta rule only): per
  chunk ``A = strict_lower(β_i exp(D_ij) k_i·k_j)``, ``T = (I + A)⁻¹`` by the
  nilpotent product ``(I − A)(I + A²)…(I + A³²)`` (its steps serialized on sm_90:
  `solve.unit_lower_inverse`), then ``U = T(β⊙V)`` and
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
from .decay import masked_decay, span_sum, tile_spans
from .layout import check_flat_layout
from .scores import channel_scores
from .solve import unit_lower_inverse


def _chunk_spec(chunk: int, d: int):
    """One chunk's ``[C, d]`` rows of a ``[BH, Tp, d]`` array, grid ``(NT, BH)``."""
    return pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))


def _chunk_vec(chunk: int):
    """One chunk's ``[C]`` scalars of a ``[BH, Tp]`` array, grid ``(NT, BH)``."""
    return pl.BlockSpec((None, chunk), lambda c, h: (h, c))


# -- GDN: the WY representation ------------------------------------------------------
def _gdn_wy_kernel(*, k, v, g, beta, u, w, chunk, serial):
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
                             precision=TF32X3, serial=serial)

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


def gdn_wy_forward(k, v, g, beta, *, chunk: int, config: LinearAttentionConfig):
    """The delta rule's ``(U [BH, Tp, V], W [BH, Tp, K])`` float32 per chunk.

    Args: ``k [BH, Tp, K]``, ``v [BH, Tp, V]`` (any float dtype), float32 log
    decays ``g [BH, Tp]`` and ``beta [BH, Tp]``.
    """
    bh, tp, kdim = k.shape
    vdim = v.shape[-1]
    kspec, vspec, vec = _chunk_spec(chunk, kdim), _chunk_spec(chunk, vdim), _chunk_vec(chunk)
    outs = triton_kernel_call(
        functools.partial(_gdn_wy_kernel, chunk=chunk, serial=not current_platform().nvidia_below((9, 0))), grid=(tp // chunk, bh),
        inputs=dict(k=operand(k, kspec), v=operand(v, vspec), g=operand(g, vec), beta=operand(beta, vec)),
        outputs=dict(u=output(v.shape, F32, vspec), w=output(k.shape, F32, kspec)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_gdn_wy",
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
