"""Stage 1 of the chunked pipeline: the decay cumsums.

Every decay the chunked algorithm applies is ``exp`` of a sum of per-step
log decays ``g_t ≤ 0`` over a span of steps inside one chunk of ``C`` tokens
(scalar ``g_t`` for GDN/SSD, a ``K``-vector per channel for KDA):

    D_ij   = Σ_{j<t≤i} g_t          pair spans (the decay between tokens j ≤ i)
    G_i    = Σ_{t≤i} g_t            prefixes (Γ_i = exp(G_i), the decay since the chunk start)
    tail_j = Σ_{t>j} g_t            tails (the decay from token j to the chunk end)
    total  = Σ_t g_t                the chunk's decay (Γ_C)

Each is summed directly over its span — a sum of same-sign terms, exact to a
few ulps of itself — never as a difference of prefix sums ``G_i − G_j``,
which would lose every digit of a short span next to a long one (decays of
−20 per step). Outside a span the exponent is masked (to 0 or −inf), so no
``exp`` overflows and no inf·0 reaches a gradient.

Two forms of the same sums: batched over leading axes for the XLA path
(`pair_sums`, `tail_sums`, `masked_exp`), and on one ``[C]`` / ``[C, K]``
tile inside the Triton kernels (`tile_spans`: a cumulative sum; `span_sum`:
a 0/1-mask matmul; `masked_decay`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST, square_iota
from .mxu import tile_dot


# -- batched (XLA) ------------------------------------------------------------------
def masked_exp(diff, mask):
    """``exp(diff)`` where ``mask``, exactly 0 elsewhere (any shapes that broadcast).

    Every ``diff`` here is a span sum, ≤ 0 inside the mask and exactly 0
    outside it (an empty span), so ``exp`` never overflows and no ``−inf``
    (nor inf·0 in a gradient) appears."""
    return jnp.where(mask, jnp.exp(diff), 0.0)


def pair_sums(g):
    """``D[..., i, j] = Σ_{j < t ≤ i} g_t`` over the last axis of ``g [..., C]`` (0 for ``i ≤ j``).

    Summed directly rather than as ``G_i − G_j``: the g are all ≤ 0, so the
    sum is exact to a few ulps of itself, where the difference of two prefix
    sums (each up to −20·64) would lose every digit of a small ``D``.
    """
    c = g.shape[-1]
    later = jnp.arange(c)[:, None] > jnp.arange(c)[None, :]  # [t, j]: t > j
    return jnp.cumsum(jnp.where(later, g[..., :, None], 0.0), axis=-2)


def tail_sums(g, axis: int = -1):
    """``Σ_{t > j} g_t`` along ``axis`` of ``g`` (an exclusive reverse cumsum), same shape."""
    rev = jnp.flip(jnp.cumsum(jnp.flip(g, axis), axis=axis), axis)
    zero = jnp.zeros_like(jax.lax.slice_in_dim(g, 0, 1, axis=axis))
    return jnp.concatenate([jax.lax.slice_in_dim(rev, 1, g.shape[axis], axis=axis), zero], axis=axis)


def expand_gate(g, like):
    """A per-row gate ``[..., C]`` (scalar decays) or ``[..., C, K]`` (per
    channel) broadcastable against ``like [..., C, K]``."""
    return g[..., None] if g.ndim == like.ndim - 1 else g


# -- one tile (inside the Triton kernels) -----------------------------------------------
def tile_spans(g, chunk: int):
    """The span sums of one chunk's scalar log decays ``g [C]`` (float32):
    ``(D [C, C], G [C], tail [C], total)`` with ``D[i, j] = Σ_{j<t≤i} g_t`` (a
    cumulative sum down the rows of ``[t, j] ↦ g_t (t > j)``: same-sign terms,
    no matmul, so no tensor-core rounding and no FMA dot), ``G_i = Σ_{t≤i} g_t``,
    ``tail_j = Σ_{t>j} g_t`` and ``total = Σ_t g_t``."""
    rows, cols = square_iota(chunk)
    later = jnp.where(rows > cols, g[:, None], 0.0)  # [t, j]: g_t for t > j
    spans = jnp.cumsum(later, axis=0)
    prefix = jnp.sum(jnp.where(rows >= cols, g[None, :], 0.0), axis=1)
    return spans, prefix, jnp.sum(later, axis=0), jnp.sum(g)


def block_pair_spans(blocks, a: int, c: int):
    """``D_ij = Σ_{j<t≤i} g_t`` ``[s, s]`` for the rows ``i`` of block ``a`` and the columns
    ``j`` of block ``c ≤ a`` of a chunk cut into blocks of ``s`` rows, from each block's
    `tile_spans` ``blocks[b] = (D, G, tail, total)`` (all within block ``b``): the
    block's own ``D`` on the diagonal (0 on and above it; mask it), else the span split
    at the start of block ``a``, ``Σ_{a·s≤t≤i} g + (tail_j + Σ_{c<b<a} total_b)`` — a
    sum of same-sign direct span sums, every one ≤ 0."""
    if a == c:
        return blocks[a][0]
    between = blocks[c][2]
    for b in range(c + 1, a):
        between = between + blocks[b][3]
    return blocks[a][1][:, None] + between[None, :]


def span_sum(mask, g, *, precision=HIGHEST, mxu: bool = False):
    """``Σ_t mask[i, t] g_t`` for a 0/1 ``mask [C, C]`` and per-channel ``g [C, K]``:
    a direct sum over each row's span (same-sign terms), ``[C, K]``: exact products
    at `HIGHEST` and at `mxu.EXACT` (three bfloat16 pieces of ``g``, inside a Mosaic TPU
    kernel); at `TF32X3` (tensor cores; the mask is exact in TF32) each ``g_t``
    carries a relative error below 2⁻²⁰; ``mxu``: inside a Mosaic TPU kernel (`mxu.tile_dot`)."""
    return tile_dot(mask.astype(F32), g, precision=precision, mxu=mxu)


def masked_decay(spans, mask):
    """``exp(spans)`` inside ``mask`` and 0 outside (the exponent masked to −inf)."""
    return jnp.exp(jnp.where(mask, spans, -jnp.inf))
