"""Pallas Triton kernel for the intra-chunk part of the GDN / SSD backward (scalar decays).

The reverse state scan (`triton.state_backward`) yields, per chunk ``c``, the
gradient ``dS`` of the chunk's final state and the full gradient ``dΔ`` of
the residuals. With those, every chunk's gradients of ``q, k, v, g, β`` are
independent: `intra_backward` runs one program per (chunk, head, value block)
and recomputes what the forward built (``P``, ``A``, ``T = (I + A)⁻¹``, ``U``,
``W``) instead of storing it. Notation as in `chunk.py`; one chunk of ``C``
rows, ``G_i = Σ_{t≤i} g_t``, ``tail_j = Σ_{t>j} g_t``, ``γ = exp(Σ_t g_t)``,
``E_ij = exp(Σ_{j<t≤i} g_t)`` (0 above the diagonal), ``S`` the
chunk-initial state. The forward of a chunk is

    O  = (Γ⊙Q) S + P Δ,          P = (Q Kᵀ) ⊙ E  (j ≤ i)
    Δ  = U − W S,                U = T(β⊙V), W = T(β⊙Γ⊙K), T = (I + A)⁻¹,
    S' = γ S + K̃ᵀ Δ,             K̃ = K ⊙ exp(tail),  A = β ⊙ (K Kᵀ) ⊙ E  (j < i)

(SSD: no ``β``, ``Δ = U = V``, ``W = 0``). Its backward, for one value block:

    dQ̃ = dO Sᵀ,  dK̃ = Δ dS'ᵀ,  dγ = Σ S ⊙ dS',  dP = lower(dO Δᵀ)
    dQ = dQ̃ ⊙ Γ + (dP ⊙ E) K,   dK = dK̃ ⊙ exp(tail) + (dP ⊙ E)ᵀ Q
    delta rule:  dR_v = Tᵀ dΔ,  dR_w = −Tᵀ dΔ Sᵀ,  dA = −strict_lower(dR_v Uᵀ + dR_w Wᵀ)
                 dV = β ⊙ dR_v,  dK += β Γ ⊙ dR_w + dA_k K + dA_kᵀ K  (dA_k = β ⊙ dA ⊙ E)
                 dβ = Σ_v dR_v ⊙ V + Σ_k dR_w ⊙ Γ K + Σ_j dA ⊙ (K Kᵀ) ⊙ E
    SSD:         dV = dΔ

and the per-step decays through every sum they enter — the prefixes ``G_i``
(``i ≥ t``), the tails (``j < t``), the total and the spans ``D_ij``
(``i ≥ t > j``):

    dg_t = Σ_{i≥t} dG_i + Σ_{j<t} dtail_j + γ dγ + Σ_{i≥t>j} M_ij,
    dG_i = Σ_k dQ̃⊙Q̃ + β_i Γ_i Σ_k dR_w⊙K,  dtail_j = Σ_k dK̃⊙K̃,  M = dP⊙P + dA⊙A,

each summed over exactly the positions that depend on ``g_t`` — not as the
reverse cumsum of ``dG_i + Σ_j M_ij − Σ_j M_ji − dtail_i + …``, whose ``±M``
of the pairs with both ends at or after ``t`` cancel only up to rounding (an
error large against the small ``dg`` of strong decays); ``Σ_{j<t} M_ij`` is
one matmul with a 0/1 matrix.

Every term is linear in the value block's cotangents, so the kernel writes
per-value-block partials of ``dq, dk, dg, dβ`` (``[NV, ...]``, summed in XLA:
no two programs write one element, no atomics, deterministic) and ``dv``
directly. All float32 at ``Precision.HIGHEST``; every exponent is ≤ 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import triton_call
from .configs import LinearAttentionConfig
from .triton import _decay, _dot, _dot_nt, _dot_tn, _iota, _spans, unit_lower_inverse

F32 = jnp.float32
#: Key columns per step of the kernel's loops over K.
BLOCK_K = 64
#: Most value columns per program, and no software pipelining: the PTX tier
#: measured (sm_90, K-independent) 112 / 144 / 208 KiB of shared memory at
#: block_v = 32 / 64 / 128 with 1 stage and 136 / 176 KiB at 32 / 64 with 2;
#: capped, every config of the shared space fits sm_80's 163 KiB.
MAX_BLOCK_V = 64


def _intra_backward_kernel(*refs, chunk, block_k, has_beta):
    refs = list(refs)
    q_ref, k_ref, v_ref, g_ref = refs[:4]
    refs = refs[4:]
    b_ref = refs.pop(0) if has_beta else None
    s_ref, d_ref, ds_ref, dd_ref, do_ref, dq_ref, dk_ref, dv_ref, dg_ref = refs[:9]
    db_ref = refs[9] if has_beta else None
    nk = q_ref.shape[-1] // block_k

    # The [C, K] operands are read in [C, block_k] column blocks (loops over K),
    # so no dot holds more than a [C, block_k] tile of them (registers and
    # shared memory stay bounded at K = 256).
    def cols_of(ref, i):
        return ref[:, pl.ds(i * block_k, block_k)].astype(F32)

    def rows_of(ref, i):
        return ref[pl.ds(i * block_k, block_k), :]

    g = g_ref[...].astype(F32)
    do = do_ref[...]
    dd = dd_ref[...]
    rows, cols = _iota(chunk)
    spans, prefix, tail, total = _spans(g, chunk)
    gate = jnp.exp(prefix)  # Γ_i ≤ 1
    keep = jnp.exp(tail)  # exp(Σ_{t>j} g_t) ≤ 1
    decay = _decay(spans, rows >= cols)
    zero_cc = jnp.zeros((chunk, chunk), F32)
    zero_c = jnp.zeros((chunk,), F32)

    # K-contractions: Q Kᵀ, K Kᵀ and dγ = Σ S ⊙ dS'.
    def scores(i, acc):
        qk, kk, dgamma = acc
        qb, kb = cols_of(q_ref, i), cols_of(k_ref, i)
        qk = qk + _dot_nt(qb, kb)
        if has_beta:
            kk = kk + _dot_nt(kb, kb)
        return qk, kk, dgamma + jnp.sum(rows_of(s_ref, i) * rows_of(ds_ref, i))

    qk, kk, dgamma = jax.lax.fori_loop(0, nk, scores, (zero_cc, zero_cc, jnp.zeros((), F32)))
    dp = jnp.where(rows >= cols, _dot_nt(do, d_ref[...]), 0.0)  # dO Δᵀ
    dpe = dp * decay
    m = dpe * qk  # dP ⊙ P

    if has_beta:
        b = b_ref[...].astype(F32)
        v = v_ref[...].astype(F32)
        strict = _decay(spans, rows > cols)
        t = unit_lower_inverse(kk * strict * b[:, None], rows, cols, chunk)
        bg = b * gate
        u = _dot(t, v * b[:, None])  # U = T(β⊙V)          [C, BV]
        drv = _dot_tn(t, dd)  # dR_v = Tᵀ dΔ           [C, BV]
        dv_ref[...] = (drv * b[:, None]).astype(dv_ref.dtype)

        def d_rw(i):  # dR_w = Tᵀ dW, dW = −dΔ Sᵀ, columns of block i
            return -_dot_tn(t, _dot_nt(dd, rows_of(s_ref, i)))

        def through_w(i, acc):
            rw_w, rw_k = acc
            kb = cols_of(k_ref, i)
            drw = d_rw(i)
            w = _dot(t, kb * bg[:, None])  # W = T(β⊙Γ⊙K)
            return rw_w + _dot_nt(drw, w), rw_k + jnp.sum(drw * kb, axis=1)

        rw_w, rw_k = jax.lax.fori_loop(0, nk, through_w, (zero_cc, zero_c))
        da = -jnp.where(rows > cols, _dot_nt(drv, u) + rw_w, 0.0)
        dak = da * strict  # gradient of (K Kᵀ ⊙ E) before the β row scale
        db_ref[...] = (jnp.sum(drv * v, axis=1) + rw_k * gate + jnp.sum(dak * kk, axis=1)).astype(db_ref.dtype)
        dak = dak * b[:, None]
        m = m + dak * kk  # dA ⊙ A
        d_prefix = rw_k * bg
    else:
        dv_ref[...] = dd.astype(dv_ref.dtype)
        d_prefix = zero_c

    # dQ and dK column block by column block, with the row sums through Γ and the tails.
    def grads(i, acc):
        d_prefix, d_tail = acc
        qb, kb = cols_of(q_ref, i), cols_of(k_ref, i)
        dqg = _dot_nt(do, rows_of(s_ref, i))  # dQ̃ = dO Sᵀ
        dkg = _dot_nt(d_ref[...], rows_of(ds_ref, i))  # dK̃ = Δ dS'ᵀ
        dq = dqg * gate[:, None] + _dot(dpe, kb)
        dk = dkg * keep[:, None] + _dot_tn(dpe, qb)
        if has_beta:
            dk = dk + d_rw(i) * bg[:, None] + _dot(dak, kb) + _dot_tn(dak, kb)
        dq_ref[:, pl.ds(i * block_k, block_k)] = dq.astype(dq_ref.dtype)
        dk_ref[:, pl.ds(i * block_k, block_k)] = dk.astype(dk_ref.dtype)
        return d_prefix + jnp.sum(dqg * qb, axis=1) * gate, d_tail + jnp.sum(dkg * kb, axis=1) * keep

    d_prefix, d_tail = jax.lax.fori_loop(0, nk, grads, (d_prefix, zero_c))

    # Summed over what each g_t enters, never as differences of prefix-sum
    # gradients (those cancel digits under strong decays): G_i (i ≥ t), tail_j
    # (j < t), the chunk total, and the spans D_ij (i ≥ t > j).
    m_before = _dot(m, (rows < cols).astype(F32))  # [i, t]: Σ_{j<t} M_ij
    dg = (jnp.sum(jnp.where(rows >= cols, d_prefix[:, None] + m_before, 0.0), axis=0)
          + jnp.sum(jnp.where(rows < cols, d_tail[:, None], 0.0), axis=0) + jnp.exp(total) * dgamma)
    dg_ref[...] = dg.astype(dg_ref.dtype)


def intra_backward(q, k, v, g, beta, states, delta, d_states, d_delta, do, *, chunk: int,
                   config: LinearAttentionConfig):
    """Per-chunk gradients of the chunked recurrence's inputs.

    Args (float32 unless noted, heads-major and flattened, ``Tp`` a multiple of
    ``chunk``, ``K``/``V`` powers of two ≥ 16):
      q, k: ``[BH, Tp, K]`` (q already scaled; any float dtype).
      v: ``[BH, Tp, V]`` (any float dtype).
      g: per-step log decays ``[BH, Tp]``; beta: ``[BH, Tp]`` or ``None`` (SSD).
      states: chunk-initial states ``S_c [BH, NT, K, V]``; delta: ``Δ [BH, Tp, V]``.
      d_states: gradients of each chunk's final state ``[BH, NT, K, V]``;
      d_delta: ``dΔ [BH, Tp, V]``; do: ``dO [BH, Tp, V]`` (from `triton.state_backward`).
    Returns float32 ``(dq [BH, Tp, K], dk [BH, Tp, K], dv [BH, Tp, V], dg [BH, Tp],
    dbeta [BH, Tp] or None)``; ``dq, dk, dg, dbeta`` are sums over ``V/bv``
    per-block partials written by the kernel, ``bv = min(config.block_v,
    MAX_BLOCK_V, V)``; the kernel runs ``config.num_warps`` warps, one stage.
    """
    bh, tp, kdim = k.shape
    vdim = v.shape[-1]
    if tp % chunk:
        raise ValueError(f"k: expected a padded length that is a multiple of chunk={chunk}, got {tp}")
    for name, d in (("k", kdim), ("v", vdim)):
        if d < 16 or d & (d - 1):
            raise ValueError(f"{name}: expected a last dimension that is a power of two >= 16 (padded_dim), got {d}")
    nt = tp // chunk
    if states.shape != (bh, nt, kdim, vdim) or d_states.shape != states.shape:
        raise ValueError(f"states, d_states: expected shape {(bh, nt, kdim, vdim)}, "
                         f"got {states.shape} and {d_states.shape}")
    bv = min(config.block_v, MAX_BLOCK_V, vdim)
    nv = vdim // bv
    has_beta = beta is not None
    qk = pl.BlockSpec((None, chunk, kdim), lambda c, h, j: (h, c, 0))
    vb = pl.BlockSpec((None, chunk, bv), lambda c, h, j: (h, c, j))
    vec = pl.BlockSpec((None, chunk), lambda c, h, j: (h, c))
    state = pl.BlockSpec((None, None, kdim, bv), lambda c, h, j: (h, c, 0, j))
    part_k = pl.BlockSpec((None, None, chunk, kdim), lambda c, h, j: (j, h, c, 0))
    part_vec = pl.BlockSpec((None, None, chunk), lambda c, h, j: (j, h, c))
    inputs = [q, k, v, g] + ([beta] if has_beta else []) + [states, delta, d_states, d_delta, do]
    in_specs = [qk, qk, vb, vec] + ([vec] if has_beta else []) + [state, vb, state, vb, vb]
    out_shape = [jax.ShapeDtypeStruct((nv, bh, tp, kdim), F32), jax.ShapeDtypeStruct((nv, bh, tp, kdim), F32),
                 jax.ShapeDtypeStruct((bh, tp, vdim), F32), jax.ShapeDtypeStruct((nv, bh, tp), F32)]
    out_specs = [part_k, part_k, vb, part_vec]
    if has_beta:
        out_shape.append(jax.ShapeDtypeStruct((nv, bh, tp), F32))
        out_specs.append(part_vec)
    outs = triton_call(
        functools.partial(_intra_backward_kernel, chunk=chunk, block_k=min(BLOCK_K, kdim), has_beta=has_beta),
        out_shape=out_shape, grid=(nt, bh, nv), in_specs=in_specs, out_specs=out_specs,
        num_warps=config.num_warps, num_stages=1, name="stellax_linear_attention_intra_bwd",
    )(*inputs)
    dq, dk, dv, dg = outs[0].sum(0), outs[1].sum(0), outs[2], outs[3].sum(0)
    dbeta = outs[4].sum(0) if has_beta else None
    return dq, dk, dv, dg, dbeta
