"""Pallas Triton kernel for the intra-chunk part of the GDN / SSD backward
(scalar decays): stages 6 → 1 backwards, after the reverse state scan.

The reverse state scan (`triton_scan.gdn_state_backward`) yields, per chunk ``c``, the
gradient ``dS`` of the chunk's final state and the full gradient ``dΔ`` of
the residuals. With those, every chunk's gradients of ``q, k, v, g, β`` are
independent: `gdn_intra_backward` runs one program per (chunk, head, value block)
and recomputes what the forward built (``P``, ``A``, ``T = (I + A)⁻¹``, ``U``,
``W``) instead of storing it. Notation as in `wy.py`; one chunk of ``C``
rows, ``G_i = Σ_{t≤i} g_t``, ``tail_j = Σ_{t>j} g_t``, ``γ = exp(Σ_t g_t)``,
``E_ij = exp(Σ_{j<t≤i} g_t)`` (0 above the diagonal), ``S`` the
chunk-initial state. The forward of a chunk is

    O  = (Γ⊙Q) S + P Δ,          P = (Q Kᵀ) ⊙ E  (j ≤ i)
    Δ  = U − W S,                U = T(β⊙V), W = T(β⊙Γ⊙K), T = (I + A)⁻¹,
    S' = γ S + K̃ᵀ Δ,             K̃ = K ⊙ exp(tail),  A = β ⊙ (K Kᵀ) ⊙ E  (j < i)

(SSD: no ``β``, ``Δ = U = V``, ``W = 0``). Its backward, for one value block:

    dQ̃ = dO Sᵀ,  dK̃ = Δ dS'ᵀ,  dγ = Σ S ⊙ dS',  dP = lower(dO Δᵀ)
    dQ = dQ̃ ⊙ Γ + (dP ⊙ E) K,   dK = dK̃ ⊙ exp(tail) + (dP ⊙ E)ᵀ Q
    delta rule:  dR_v = Tᵀ dΔ,  dR_w = −Tᵀ dΔ Sᵀ = −dR_v Sᵀ,  dA = −strict_lower(dR_v Uᵀ + dR_w Wᵀ)
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
directly. All float32, the matmuls as `TF32X3`; every exponent is ≤ 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import current_platform, pallas
from ...core.pallas import F32, TF32X3, operand, output, square_iota, triton_kernel_call
from .configs import LinearAttentionConfig
from .decay import masked_decay, tile_spans
from .solve import unit_lower_inverse

#: Key columns per step of the kernel's loops over K.
BLOCK_K = 64
#: Most value columns per program, and no software pipelining: the PTX tier
#: measured (sm_90, K-independent) 112 / 144 / 208 KiB of shared memory at
#: block_v = 32 / 64 / 128 with 1 stage and 136 / 176 KiB at 32 / 64 with 2;
#: capped, every config of the shared space fits sm_80's 163 KiB.
MAX_BLOCK_V = 64

#: Every matmul of this module runs as `TF32X3` (three TF32 tensor-core passes,
#: about float32 accuracy; an IEEE float32 dot is scalar FMA on a GPU). The 0/1
#: masks and gathers are exact in TF32; their other operand carries < 2⁻²⁰ relative error.
dot = functools.partial(pallas.dot, precision=TF32X3)
dot_nt = functools.partial(pallas.dot_nt, precision=TF32X3)
dot_tn = functools.partial(pallas.dot_tn, precision=TF32X3)


# The [C, K] operands are read in [C, block_k] column blocks (loops over K), so
# no dot holds more than a [C, block_k] tile of them (registers and shared
# memory stay bounded at K = 256).
def _cols(ref, i, block_k: int):
    """Column block ``i`` (``[C, block_k]``, float32) of a ``[C, K]`` ref."""
    return ref[:, pl.ds(i * block_k, block_k)].astype(F32)


def _rows(ref, i, block_k: int):
    """Row block ``i`` (``[block_k, BV]``) of a ``[K, BV]`` state ref."""
    return ref[pl.ds(i * block_k, block_k), :]


def _score_sums(q, k, states, d_states, *, chunk: int, block_k: int, with_kk: bool):
    """The K-contractions ``(Q Kᵀ, K Kᵀ, dγ = Σ S ⊙ dS')`` (``K Kᵀ`` zeros unless ``with_kk``)."""
    zero_cc = jnp.zeros((chunk, chunk), F32)

    def scores(i, acc):
        qk, kk, dgamma = acc
        qb, kb = _cols(q, i, block_k), _cols(k, i, block_k)
        qk = qk + dot_nt(qb, kb)
        if with_kk:
            kk = kk + dot_nt(kb, kb)
        return qk, kk, dgamma + jnp.sum(_rows(states, i, block_k) * _rows(d_states, i, block_k))

    return jax.lax.fori_loop(0, q.shape[-1] // block_k, scores, (zero_cc, zero_cc, jnp.zeros((), F32)))


def _d_rw(drv, states, i, block_k: int):
    """``dR_w = Tᵀ dW`` with ``dW = −dΔ Sᵀ``, the columns of key block ``i``, as
    ``−(Tᵀ dΔ) Sᵀ = −dR_v Sᵀ``: ``T`` is not needed (nor held) for it."""
    return -dot_nt(drv, _rows(states, i, block_k))


def _through_solve(*, k, v, beta, states, dd, kk, spans, gate, chunk: int, block_k: int, serial: bool, dv, dbeta):
    """The delta rule's part: recompute ``T``, ``U``, ``W``; write ``dv = β ⊙ Tᵀ dΔ``
    and ``dβ``. Returns ``(dR_v, βΓ, dA_k, dG)``: ``Tᵀ dΔ``, the row scale of
    ``W``'s right-hand side, the gradient of ``(K Kᵀ ⊙ E)`` and the row sums
    through ``Γ``."""
    rows, cols = square_iota(chunk)
    b = beta[...].astype(F32)
    vc = v[...].astype(F32)
    strict = masked_decay(spans, rows > cols)
    t = unit_lower_inverse(kk * strict * b[:, None], rows, cols, chunk, precision=TF32X3, serial=serial)
    bg = b * gate
    u = dot(t, vc * b[:, None])  # U = T(β⊙V)          [C, BV]
    drv = dot_tn(t, dd)  # dR_v = Tᵀ dΔ           [C, BV]
    dv[...] = (drv * b[:, None]).astype(dv.dtype)

    def through_w(i, acc):
        rw_w, rw_k = acc
        kb = _cols(k, i, block_k)
        drw = _d_rw(drv, states, i, block_k)
        w = dot(t, kb * bg[:, None])  # W = T(β⊙Γ⊙K)
        return rw_w + dot_nt(drw, w), rw_k + jnp.sum(drw * kb, axis=1)

    zeros = (jnp.zeros((chunk, chunk), F32), jnp.zeros((chunk,), F32))
    rw_w, rw_k = jax.lax.fori_loop(0, k.shape[-1] // block_k, through_w, zeros)
    da = -jnp.where(rows > cols, dot_nt(drv, u) + rw_w, 0.0)
    dak = da * strict  # gradient of (K Kᵀ ⊙ E) before the β row scale
    dbeta[...] = (jnp.sum(drv * vc, axis=1) + rw_k * gate + jnp.sum(dak * kk, axis=1)).astype(dbeta.dtype)
    return drv, bg, dak * b[:, None], rw_k * bg


def _qk_grads(*, q, k, states, d_states, delta, do, dpe, gate, keep, solve, d_prefix, block_k: int, dq, dk):
    """Write ``dQ`` and ``dK`` column block by column block; return the row sums
    through ``Γ`` and through the tails, ``(dG [C], dtail [C])``."""
    def grads(i, acc):
        d_prefix, d_tail = acc
        qb, kb = _cols(q, i, block_k), _cols(k, i, block_k)
        dqg = dot_nt(do, _rows(states, i, block_k))  # dQ̃ = dO Sᵀ
        dkg = dot_nt(delta[...], _rows(d_states, i, block_k))  # dK̃ = Δ dS'ᵀ
        dqb = dqg * gate[:, None] + dot(dpe, kb)
        dkb = dkg * keep[:, None] + dot_tn(dpe, qb)
        if solve is not None:
            drv, bg, dak = solve
            dkb = dkb + _d_rw(drv, states, i, block_k) * bg[:, None] + dot(dak, kb)
        dq[:, pl.ds(i * block_k, block_k)] = dqb.astype(dq.dtype)
        dk[:, pl.ds(i * block_k, block_k)] = dkb.astype(dk.dtype)
        return d_prefix + jnp.sum(dqg * qb, axis=1) * gate, d_tail + jnp.sum(dkg * kb, axis=1) * keep

    return jax.lax.fori_loop(0, q.shape[-1] // block_k, grads, (d_prefix, jnp.zeros(gate.shape, F32)))


def _decay_grads(m, d_prefix, d_tail, total, dgamma, chunk: int):
    """``dg_t``: summed over what each ``g_t`` enters, never as differences of
    prefix-sum gradients (those cancel digits under strong decays): ``G_i``
    (``i ≥ t``), ``tail_j`` (``j < t``), the chunk total, and the spans ``D_ij``
    (``i ≥ t > j``, through ``M``)."""
    rows, cols = square_iota(chunk)
    m_before = dot(m, (rows < cols).astype(F32))  # [i, t]: Σ_{j<t} M_ij
    return (jnp.sum(jnp.where(rows >= cols, d_prefix[:, None] + m_before, 0.0), axis=0)
            + jnp.sum(jnp.where(rows < cols, d_tail[:, None], 0.0), axis=0) + jnp.exp(total) * dgamma)


def _gdn_intra_backward_kernel(*, q, k, v, g, beta, states, delta, d_states, d_delta, do, dq, dk, dv, dg, dbeta,
                               chunk, block_k, serial):
    """One chunk and value block: the partial ``dq, dk, dg, dβ`` and ``dv`` (module docstring)."""
    do_c = do[...]
    dd = d_delta[...]
    rows, cols = square_iota(chunk)
    spans, prefix, tail, total = tile_spans(g[...].astype(F32), chunk)
    gate = jnp.exp(prefix)  # Γ_i ≤ 1
    keep = jnp.exp(tail)  # exp(Σ_{t>j} g_t) ≤ 1
    qk, kk, dgamma = _score_sums(q, k, states, d_states, chunk=chunk, block_k=block_k, with_kk=beta is not None)
    dp = jnp.where(rows >= cols, dot_nt(do_c, delta[...]), 0.0)  # dO Δᵀ
    dpe = dp * masked_decay(spans, rows >= cols)
    m = dpe * qk  # dP ⊙ P
    solve = None
    if beta is not None:
        drv, bg, dak, d_prefix = _through_solve(k=k, v=v, beta=beta, states=states, dd=dd, kk=kk, spans=spans,
                                              gate=gate, chunk=chunk, block_k=block_k, serial=serial, dv=dv,
                                              dbeta=dbeta)
        m = m + dak * kk  # dA ⊙ A
        solve = (drv, bg, dak + dak.T)  # dA_k K + dA_kᵀ K in one matmul
    else:
        dv[...] = dd.astype(dv.dtype)
        d_prefix = jnp.zeros((chunk,), F32)
    d_prefix, d_tail = _qk_grads(q=q, k=k, states=states, d_states=d_states, delta=delta, do=do_c, dpe=dpe,
                                 gate=gate, keep=keep, solve=solve, d_prefix=d_prefix, block_k=block_k, dq=dq, dk=dk)
    dg[...] = _decay_grads(m, d_prefix, d_tail, total, dgamma, chunk).astype(dg.dtype)


def gdn_intra_backward(q, k, v, g, beta, states, delta, d_states, d_delta, do, *, chunk: int,
                       config: LinearAttentionConfig):
    """Per-chunk gradients of the chunked recurrence's inputs.

    Args (float32 unless noted, heads-major and flattened, ``Tp`` a multiple of
    ``chunk``, ``K``/``V`` powers of two ≥ 16):
      q, k: ``[BH, Tp, K]`` (q already scaled; any float dtype).
      v: ``[BH, Tp, V]`` (any float dtype).
      g: per-step log decays ``[BH, Tp]``; beta: ``[BH, Tp]`` or ``None`` (SSD).
      states: chunk-initial states ``S_c [BH, NT, K, V]``; delta: ``Δ [BH, Tp, V]``.
      d_states: gradients of each chunk's final state ``[BH, NT, K, V]``;
      d_delta: ``dΔ [BH, Tp, V]``; do: ``dO [BH, Tp, V]`` (from `triton_scan.gdn_state_backward`).
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
    qk = pl.BlockSpec((None, chunk, kdim), lambda c, h, j: (h, c, 0))
    vb = pl.BlockSpec((None, chunk, bv), lambda c, h, j: (h, c, j))
    vec = pl.BlockSpec((None, chunk), lambda c, h, j: (h, c))
    state = pl.BlockSpec((None, None, kdim, bv), lambda c, h, j: (h, c, 0, j))
    part_k = output((nv, bh, tp, kdim), F32, pl.BlockSpec((None, None, chunk, kdim), lambda c, h, j: (j, h, c, 0)))
    part_vec = output((nv, bh, tp), F32, pl.BlockSpec((None, None, chunk), lambda c, h, j: (j, h, c)))
    outs = triton_kernel_call(
        functools.partial(_gdn_intra_backward_kernel, chunk=chunk, block_k=min(BLOCK_K, kdim),
                          serial=not current_platform().nvidia_below((9, 0))), grid=(nt, bh, nv),
        inputs=dict(q=operand(q, qk), k=operand(k, qk), v=operand(v, vb), g=operand(g, vec),
                    beta=operand(beta, vec), states=operand(states, state), delta=operand(delta, vb),
                    d_states=operand(d_states, state), d_delta=operand(d_delta, vb), do=operand(do, vb)),
        outputs=dict(dq=part_k, dk=part_k, dv=output((bh, tp, vdim), F32, vb), dg=part_vec,
                     dbeta=part_vec if beta is not None else None),
        num_warps=config.num_warps, num_stages=1, name="stellax_linear_attention_intra_bwd",
    )
    dbeta = None if outs.dbeta is None else outs.dbeta.sum(0)
    return outs.dq.sum(0), outs.dk.sum(0), outs.dv, outs.dg.sum(0), dbeta
