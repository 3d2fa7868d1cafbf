"""Stage 2 of the chunked pipeline: the decayed scores.

For one chunk, rows ``x`` (``q`` or ``k``) against the chunk's keys:

    S_x[i, j] = Σ_c x_ic k_jc exp(Σ_{j<t≤i} g_tc)      for j ≤ i, else 0

(``g_t`` a scalar per token for GDN/SSD: the decay factors out of the dot,
``S_x = (X Kᵀ) ⊙ exp(D)`` with the pair spans ``D`` of stage 1). ``P = S_q``
weights the chunk's own values in the output; the strictly lower part of
``S_k`` times ``β_i`` is the delta rule's ``A`` (stage 3).

Per-channel decays (KDA) cannot factor the decay as ``(x⊙Γ)(k/Γ)ᵀ``
(``1/Γ`` overflows for strong decays), so the chunk is cut into sub-blocks:
across blocks the decay splits at a reference row ``r`` between ``j`` and
``i`` as ``exp(Σ_{r<t≤i} g) · exp(Σ_{j<t≤r} g)`` (both ≤ 1, one matmul per
block); inside a diagonal block it is formed elementwise. Every exponent is
a direct span sum ≤ 0.

Three forms: `decayed_scores` (XLA, batched, both decay kinds; sub-blocks of
`DECAY_BLOCK` rows), `channel_scores` (one ``[C, K]`` tile inside a kernel,
the Mosaic TPU kernels; sub-blocks of `CHANNEL_SUB_BLOCK` rows) and the
pieces of the Triton forward's sub-block form (`sub_block_spans`,
`diagonal_block_scores`; ``[16, bk]`` and ``[16, 16]`` tiles only, which
`triton_intra` combines block pair by block pair).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from ...core.pallas import F32, HIGHEST, TF32X3, square_iota
from .decay import masked_exp, pair_sums, span_sum, tail_sums
from .mxu import tile_dot
from .solve import sub_block

#: Sub-block size of KDA's per-channel decays on the XLA path: the diagonal
#: blocks cost ``C·s·K`` exps and the off-diagonal factors ``(C/s)·C·K``
#: (measured fastest at the XLA path's KDA chunk of 16 on a CPU).
DECAY_BLOCK = 4
#: Rows per sub-block of the per-channel decayed scores in the Triton kernels.
CHANNEL_SUB_BLOCK = 16


def _einsum(spec, *operands, precision=HIGHEST):
    return jnp.einsum(spec, *operands, precision=precision, preferred_element_type=F32)


def decayed_scores(x, y, g, precision=HIGHEST):
    """``[..., R, C, C]`` decayed inner products of rows of ``x`` with rows of ``y`` (float32).

    Args:
      x: ``[..., R, C, K]`` (``R`` stacked row sets at the same positions, e.g. q and k).
      y: ``[..., C, K]``.
      g: per-step log decays of the chunk, ``[..., C]`` (scalar) or ``[..., C, K]``.
      precision: of the matmuls.
    Returns ``S[r, i, j] = Σ_c x_ric y_jc exp(Σ_{j<t≤i} g_tc)`` for ``j ≤ i``, 0 above.
    """
    c = y.shape[-2]
    causal = jnp.arange(c)[:, None] >= jnp.arange(c)[None, :]
    if g.ndim == y.ndim - 1:  # scalar decay per token
        decay = masked_exp(pair_sums(g), causal)
        return _einsum("...rik,...jk->...rij", x, y, precision=precision) * decay[..., None, :, :]
    return _channel_decayed_scores(x, y, g, precision)


def _channel_decayed_scores(x, y, g, precision=HIGHEST):
    """`decayed_scores` for per-channel ``g [..., C, K]``, in sub-blocks of `DECAY_BLOCK` rows."""
    c = y.shape[-2]
    s = sub_block(c, DECAY_BLOCK)
    nb = c // s
    kdim = y.shape[-1]
    lead = y.shape[:-2]
    r = x.shape[-3]
    gb = g.reshape(*lead, nb, s, kdim)
    xb = x.reshape(*lead, r, nb, s, kdim)
    yb = y.reshape(*lead, nb, s, kdim)
    # Diagonal blocks: elementwise decays [.., nb, s, s, K].
    inner = jnp.arange(s)[:, None] >= jnp.arange(s)[None, :]
    spans = jnp.moveaxis(pair_sums(jnp.swapaxes(gb, -1, -2)), -3, -1)  # [.., nb, s, s, K]
    e = masked_exp(spans, inner[..., None])
    # Explicit products and sums, one row set at a time: a 3-operand einsum here
    # becomes a dot_general batched over every channel (1×1 matrices, 10× slower
    # on XLA:CPU), and broadcasting the row-set axis into the product made the
    # gradient crash XLA:CPU (jax 0.10.2).
    ye = yb[..., :, None, :, :] * e  # [.., nb, i, t, K]
    diag = jnp.stack([jnp.sum(xb[..., j, :, :, None, :] * ye, axis=-1) for j in range(r)], axis=-4)
    # Block a of the rows against block a of the columns: placed on the diagonal of
    # [nb, nb] blocks elementwise (no matmul with the identity: exact at any precision).
    out = diag[..., :, :, :, None, :] * jnp.eye(nb, dtype=F32)[:, None, :, None]
    if nb > 1:
        # Off-diagonal blocks split at the last row r_a = a·s − 1 before block a:
        # exp(Σ_{r_a<t≤i} g) for rows of block a, exp(Σ_{j<t≤r_a} g) for earlier columns j.
        x_exp = xb * jnp.exp(jnp.cumsum(gb, axis=-2))[..., None, :, :, :]
        before = jnp.arange(c)[None, :] < (jnp.arange(nb) * s)[:, None]  # [nb, C]: j < a·s
        upto = jnp.where(before[..., None], g[..., None, :, :], 0.0)  # [.., nb, C, K]
        y_exp = y[..., None, :, :] * masked_exp(tail_sums(upto, axis=-2), before[..., None])
        off = _einsum("...rask,...ajk->...rasj", x_exp, y_exp, precision=precision)
        out = out + off.reshape(off.shape[:-1] + (nb, s))
    return out.reshape(*lead, r, c, c)


def channel_scores(q, k, g, chunk: int, unrolled: bool = False, *, precision=HIGHEST, sums=None, mxu: bool = False):
    """``(P_q, P_k)``, each ``[C, C]`` float32, on one tile inside a kernel:
    ``P_x[i, j] = Σ_c x_ic k_jc exp(Σ_{j<t≤i} g_tc)`` for ``j ≤ i`` and 0 above,
    for ``x = q`` and ``x = k`` (``q, k, g [C, K]`` float32).

    Sub-blocks of ``s`` rows: rows ``i`` of block ``a`` against earlier blocks
    (``j < a·s``) split the decay at the block start,
    ``exp(Σ_{a·s≤t≤i} g)·exp(Σ_{j<t<a·s} g)`` — one matmul per block; within a
    diagonal block, for each offset ``d`` the column ``j = a·s + d`` of every
    block at once, elementwise (``s`` steps of a ``[C, K]`` exp and row sum).
    Every exponent is a direct span sum ≤ 0 (−inf outside its span).
    ``unrolled`` runs the diagonal offsets as a Python loop instead of a ``fori_loop``;
    ``precision`` of the gathers and the block scores, ``sums`` (default: ``precision``;
    `mxu.EXACT` inside a Mosaic TPU kernel) of the 0/1-mask span sums of ``g``
    (``mxu``: inside a Mosaic TPU kernel, `mxu.tile_dot`).
    """
    sums = precision if sums is None else sums
    s = CHANNEL_SUB_BLOCK if chunk % CHANNEL_SUB_BLOCK == 0 else chunk
    rows, cols = square_iota(chunk)
    row = jax.lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)
    start = row & -s  # [C, 1]: the first row of row i's block (s a power of two; no vector division)
    # Σ_{start(i) ≤ t ≤ i} g_t: the row factor of the off-diagonal blocks.
    inner = jnp.exp(span_sum((cols >= start) & (cols <= rows), g, precision=sums, mxu=mxu))
    qi, ki = q * inner, k * inner
    pq = jnp.zeros((chunk, chunk), F32)
    pk = jnp.zeros((chunk, chunk), F32)
    for a in range(1, chunk // s):
        # Column factor exp(Σ_{j<t<a·s} g_t) for the columns j < a·s of earlier blocks.
        span = span_sum((cols > rows) & (cols < a * s), g, precision=sums, mxu=mxu)
        before = jnp.exp(jnp.where(row < a * s, span, -jnp.inf))
        y = k * before
        in_block = start == a * s
        pq = pq + jnp.where(in_block, tile_dot(qi, y, "nt", precision=precision, mxu=mxu), 0.0)
        pk = pk + jnp.where(in_block, tile_dot(ki, y, "nt", precision=precision, mxu=mxu), 0.0)

    def diagonal(d, carry):
        pq, pk = carry
        col = start + d  # [C, 1]: column j = start(i) + d of row i's diagonal block
        pick = cols == col
        kd = tile_dot(pick.astype(F32), k, precision=precision, mxu=mxu)  # row i holds k_j (a gather)
        valid = col <= row
        span = span_sum((cols > col) & (cols <= rows), g, precision=sums, mxu=mxu)
        e = jnp.exp(jnp.where(valid, span, -jnp.inf))
        ke = kd * e
        sq = jnp.sum(q * ke, axis=-1, keepdims=True)
        sk = jnp.sum(k * ke, axis=-1, keepdims=True)
        hit = pick & valid
        return pq + jnp.where(hit, sq, 0.0), pk + jnp.where(hit, sk, 0.0)

    if unrolled:  # a Python loop: differentiable inside a Mosaic TPU kernel (no scan to lower)
        carry = (pq, pk)
        for d in range(s):
            carry = diagonal(d, carry)
        return carry
    return jax.lax.fori_loop(0, s, diagonal, (pq, pk))


# -- sub-blocks (inside the Triton forward kernel) ---------------------------------------
def sub_block_spans(g, precision=TF32X3):
    """The span sums of one sub-block's per-channel log decays ``g [s, bk]`` (rows
    ``i``, ``j`` of the sub-block), float32: ``(Σ_{t≤i} g_t [s, bk], Σ_{t>j} g_t
    [s, bk], Σ_t g_t [bk])`` — a cumulative sum, a 0/1-mask matmul at ``precision``
    (the kernel's, `core.pallas.triton_precision`; Triton has no reverse cumulative
    sum) and a column sum, each a direct sum ≤ 0."""
    rows, cols = square_iota(g.shape[0])
    return jnp.cumsum(g, axis=0), span_sum(cols > rows, g, precision=precision), jnp.sum(g, axis=0)


def diagonal_block_scores(xs, k, g, first, channels, acc):
    """Add one diagonal sub-block's decayed scores ``[s, s]`` of each row set of ``xs``
    (``[s, bk]`` float32, the chunk's rows ``first + i``) to ``acc`` (a tuple like ``xs``):
    ``Σ_c x_ic k_jc exp(Σ_{j<t≤i} g_tc)`` for ``j ≤ i`` (0 above), elementwise, one
    column ``j`` at a time from the last: the exponent of column ``j`` is that of
    ``j + 1`` plus ``g_{j+1}`` on the rows ``i > j`` — a direct sum of same-sign
    terms, no matmul. ``k``, ``g``: refs inside a Triton kernel, read at the rows
    ``first + j`` and the columns ``channels``."""
    s = xs[0].shape[0]
    rows, cols = square_iota(s)
    row = jax.lax.broadcasted_iota(jnp.int32, (s, 1), 0)

    def column(step, carry):
        j = s - 1 - step
        span, acc = carry  # span[i] = Σ_{j<t≤i} g_t on the rows i ≥ j
        kj = k[pl.ds(first + j, 1), channels].astype(F32)
        ke = kj * jnp.exp(jnp.where(row >= j, span, -jnp.inf))
        hit = (cols == j) & (rows >= j)
        acc = tuple(a + jnp.where(hit, jnp.sum(x * ke, axis=1, keepdims=True), 0.0) for a, x in zip(acc, xs))
        span = span + jnp.where(row >= j, g[pl.ds(first + j, 1), channels].astype(F32), 0.0)
        return span, acc

    return jax.lax.fori_loop(0, s, column, (jnp.zeros(xs[0].shape, F32), acc))[1]
