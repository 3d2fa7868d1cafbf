"""Pallas Triton kernels for Kimi Delta Attention (per-channel decays), chunk 64.

Arrays are heads-major, flattened to ``[BH, Tp, D]`` (``BH = Bs·HV``, ``Tp`` a
multiple of the chunk ``C = 64``, ``D`` padded with zeros to a power of two
≥ 16); ``g [BH, Tp, K]`` holds the per-step, per-channel log decays (padded
channels and tokens have ``g = 0``: an identity step). Notation as in
`chunk.py`: ``G_ic = Σ_{t≤i} g_tc`` inside a chunk, ``Γ = exp(G)``.

Stable per-channel scores. ``P_ij = Σ_c x_ic k_jc exp(Σ_{j<t≤i} g_tc)`` cannot
be a plain matmul of ``x⊙Γ`` with ``k/Γ`` (``1/Γ`` overflows for strong
decays), so every exponent here is a sum of ``g`` over a span, ≤ 0, summed
directly (a matmul of a 0/1 span mask with ``g``: a sum of same-sign terms,
never a difference of prefix sums). The chunk is cut into sub-blocks of
``s = 16`` rows (`_decayed_scores`):

* rows ``i`` of block ``a`` against earlier blocks (``j < a·s``): the decay
  splits at the block start, ``exp(Σ_{a·s≤t≤i} g)·exp(Σ_{j<t<a·s} g)``, both
  factors ≤ 1 — one matmul per block ``a``;
* within a diagonal block, for each offset ``d`` the column ``j = a·s + d``
  of every block at once: ``Σ_c x_ic k_jc exp(Σ_{j<t≤i} g_tc)`` elementwise
  (16 steps of a ``[C, K]`` exp and row sum).

Forward (three launches):

1. `intra_forward` — grid ``(NT, BH)``: per chunk the scores of q and k,
   ``A = strict_lower(β_i (k_i·k_j)_decayed)``, ``T = (I + A)⁻¹`` by the
   nilpotent product ``(I − A)(I + A²)…(I + A³²)``, ``U = T(β⊙V)``,
   ``W = T(β⊙Γ⊙K)``, and the per-chunk factors the other kernels need:
   ``P`` (the causal decayed ``q·k`` scores), ``Q⊙Γ``, ``K̃ = K⊙exp(Σ_{t>j} g_t)``
   and ``Γ_C = exp(Σ_t g_t)`` per channel; in blocks of 64 channels (the
   scores are sums over channels) and of 64 value columns.
2. `state_forward` — grid ``(BH, V/BV)``, a loop over chunks holding
   ``S [K, BV]``: stores the chunk-initial ``S_c``, ``Δ = U − W S`` and
   ``S ← diag(Γ_C) S + K̃ᵀ Δ``; packed batches reset ``S`` to the sequence's
   initial state at its first chunk and store its final state at its last.
3. `output_forward` — grid ``(NT, BH, V/BV)``: ``O = (Q⊙Γ) S_c + P Δ``.

Backward: `state_backward` — grid ``(BH, V/BV)``, the reverse loop carrying
``dS`` (the gradient of the chunk's final state):
``dΔ = Pᵀ dO + K̃ dS``, ``dS ← diag(Γ_C) dS + (Q⊙Γ)ᵀ dO − Wᵀ dΔ``; it stores
``dS`` per chunk, ``dΔ`` and the initial states' gradients. The per-chunk
gradients of q, k, v, g and β follow in parallel (`triton_kda_backward.py`,
wired in `kda_core.py`).

All matmuls run at ``Precision.HIGHEST`` (IEEE float32).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import triton_call
from .configs import LinearAttentionConfig
from .triton import ScanLayout, _dot, _dot_nt, _dot_tn, _iota, scan_chunks, unit_lower_inverse

F32 = jnp.float32
#: Rows per sub-block of the per-channel decayed scores.
KDA_SUB_BLOCK = 16
#: Channels (and value columns) the intra-chunk kernel handles at a time: its
#: ``[C, K]`` tiles at K = 256 took 320 KiB of shared memory (sm_90 has 227).
KDA_BLOCK_K = 64


def check_layout(chunk: int, **arrays) -> None:
    """Validate the kernels' flattened layout; ``arrays`` maps names to ``(array,
    expected shape)`` where ``None`` entries are free. Raises ``ValueError``
    naming the argument: a shape mismatch, a padded length ``Tp`` that is not a
    multiple of ``chunk`` or a head size that is not a power of two ≥ 16."""
    for name, (x, shape) in arrays.items():
        if x.ndim != len(shape) or any(e is not None and e != d for e, d in zip(shape, x.shape)):
            want = tuple("*" if e is None else e for e in shape)
            raise ValueError(f"{name}: expected shape {want}, got {tuple(x.shape)}")
    for name, (x, shape) in arrays.items():
        if name in ("q", "k", "kg", "qg", "w") and x.ndim == 3:
            if x.shape[1] % chunk:
                raise ValueError(f"{name}: expected a padded length that is a multiple of {chunk}, got {x.shape[1]}")
            d = x.shape[-1]
            if d < 16 or d & (d - 1):
                raise ValueError(f"{name}: expected a head size that is a power of two >= 16, got {d}")
        if name in ("v", "u", "do", "delta") and x.ndim == 3:
            d = x.shape[-1]
            if d < 16 or d & (d - 1):
                raise ValueError(f"{name}: expected a value size that is a power of two >= 16, got {d}")


def _span_sum(mask, g):
    """``Σ_t mask[i, t] g_t`` for 0/1 ``mask [C, C]`` and ``g [C, K]``: a direct
    sum over each row's span (exact products, same-sign terms)."""
    return _dot(mask.astype(F32), g)


def _decayed_scores(q, k, g, chunk):
    """``(P_q, P_k)``, each ``[C, C]``: ``P_x[i, j] = Σ_c x_ic k_jc exp(Σ_{j<t≤i} g_tc)``
    for ``j ≤ i`` and 0 above, for ``x = q`` and ``x = k`` (``q, k, g [C, K]``).

    Sub-blocks of ``s`` rows: earlier blocks by the split at the block start
    (one matmul per block), the diagonal blocks elementwise (see the module
    docstring). Every exponent is a direct span sum ≤ 0 (−inf outside its span).
    """
    s = KDA_SUB_BLOCK if chunk % KDA_SUB_BLOCK == 0 else chunk
    rows, cols = _iota(chunk)
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    start = (row // s) * s  # [C, 1]: the first row of row i's block
    # Σ_{start(i) ≤ t ≤ i} g_t: the row factor of the off-diagonal blocks.
    inner = jnp.exp(_span_sum((cols >= start) & (cols <= rows), g))
    qi, ki = q * inner, k * inner
    pq = jnp.zeros((chunk, chunk), F32)
    pk = jnp.zeros((chunk, chunk), F32)
    for a in range(1, chunk // s):
        # Column factor exp(Σ_{j<t<a·s} g_t) for the columns j < a·s of earlier blocks.
        before = jnp.exp(jnp.where(row < a * s, _span_sum((cols > rows) & (cols < a * s), g), -jnp.inf))
        y = k * before
        in_block = start == a * s
        pq = pq + jnp.where(in_block, _dot_nt(qi, y), 0.0)
        pk = pk + jnp.where(in_block, _dot_nt(ki, y), 0.0)

    def diagonal(d, carry):
        pq, pk = carry
        col = start + d  # [C, 1]: column j = start(i) + d of row i's diagonal block
        pick = cols == col
        kd = _dot(pick.astype(F32), k)  # row i holds k_j (an exact gather)
        valid = col <= row
        e = jnp.exp(jnp.where(valid, _span_sum((cols > col) & (cols <= rows), g), -jnp.inf))
        ke = kd * e
        sq = jnp.sum(q * ke, axis=1, keepdims=True)
        sk = jnp.sum(k * ke, axis=1, keepdims=True)
        hit = pick & valid
        return pq + jnp.where(hit, sq, 0.0), pk + jnp.where(hit, sk, 0.0)

    return jax.lax.fori_loop(0, s, diagonal, (pq, pk))


# -- 1. intra-chunk: scores, WY representation, decay factors -----------------------
def _intra_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, u_ref, w_ref, p_ref, qg_ref, kg_ref, gamma_ref, *solve_refs,
                  chunk):
    kdim, vdim = k_ref.shape[-1], v_ref.shape[-1]
    bk, bv = min(kdim, KDA_BLOCK_K), min(vdim, KDA_BLOCK_K)
    b = beta_ref[...].astype(F32)
    rows, cols = _iota(chunk)

    def load(i):
        cs = pl.ds(i * bk, bk)
        return cs, q_ref[:, cs].astype(F32), k_ref[:, cs].astype(F32), g_ref[:, cs].astype(F32)

    def channels(i, carry):  # the scores are sums over channels: one block of channels at a time
        cs, q, k, g = load(i)
        pq, pk = _decayed_scores(q, k, g, chunk)
        qg_ref[:, cs] = q * jnp.exp(_span_sum(cols <= rows, g))  # Q⊙Γ, Γ_i = exp(Σ_{t≤i} g_t)
        kg_ref[:, cs] = k * jnp.exp(_span_sum(cols > rows, g))  # K̃_j = k_j exp(Σ_{t>j} g_t)
        gamma_ref[cs] = jnp.exp(jnp.sum(g, axis=0))
        return carry[0] + pq, carry[1] + pk

    zeros = jnp.zeros((chunk, chunk), F32)
    pq, pk = jax.lax.fori_loop(0, kdim // bk, channels, (zeros, zeros))
    p_ref[...] = pq
    a = jnp.where(rows > cols, pk, 0.0) * b[:, None]
    inv = unit_lower_inverse(a, rows, cols, chunk)

    def w_block(i, _):
        cs, _, k, g = load(i)
        w_ref[:, cs] = _dot(inv, k * jnp.exp(_span_sum(cols <= rows, g)) * b[:, None])
        return 0

    def u_block(i, _):
        vs = pl.ds(i * bv, bv)
        u_ref[:, vs] = _dot(inv, v_ref[:, vs].astype(F32) * b[:, None])
        return 0

    jax.lax.fori_loop(0, kdim // bk, w_block, 0)
    jax.lax.fori_loop(0, vdim // bv, u_block, 0)
    if solve_refs:  # for the backward: T and the undecayed-by-β k scores
        solve_refs[0][...] = inv
        solve_refs[1][...] = jnp.where(rows > cols, pk, 0.0)


def intra_forward(q, k, v, g, beta, *, chunk: int, config: LinearAttentionConfig, with_solve: bool = False):
    """The per-chunk factors, all float32.

    Args: ``q, k, g [BH, Tp, K]`` (q scaled), ``v [BH, Tp, V]``, ``beta [BH, Tp]``.
    Returns ``(U [BH, Tp, V], W [BH, Tp, K], P [BH, Tp, C], Q⊙Γ [BH, Tp, K],
    K̃ [BH, Tp, K], Γ_C [BH, NT, K])`` (``P`` row ``i`` of chunk ``c`` holds
    ``P_ij`` of that chunk's columns ``j``); ``with_solve`` adds ``T [BH, Tp, C]``
    and the strictly lower k scores ``A/β [BH, Tp, C]`` (for the backward).
    """
    bh, tp, kdim = k.shape
    check_layout(chunk, k=(k, (None, None, None)), q=(q, k.shape), g=(g, k.shape), v=(v, (bh, tp, None)),
                 beta=(beta, (bh, tp)))
    vdim = v.shape[-1]
    nt = tp // chunk
    spec = lambda d: pl.BlockSpec((None, chunk, d), lambda c, h: (h, c, 0))
    vec = pl.BlockSpec((None, chunk), lambda c, h: (h, c))
    shape = lambda *s: jax.ShapeDtypeStruct(s, F32)
    extra = 2 if with_solve else 0
    return triton_call(
        functools.partial(_intra_kernel, chunk=chunk),
        out_shape=[shape(bh, tp, vdim), shape(bh, tp, kdim), shape(bh, tp, chunk), shape(bh, tp, kdim),
                   shape(bh, tp, kdim), shape(bh, nt, kdim)] + [shape(bh, tp, chunk)] * extra,
        grid=(nt, bh), in_specs=[spec(kdim), spec(kdim), spec(vdim), spec(kdim), vec],
        out_specs=[spec(vdim), spec(kdim), spec(chunk), spec(kdim), spec(kdim),
                   pl.BlockSpec((None, None, kdim), lambda c, h: (h, c, 0))] + [spec(chunk)] * extra,
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_kda_intra",
    )(q, k, v, g, beta)


# -- 2. state scan ----------------------------------------------------------------
def _state_kernel(*refs, chunks, chunk, heads, varlen):
    w_ref, u_ref, kg_ref, gamma_ref, h0_ref = refs[:5]
    refs = refs[5:]
    meta_refs = None
    if varlen:
        meta_refs, refs = refs[:3], refs[3:]
    s_ref, d_ref, final_ref = refs

    def step(c, state):
        rows = pl.ds(c * chunk, chunk)
        delta = u_ref[rows, :] - _dot(w_ref[rows, :], state)
        d_ref[rows, :] = delta
        return gamma_ref[c][:, None] * state + _dot_tn(kg_ref[rows, :], delta)

    scan_chunks(step, chunks=chunks, heads=heads, meta_refs=meta_refs, start_ref=h0_ref, store_ref=s_ref,
                end_ref=final_ref)


def state_forward(w, u, kg, gamma, h0, meta, *, chunk: int, heads: int, config: LinearAttentionConfig):
    """The chunk scan ``S ← diag(Γ_C) S + K̃ᵀ(U − W S)``.

    Args: ``w, kg [BH, Tp, K]``, ``u [BH, Tp, V]``, ``gamma [BH, NT, K]`` (from
    `intra_forward`), ``h0 [N·HV, K, V]``, ``meta`` ``None`` or int32
    ``(first, seq, last) [NT]`` (packed batches); ``heads = HV``.
    Returns float32 ``(S_c [BH, NT, K, V], Δ [BH, Tp, V], final [N·HV, K, V])``.
    """
    bh, tp, kdim = kg.shape
    check_layout(chunk, kg=(kg, (None, None, None)), w=(w, kg.shape), u=(u, (bh, tp, None)),
                 gamma=(gamma, (bh, tp // chunk, kdim)), h0=(h0, (None, kdim, u.shape[-1])))
    scan = ScanLayout.of(bh, tp, kdim, u.shape[-1], h0, meta, chunk=chunk, config=config)
    inputs = [w, u, kg, gamma, h0] + list(meta or ())
    in_specs = [scan.rows(kdim), scan.rows_v, scan.rows(kdim), scan.per_chunk(kdim), scan.states] + scan.meta
    return scan.launch(functools.partial(_state_kernel, heads=heads), inputs, in_specs, config=config,
                       name="stellax_kda_state")


# -- 3. output ----------------------------------------------------------------------
def _output_kernel(qg_ref, p_ref, d_ref, s_ref, o_ref):
    o_ref[...] = _dot(qg_ref[...], s_ref[...]) + _dot(p_ref[...], d_ref[...])


def output_forward(qg, p, delta, states, *, chunk: int, config: LinearAttentionConfig):
    """``O = (Q⊙Γ) S_c + P Δ``, float32 ``[BH, Tp, V]``, from ``qg [BH, Tp, K]``,
    ``p [BH, Tp, C]`` (`intra_forward`), ``delta [BH, Tp, V]`` and the
    chunk-initial ``states [BH, NT, K, V]`` (`state_forward`)."""
    bh, tp, kdim = qg.shape
    check_layout(chunk, qg=(qg, (None, None, None)), p=(p, (bh, tp, chunk)), delta=(delta, (bh, tp, None)),
                 states=(states, (bh, tp // chunk, kdim, delta.shape[-1])))
    vdim = delta.shape[-1]
    bv = min(config.block_v, vdim)
    return triton_call(
        _output_kernel,
        out_shape=jax.ShapeDtypeStruct(delta.shape, F32),
        grid=(tp // chunk, bh, vdim // bv),
        in_specs=[pl.BlockSpec((None, chunk, kdim), lambda c, h, j: (h, c, 0)),
                  pl.BlockSpec((None, chunk, chunk), lambda c, h, j: (h, c, 0)),
                  pl.BlockSpec((None, chunk, bv), lambda c, h, j: (h, c, j)),
                  pl.BlockSpec((None, None, kdim, bv), lambda c, h, j: (h, c, 0, j))],
        out_specs=pl.BlockSpec((None, chunk, bv), lambda c, h, j: (h, c, j)),
        num_warps=config.num_warps, num_stages=config.num_stages, name="stellax_kda_output",
    )(qg, p, delta, states)


# -- backward: reverse state scan -----------------------------------------------------
def _state_backward_kernel(*refs, chunks, chunk, heads, varlen):
    p_ref, qg_ref, kg_ref, w_ref, gamma_ref, do_ref, dht_ref = refs[:7]
    refs = refs[7:]
    meta_refs = None
    if varlen:
        meta_refs, refs = refs[:3], refs[3:]
    ds_ref, dd_ref, dh0_ref = refs

    def step(c, ds):
        rows = pl.ds(c * chunk, chunk)
        do = do_ref[rows, :]
        dd = _dot_tn(p_ref[rows, :], do) + _dot(kg_ref[rows, :], ds)
        dd_ref[rows, :] = dd
        return gamma_ref[c][:, None] * ds + _dot_tn(qg_ref[rows, :], do) - _dot_tn(w_ref[rows, :], dd)

    scan_chunks(step, chunks=chunks, heads=heads, meta_refs=meta_refs, start_ref=dht_ref, store_ref=ds_ref,
                end_ref=dh0_ref, reverse=True)


def state_backward(p, qg, kg, w, gamma, do, dht, meta, *, chunk: int, heads: int, config: LinearAttentionConfig):
    """The reverse chunk scan.

    Args: ``p [BH, Tp, C]``, ``qg, kg, w [BH, Tp, K]``, ``gamma [BH, NT, K]``
    (`intra_forward`), ``do [BH, Tp, V]`` float32, ``dht [N·HV, K, V]`` (the
    final states' gradient), ``meta`` as in `state_forward`.
    Returns float32 ``(dS [BH, NT, K, V]`` (the gradient of each chunk's final
    state), ``dΔ [BH, Tp, V]``, ``dh0 [N·HV, K, V])``.
    """
    bh, tp, kdim = kg.shape
    check_layout(chunk, kg=(kg, (None, None, None)), p=(p, (bh, tp, chunk)), qg=(qg, kg.shape), w=(w, kg.shape),
                 gamma=(gamma, (bh, tp // chunk, kdim)), do=(do, (bh, tp, None)),
                 dht=(dht, (None, kdim, do.shape[-1])))
    scan = ScanLayout.of(bh, tp, kdim, do.shape[-1], dht, meta, chunk=chunk, config=config)
    inputs = [p, qg, kg, w, gamma, do, dht] + list(meta or ())
    in_specs = ([scan.rows(chunk), scan.rows(kdim), scan.rows(kdim), scan.rows(kdim), scan.per_chunk(kdim), scan.rows_v,
                 scan.states] + scan.meta)
    return scan.launch(functools.partial(_state_backward_kernel, heads=heads), inputs, in_specs, config=config,
                       name="stellax_kda_state_bwd")
