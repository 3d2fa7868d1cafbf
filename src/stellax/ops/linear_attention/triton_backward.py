"""Pallas Triton kernels for the intra-chunk part of the GDN / SSD backward
(scalar decays): stages 6 → 1 backwards, after the reverse state scan.

The reverse state scan (`triton_scan.gdn_state_backward`) yields, per chunk ``c``, the
gradient ``dS`` of the chunk's final state and the full gradient ``dΔ`` of
the residuals. With those, every chunk's gradients of ``q, k, v, g, β`` are
independent. Notation as in `wy.py`; one chunk of ``C`` rows,
``G_i = Σ_{t≤i} g_t``, ``tail_j = Σ_{t>j} g_t``, ``γ = exp(Σ_t g_t)``,
``E_ij = exp(Σ_{j<t≤i} g_t)`` (0 above the diagonal), ``S`` the
chunk-initial state. The forward of a chunk is

    O  = (Γ⊙Q) S + P Δ,          P = (Q Kᵀ) ⊙ E  (j ≤ i)
    Δ  = U − W S,                U = T(β⊙V), W = T(β⊙Γ⊙K), T = (I + A)⁻¹,
    S' = γ S + K̃ᵀ Δ,             K̃ = K ⊙ exp(tail),  A = β ⊙ (K Kᵀ) ⊙ E  (j < i)

(SSD: no ``β``, ``Δ = U = V``, ``W = 0``). Its backward:

    dQ̃ = dO Sᵀ,  dK̃ = Δ dS'ᵀ,  dγ = Σ S ⊙ dS',  dP = lower(dO Δᵀ)
    dQ = dQ̃ ⊙ Γ + (dP ⊙ E) K,   dK = dK̃ ⊙ exp(tail) + (dP ⊙ E)ᵀ Q
    delta rule:  dR_v = Tᵀ dΔ,  dR_w = Tᵀ dW = −dR_v Sᵀ,
                 dA = −strict_lower(dR_v Uᵀ + dR_w Wᵀ) = −strict_lower(dR_v Δᵀ)   (U − W S = Δ)
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
error large against the small ``dg`` of strong decays).

Five kernels (three for SSD) with their intermediates in HBM — one fused
kernel spilled registers, a TF32X3 dot holding both halves of its operands
and ``[C, C]`` operands filling the register file:

* `chunk_inverse` (delta rule), grid ``(NT, BH)``: ``T`` ``[BH, Tp, C]``;
* `_value_grads_kernel` (delta rule), grid ``(NT, BH)``: ``dR_v`` ``[BH, Tp, V]``, ``dV``
  and ``dβ``'s ``V`` term;
* `_state_grads_kernel`, grid ``(nk, NT, BH)``, one key block of `KEY_BLOCK` columns
  per program: the terms through ``S`` and ``dS'`` — ``dQ̃ ⊙ Γ``, ``dK̃ ⊙ exp(tail)``,
  ``β Γ ⊙ dR_w`` — and their ``dg``, ``dβ`` (per-key-block partials);
* `_pair_grads_kernel`, grid ``(NT, BH)``: ``dP ⊙ E`` and ``dA ⊙ E`` ``[BH, Tp, C]``,
  the ``M`` terms of ``dg`` and ``dβ``'s ``dA`` term;
* `_key_grads_kernel`, grid ``(nk, NT, BH)``: ``dQ += (dP ⊙ E) K``,
  ``dK += (dP ⊙ E)ᵀ Q + dA_k K + dA_kᵀ K``.

The ``[C, C]`` matrices are handled in column blocks ``[C, s]`` (`_Columns`,
`column_block`: 32 columns on sm_90, 16 below, where mma.sync holds each
warp's share of both operands in registers; all ``C`` rows keep the warps on
distinct rows) one block per loop step, so only one block's tiles are live.
Every term is linear in the cotangents: the per-key-block partials are
summed in XLA (no two programs write one element, no atomics,
deterministic); ``dq``, ``dk`` pass from `_state_grads_kernel` to
`_key_grads_kernel`. All float32, the matmuls as `TF32X3` (at ``default`` precision one
TF32 pass); every exponent is ≤ 0.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core import current_platform, pallas
from ...core.pallas import F32, HIGHEST, operand, output, square_iota, triton_kernel_call, triton_precision
from .configs import LinearAttentionConfig
from .decay import block_pair_spans, masked_decay, tile_spans
from .solve import merge_inverse, substitution_inverse

#: Key columns per program of the key-block kernels (64 spilled the state kernel at
#: K = 128 on sm_90: 204 B).
KEY_BLOCK = 32
#: Most value columns per step of the kernels' loops over V.
MAX_BLOCK_V = 64
#: Key columns per step of `chunk_inverse`'s score loop.
INVERSE_BLOCK_K = 64
#: Rows per block of `chunk_inverse` below sm_90 (the whole chunk on sm_90), as the
#: forward's blocked WY kernel: mma.sync holds its operands in registers.
INVERSE_BLOCK = 32

#: Every matmul of this module runs at the call's precision as Triton takes it
#: (`core.pallas.triton_precision`): `TF32X3` (three TF32 tensor-core passes, about
#: float32 accuracy; an IEEE float32 dot is scalar FMA on a GPU) for ``high`` /
#: ``highest``, one TF32 pass for ``default``.
dot, dot_nt, dot_tn = pallas.dot, pallas.dot_nt, pallas.dot_tn


def _total(terms):
    """The sum of a non-empty sequence of arrays (no ``0 +`` start)."""
    return functools.reduce(operator.add, terms)


def column_block(chunk: int) -> int:
    """Columns per block of the ``[C, C]`` matrices: 32 on sm_90 (wgmma tiles of
    ``[64, 32]``; whole ``[64, 64]`` blocks spilled the pair kernel: 12 B at K = 32,
    84 B at K = 128), 16 below (mma.sync; at K = 32 the pair and key kernels took
    247 and 168 registers, with 32 columns all 255)."""
    return min(chunk, 16 if current_platform().nvidia_below((9, 0)) else 32)


class _Columns:
    """One chunk's ``[C, C]`` matrices in ``nb`` column blocks of ``s`` columns,
    inside a kernel (``g`` the ref of the chunk's log decays ``[C]``; a block
    index may be traced): a block's slice and decays, and its share of ``dg``."""

    def __init__(self, g, chunk: int, s: int):
        self.g, self.chunk, self.s, self.nb = g, chunk, s, chunk // s

    def cols(self, c):
        """Block ``c``'s slice of ``[0, C)``."""
        return pl.ds(c * self.s, self.s)

    def _grid(self, c):
        """``(i, j)``: the global row and column indices of the ``[C, s]`` block ``c``."""
        i = jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.s), 0)
        return i, jax.lax.broadcasted_iota(jnp.int32, (self.chunk, self.s), 1) + c * self.s

    def decay(self, c, *, strict: bool):
        """``E[:, c]`` ``[C, s]``: ``exp(D_ij)`` for ``j ≤ i`` (``j < i`` if ``strict``),
        0 elsewhere; ``D`` a cumulative sum down the rows of ``g_t [t > j]`` (as
        `decay.tile_spans`)."""
        t, j = self._grid(c)
        spans = jnp.cumsum(jnp.where(t > j, self.g[...][:, None], 0.0), axis=0)
        return masked_decay(spans, t > j if strict else t >= j)

    def span_grads(self, tau, m, before):
        """``Σ_{i≥t>j} M_ij`` for the ``t`` of block ``τ``, from ``M``'s column block
        ``m = M[:, τ]`` ``[C, s]`` and the row sums of the blocks before it,
        ``before_i = Σ_{j<τ·s} M_ij``: ``Σ_{i≥t} before_i`` plus, inside the block,
        ``Σ_{i>u} Σ_{j≤u} M_ij`` at ``u = t − 1`` (a cumulative sum along the
        columns; a matmul with a 0/1 matrix took ``[C, C]`` TF32X3 operands)."""
        i, u = self._grid(tau)
        upto = jnp.sum(jnp.where(i > u, jnp.cumsum(m, axis=1), 0.0), axis=0)  # [u]
        r, c = square_iota(self.s)
        inside = jnp.sum(jnp.where(c == r - 1, upto[None, :], 0.0), axis=1)  # [t]: upto[t − 1]
        return inside + jnp.sum(jnp.where(i >= u, before[:, None], 0.0), axis=0)


# -- T = (I + A)⁻¹ -----------------------------------------------------------------------
def _inverse_kernel(*, k, g, beta, t, chunk, block, block_k, precision):
    """One chunk: ``T = (I + A)⁻¹``, ``A = strict_lower(β exp(D) K Kᵀ)``, in blocks of
    ``block`` rows (one block: the whole chunk by `solve.merge_inverse`), the scores'
    ``K`` in steps of ``block_k`` columns. Forward substitution down the block
    rows ``a`` (as `solve.lazy_block_inverse`, the diagonal blocks row by row by
    `solve.substitution_inverse`),

        T_aa = (I + A_aa)⁻¹,   T_ac = −T_aa Σ_{c≤b<a} A_ab T_bc   (c < a),

    each block row written as soon as it is known (sm_80, bfloat16 K = 32: all
    rows written at the end spilled 4 B; the row's off-diagonal scores formed
    after its diagonal inverse, 12 B)."""
    nb = chunk // block
    rows = [pl.ds(a * block, block) for a in range(nb)]
    spans = [tile_spans(g[r], block) for r in rows]  # (D, G, tail, total) within each block
    inner_rows, inner_cols = square_iota(block)

    def scores(a, c):  # A_ac
        def step(i, acc):
            cs = pl.ds(i * block_k, block_k)
            return acc + dot_nt(k[rows[a], cs].astype(F32), k[rows[c], cs].astype(F32), precision=precision)

        kk = jax.lax.fori_loop(0, k.shape[-1] // block_k, step, jnp.zeros((block, block), F32))
        mask = inner_rows > inner_cols if a == c else inner_rows >= 0
        return kk * masked_decay(block_pair_spans(spans, a, c), mask) * beta[rows[a]][:, None]

    inv = {}
    for a in range(nb):
        row = [scores(a, b) for b in range(a + 1)]
        inv[a, a] = (merge_inverse(row[a], inner_rows, inner_cols, block, precision=precision) if nb == 1
                     else substitution_inverse(row[a], inner_rows, inner_cols))
        for c in range(a):
            inv[a, c] = -dot(inv[a, a], _total([dot(row[b], inv[b, c], precision=precision) for b in range(c, a)]),
                             precision=precision)
        for c in range(nb):
            t[rows[a], rows[c]] = inv[a, c] if c <= a else jnp.zeros((block, block), F32)


def chunk_inverse(k, g, beta, *, chunk: int, config: LinearAttentionConfig, precision=HIGHEST):
    """``T = (I + A)⁻¹`` per chunk, float32 ``[BH, Tp, C]`` (row ``i`` of chunk ``c``
    holds ``T_ij`` of that chunk's columns ``j``), from ``k [BH, Tp, K]`` and float32
    ``g, beta [BH, Tp]``. On sm_90 the whole chunk by merging diagonal blocks (as the
    forward's WY kernel); below, blocks of `INVERSE_BLOCK` rows, the diagonal ones by
    row-by-row substitution (as the forward's blocked WY kernel). Both stay float32-accurate
    with correlated keys, where the nilpotent product they replaced did not (cosine 0.8:
    max error 2e+6 of ``max |T|`` on sm_90, 0.12 in its 32-row blocks below)."""
    bh, tp, kdim = k.shape
    below = current_platform().nvidia_below((9, 0))
    block = min(chunk, INVERSE_BLOCK) if below else chunk
    rows = lambda d: pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))
    vec = pl.BlockSpec((None, chunk), lambda c, h: (h, c))
    return triton_kernel_call(
        functools.partial(_inverse_kernel, chunk=chunk, block=block, block_k=min(INVERSE_BLOCK_K, block, kdim),
                          precision=triton_precision(precision)),
        grid=(tp // chunk, bh),
        inputs=dict(k=operand(k, rows(kdim)), g=operand(g, vec), beta=operand(beta, vec)),
        outputs=dict(t=output((bh, tp, chunk), F32, rows(chunk))),
        num_warps=config.num_warps, num_stages=1, name="stellax_linear_attention_intra_bwd_inverse",
    ).t


# -- through the solve: the values ----------------------------------------------------------
def _value_grads_kernel(*, v, beta, t, d_delta, d_rv, dv, dbeta, chunk, block, block_v, precision):
    """One chunk, value block by value block: ``dR_v = Tᵀ dΔ`` (``Σ_b T_bᵀ dΔ_b`` over
    ``T``'s blocks of ``block`` rows), ``dV = β ⊙ dR_v`` and ``dβ_i = Σ_v dR_v ⊙ V``."""
    rows = [pl.ds(a * block, block) for a in range(chunk // block)]
    b = beta[...]

    def step(j, db):
        vs = pl.ds(j * block_v, block_v)
        drv = _total([dot_tn(t[r, :], d_delta[r, vs], precision=precision) for r in rows])
        d_rv[:, vs] = drv
        dv[:, vs] = drv * b[:, None]
        return db + jnp.sum(drv * v[:, vs].astype(F32), axis=1)

    dbeta[...] = jax.lax.fori_loop(0, v.shape[-1] // block_v, step, jnp.zeros((chunk,), F32))


# -- one key block: the terms through the states --------------------------------------------
def _state_grads_kernel(*, q, k, g, beta, states, delta, d_states, do, d_rv, dq, dk, dg, dbeta, chunk, block_v,
                        precision):
    """One chunk and key block (``[C, BK]`` columns of ``q, k``; ``[BK, V]`` rows of
    the states), over the value blocks: ``dQ = dQ̃ ⊙ Γ``, ``dK = dK̃ ⊙ exp(tail)``
    (``dQ̃ = dO Sᵀ``, ``dK̃ = Δ dS'ᵀ``) and the key block's ``dg`` through them
    (``dG``, ``dtail``, ``γ dγ``); with the delta rule ``dR_w = −dR_v Sᵀ``'s terms:
    ``β Γ ⊙ dR_w`` in ``dK``, ``Γ Σ_k dR_w ⊙ K`` in ``dβ`` and ``dG``."""
    qb, kb = q[...].astype(F32), k[...].astype(F32)

    def step(j, acc):
        dqg, dkg, drw, dgamma = acc
        vs = pl.ds(j * block_v, block_v)
        s_j, ds_j = states[:, vs], d_states[:, vs]
        dqg = dqg + dot_nt(do[:, vs], s_j, precision=precision)  # dQ̃ = dO Sᵀ
        dkg = dkg + dot_nt(delta[:, vs], ds_j, precision=precision)  # dK̃ = Δ dS'ᵀ
        if d_rv is not None:
            drw = drw - dot_nt(d_rv[:, vs], s_j, precision=precision)  # dR_w = −dR_v Sᵀ
        return dqg, dkg, drw, dgamma + jnp.sum(s_j * ds_j)

    zero = jnp.zeros(qb.shape, F32)
    dqg, dkg, drw, dgamma = jax.lax.fori_loop(0, do.shape[-1] // block_v, step, (zero, zero, zero, jnp.zeros((), F32)))
    _, prefix, tail, total = tile_spans(g[...], chunk)
    gate, keep = jnp.exp(prefix), jnp.exp(tail)  # Γ_i, exp(Σ_{t>i} g_t): both ≤ 1
    dq[...] = dqg * gate[:, None]
    d_prefix = jnp.sum(dqg * qb, axis=1) * gate
    d_tail = jnp.sum(dkg * kb, axis=1) * keep
    dk_b = dkg * keep[:, None]
    if d_rv is not None:
        bg = beta[...] * gate
        rw_k = jnp.sum(drw * kb, axis=1)
        d_prefix = d_prefix + rw_k * bg
        dbeta[...] = rw_k * gate
        dk_b = dk_b + drw * bg[:, None]
    dk[...] = dk_b
    rows, cols = square_iota(chunk)  # Σ_{i≥t} dG_i + Σ_{j<t} dtail_j + γ dγ
    dg[...] = (jnp.sum(jnp.where(rows >= cols, d_prefix[:, None], 0.0), axis=0)
               + jnp.sum(jnp.where(rows < cols, d_tail[:, None], 0.0), axis=0) + jnp.exp(total) * dgamma)


# -- the [C, C] gradients ------------------------------------------------------------------
def _pair_grads_kernel(*, q, k, g, beta, delta, do, d_rv, dpe, dae, dg, dbeta, chunk, block, block_k, block_v,
                       precision):
    """One chunk, column block by column block ``c``: ``dP[:, c] = dO Δ_cᵀ`` and, given
    ``d_rv``, ``dA[:, c] = −dR_v Δ_cᵀ`` (over the value blocks), the scores ``Q K_cᵀ``
    and ``K K_cᵀ`` (over the key blocks); writes ``dP ⊙ E`` (``j ≤ i``), ``dA ⊙ E``
    (``j < i``), ``dβ = Σ_j dA ⊙ E ⊙ K Kᵀ`` and the ``dg`` through ``M = dP ⊙ P + dA ⊙ A``."""
    cols = _Columns(g, chunk, block)
    zero = jnp.zeros((chunk, block), F32)
    solve = d_rv is not None

    def column(c, acc):
        db, before = acc
        r = cols.cols(c)

        def over_values(j, acc):
            vs = pl.ds(j * block_v, block_v)
            delta_c = delta[r, vs]
            return (acc[0] + dot_nt(do[:, vs], delta_c, precision=precision),
                    acc[1] - dot_nt(d_rv[:, vs], delta_c, precision=precision) if solve else None)

        def over_keys(i, acc):
            ks = pl.ds(i * block_k, block_k)
            k_c = k[r, ks].astype(F32)
            return (acc[0] + dot_nt(q[:, ks].astype(F32), k_c, precision=precision),
                    acc[1] + dot_nt(k[:, ks].astype(F32), k_c, precision=precision) if solve else None)

        dp, da = jax.lax.fori_loop(0, do.shape[-1] // block_v, over_values, (zero, zero if solve else None))
        dp_e = dp * cols.decay(c, strict=False)
        dpe[:, r] = dp_e
        qk, kk = jax.lax.fori_loop(0, k.shape[-1] // block_k, over_keys, (zero, zero if solve else None))
        m = dp_e * qk  # dP ⊙ P
        if solve:
            da_e = da * cols.decay(c, strict=True)
            dae[:, r] = da_e
            da_a = da_e * kk  # dA ⊙ A / β
            db = db + jnp.sum(da_a, axis=1)
            m = m + da_a * beta[...][:, None]
        dg[r] = cols.span_grads(c, m, before)
        return db, before + jnp.sum(m, axis=1)

    vec = jnp.zeros((chunk,), F32)
    db, _ = jax.lax.fori_loop(0, cols.nb, column, (vec, vec))
    if solve:
        dbeta[...] = db


def _key_grads_kernel(*, q, k, beta, dpe, dae, dq_in, dk_in, dq, dk, chunk, block, precision):
    """One chunk and key block, block by block ``c`` of ``block`` columns (and rows)
    of ``dP ⊙ E`` and, given ``dae``, ``dA_k = β ⊙ (dA ⊙ E)``:
    ``dQ = dQ_in + Σ_c (dP ⊙ E)[:, c] K_c`` and
    ``dK = dK_in + Σ_c (dP ⊙ E)[c, :]ᵀ Q_c + dA_k[:, c] K_c + dA_k[c, :]ᵀ K_c``."""
    b = None if dae is None else beta[...]

    def block_step(c, acc):
        dq_acc, dk_acc = acc
        r = pl.ds(c * block, block)
        kc = k[r, :].astype(F32)
        dq_acc = dq_acc + dot(dpe[:, r], kc, precision=precision)
        dk_acc = dk_acc + dot_tn(dpe[r, :], q[r, :].astype(F32), precision=precision)
        if dae is not None:
            dk_acc = (dk_acc + dot(dae[:, r] * b[:, None], kc, precision=precision)
                      + dot_tn(dae[r, :] * beta[r][:, None], kc, precision=precision))
        return dq_acc, dk_acc

    dq[...], dk[...] = jax.lax.fori_loop(0, chunk // block, block_step, (dq_in[...], dk_in[...]))


def _check_intra_backward(k, v, states, d_states, chunk: int) -> None:
    """`gdn_intra_backward`'s layout: ``Tp`` whole chunks, head sizes powers of two ≥ 16,
    ``states`` and ``d_states`` ``[BH, NT, K, V]``."""
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


def gdn_intra_backward(q, k, v, g, beta, states, delta, d_states, d_delta, do, *, chunk: int,
                       config: LinearAttentionConfig, precision=HIGHEST):
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
    dbeta [BH, Tp] or None)``. The kernels loop over value blocks of
    ``min(config.block_v, MAX_BLOCK_V, V)`` columns and run ``config.num_warps``
    warps, one stage; the key-block kernels take ``min(KEY_BLOCK, K)`` key columns each.
    ``precision`` (resolved) of every matmul, as Triton runs it (`core.pallas.triton_precision`).
    """
    _check_intra_backward(k, v, states, d_states, chunk)
    bh, tp, kdim = k.shape
    vdim = v.shape[-1]
    nt = tp // chunk
    bk, bv, block = min(KEY_BLOCK, kdim), min(config.block_v, MAX_BLOCK_V, vdim), column_block(chunk)
    nk = kdim // bk
    launch = functools.partial(triton_kernel_call, num_warps=config.num_warps, num_stages=1)
    tf32 = triton_precision(precision)
    delta_rule = beta is not None

    # grid (NT, BH): whole chunks
    rows = lambda d: pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))
    vec = pl.BlockSpec((None, chunk), lambda c, h: (h, c))
    d_rv = dv = db_v = None
    if delta_rule:
        t = chunk_inverse(k, g, beta, chunk=chunk, config=config, precision=precision)
        values = launch(
            functools.partial(_value_grads_kernel, chunk=chunk, block=block, block_v=bv, precision=tf32),
            grid=(nt, bh),
            inputs=dict(v=operand(v, rows(vdim)), beta=operand(beta, vec), t=operand(t, rows(chunk)),
                        d_delta=operand(d_delta, rows(vdim))),
            outputs=dict(d_rv=output((bh, tp, vdim), F32, rows(vdim)), dv=output((bh, tp, vdim), F32, rows(vdim)),
                         dbeta=output((bh, tp), F32, vec)),
            name="stellax_linear_attention_intra_bwd_values")
        d_rv, dv, db_v = values.d_rv, values.dv, values.dbeta
    square = output((bh, tp, chunk), F32, rows(chunk))
    pairs = launch(
        functools.partial(_pair_grads_kernel, chunk=chunk, block=block, block_k=bk, block_v=bv, precision=tf32),
        grid=(nt, bh),
        inputs=dict(q=operand(q, rows(kdim)), k=operand(k, rows(kdim)), g=operand(g, vec), beta=operand(beta, vec),
                    delta=operand(delta, rows(vdim)), do=operand(do, rows(vdim)), d_rv=operand(d_rv, rows(vdim))),
        outputs=dict(dpe=square, dae=square if delta_rule else None, dg=output((bh, tp), F32, vec),
                     dbeta=output((bh, tp), F32, vec) if delta_rule else None),
        name="stellax_linear_attention_intra_bwd_pairs")

    # grid (nk, NT, BH): one key block per program, the key blocks of a chunk side by side
    key_rows = pl.BlockSpec((None, chunk, bk), lambda b, c, h: (h, c, b))
    all_rows = lambda d: pl.BlockSpec((None, chunk, d), lambda b, c, h: (h, c, 0))
    key_vec = pl.BlockSpec((None, chunk), lambda b, c, h: (h, c))
    state = pl.BlockSpec((None, None, bk, vdim), lambda b, c, h: (h, c, b, 0))
    per_key_block = output((nk, bh, tp), F32, pl.BlockSpec((None, None, chunk), lambda b, c, h: (b, h, c)))
    grad = output((bh, tp, kdim), F32, key_rows)
    keys = dict(q=operand(q, key_rows), k=operand(k, key_rows), beta=operand(beta, key_vec))
    st = launch(
        functools.partial(_state_grads_kernel, chunk=chunk, block_v=bv, precision=tf32), grid=(nk, nt, bh),
        inputs=dict(keys, g=operand(g, key_vec), states=operand(states, state), delta=operand(delta, all_rows(vdim)),
                    d_states=operand(d_states, state), do=operand(do, all_rows(vdim)),
                    d_rv=operand(d_rv, all_rows(vdim))),
        outputs=dict(dq=grad, dk=grad, dg=per_key_block, dbeta=per_key_block if delta_rule else None),
        name="stellax_linear_attention_intra_bwd_states")
    out = launch(
        functools.partial(_key_grads_kernel, chunk=chunk, block=block, precision=tf32), grid=(nk, nt, bh),
        inputs=dict(keys, dpe=operand(pairs.dpe, all_rows(chunk)), dae=operand(pairs.dae, all_rows(chunk)),
                    dq_in=operand(st.dq, key_rows), dk_in=operand(st.dk, key_rows)),
        outputs=dict(dq=grad, dk=grad), name="stellax_linear_attention_intra_bwd_keys")
    dg = st.dg.sum(0) + pairs.dg
    if not delta_rule:
        return out.dq, out.dk, d_delta, dg, None
    return out.dq, out.dk, dv, dg, db_v + st.dbeta.sum(0) + pairs.dbeta
