"""The chunked algorithm in XLA: one ``lax.scan`` over chunks (the CPU default).

Each scan step handles one chunk of every (batch, head) pair through the
pipeline's stages: the intra-chunk part (stages 1–4, `wy.chunk_intra`), the
state step and the output (stages 5–6, `output.chunk_step`). Keeping a whole step inside the scan keeps its working set
(a chunk of q/k/v and the ``[K, V]`` states) in cache, which on a CPU is
worth more than batching the intra-chunk work across chunks.

Gradients: the step is wrapped in ``jax.checkpoint``, so reverse-mode
autodiff stores only the state at each chunk boundary and recomputes the
intra-chunk part during the backward scan (memory ``O(NT·K·V)`` per head,
like the Triton backward). All exponents are ≤ 0, so the autodiff graph is
free of inf·0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core.pallas import F32, HIGHEST
from .layout import Stream, from_chunks, make_stream, to_chunks
from .output import chunk_step
from .wy import chunk_intra


def _heads_first(x):
    """``[Bs, C, H, ...]`` → ``[Bs, H, C, ...]`` (in-step, in cache)."""
    return None if x is None else jnp.swapaxes(x, 1, 2)


def scan_chunks(xs, h0, stream: Stream, prepare=None, precision=HIGHEST):
    """The scan over chunks.

    Args:
      xs: per-chunk inputs, ``[NT, Bs, C, ...]`` each: with ``prepare`` the raw
        token inputs it maps to ``(q, k, v, g, beta)``; else those directly,
        ``q, k [NT, Bs, C, HV, K]`` (q scaled), ``v [NT, Bs, C, HV, V]``, ``g``
        (per-step log decays ``[NT, Bs, C, HV(, K)]``) and ``beta [NT, Bs, C, HV]``
        or ``None``. An optional ``valid [NT, Bs, C]`` marks real tokens (the
        decay of padding tokens is forced to 0: an identity step).
      h0: ``[N, HV, K, V]`` initial states (N = Bs, or the number of packed sequences).
      stream: the token layout (resets and final states of packed sequences).
      precision: of every contraction (a resolved `jax.lax.Precision`).
    Returns ``(o [NT, Bs, C, HV, V], final [N, HV, K, V])``.
    """
    xs = dict(xs)
    if stream.varlen:
        xs["first"], xs["seq"] = stream.chunk_first, stream.chunk_seq

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def step(S, x):
        if stream.varlen:
            S = jnp.where(x["first"], h0[x["seq"]][None], S)
        if prepare is not None:
            q, k, v, g, beta = prepare(x)
        else:
            q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
        if "valid" in x:
            mask = x["valid"].reshape(x["valid"].shape + (1,) * (g.ndim - 2))
            g = jnp.where(mask, g, 0.0)
        q, k, v, g, beta = (_heads_first(a) for a in (q, k, v, g, beta))
        parts = chunk_intra(q, k, v, g, beta, precision)
        new, out = chunk_step(S, parts, precision)
        return new, (_heads_first(out), new if stream.varlen else None)

    last, (o, ends) = jax.lax.scan(step, h0[:1] if stream.varlen else h0, xs)
    if not stream.varlen:
        return o, last
    final = ends[stream.last_chunk, 0]
    return o, jnp.where(stream.empty[:, None, None, None], h0, final)


def chunked_scan(tokens, prepare, *, initial_state, cu_seqlens, chunk_size, precision=HIGHEST):
    """Chunked gated linear recurrence (computed in float32).

    Args:
      tokens: per-token inputs ``[B, T, ...]``; ``prepare`` maps them (or
        chunks of them) to ``(q, k, v, g, beta)`` as in `recurrence.recurrence`.
      initial_state: ``[N, HV, K, V]``.
    Returns ``(o [B, T, HV, V], final_state [N, HV, K, V])`` in float32.
    """
    first = next(iter(tokens.values()))
    B, T = first.shape[:2]
    stream = make_stream(B, T, chunk_size, cu_seqlens)
    xs = {n: to_chunks(stream.pack(x), chunk_size) for n, x in tokens.items() if x is not None}
    if stream.varlen or stream.padded != T:
        xs["valid"] = to_chunks(stream.pack(jnp.ones((B, T), bool)), chunk_size)
    o, final = scan_chunks(xs, initial_state.astype(F32), stream, lambda x: prepare(
        {n: x.get(n) for n in tokens}), precision)
    return stream.unpack(from_chunks(o)), final
