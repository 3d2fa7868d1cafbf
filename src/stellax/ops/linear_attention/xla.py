"""The XLA backend (the ``kernels`` of the ``xla`` rows in `base`): the
chunked algorithm as one ``lax.scan`` over chunks (the CPU default), the
backward ops' XLA implementation, and the decode ops' XLA paths.

Each scan step handles one chunk of every (batch, head) pair through the
pipeline's stages: the intra-chunk part (stages 1–4, `wy.chunk_intra`), the
state step and the output (stages 5–6, `output.chunk_step`). Keeping a whole step inside the scan keeps its working set
(a chunk of q/k/v and the ``[K, V]`` states) in cache, which on a CPU is
worth more than batching the intra-chunk work across chunks.

Gradients: the step is wrapped in ``jax.checkpoint``, so reverse-mode
autodiff stores only the state at each chunk boundary and recomputes the
intra-chunk part during the backward scan (memory ``O(NT·K·V)`` per head,
like the Triton backward). All exponents are ≤ 0, so the autodiff graph is
free of inf·0. The backward ops' XLA implementation (`backward`) is the VJP
of the same scan on their layout; the decode ops (`fused_recurrent`,
`ssd_step`) run the token recurrences of `reference` at the call's precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core import Call
from ...core.pallas import F32, HIGHEST
from .configs import TRITON_CHUNK
from .layout import Stream, differentiate, from_chunks, make_stream, per_chunk, stream_of, to_chunks
from .output import chunk_step
from .reference import delta_rule_recurrence, prepare_delta_inputs, ssd_step_reference
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


# -- the backward ops ----------------------------------------------------------------------
def _forward_on_layout(call: Call, q, k, v, g, beta, h0):
    """The forward on a backward call's layout (`scan_chunks`)."""
    stream = stream_of(call)
    # [Bs, HV, NT, C, ...] → [NT, Bs, C, HV, ...]
    to_scan = lambda x: None if x is None else jnp.moveaxis(jnp.moveaxis(per_chunk(x, TRITON_CHUNK), 2, 0), 2, 3)
    o, final = scan_chunks({"q": to_scan(q), "k": to_scan(k), "v": to_scan(v), "g": to_scan(g),
                            "beta": to_scan(beta)}, h0, stream, precision=call.precision)
    return jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 2).reshape(v.shape), final


def backward(call: Call, config=None, *, per_channel: bool):
    """The backward ops' XLA implementation: the VJP of the chunked scan on their layout."""
    del config, per_channel
    return differentiate(call, _forward_on_layout)


# -- the decode ops ------------------------------------------------------------------------
def fused_recurrent(call: Call, config=None):
    """`fused_recurrent_gated_delta_rule` / `fused_recurrent_kda`: the token recurrence at the
    call's precision, ``(o in v.dtype, final_state float32 or None)``."""
    del config
    q, k, g, beta = prepare_delta_inputs(call)
    o, final = delta_rule_recurrence(q, k, call.v, g, beta, scale=call.scale, initial_state=call.initial_state,
                                     cu_seqlens=call.cu_seqlens, precision=call.precision)
    return o.astype(call.v.dtype), (final if call.output_final_state else None)


def ssd_step(call: Call, config=None):
    """`ssd_step`: the golden step at the call's precision, ``(y in x.dtype, new_state in state.dtype)``."""
    del config
    return ssd_step_reference(call, call.precision)
