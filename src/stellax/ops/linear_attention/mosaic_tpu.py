"""Pallas Mosaic TPU kernels of the chunked recurrence (forward): stages 1–6
fused in one kernel per chunk, the state carried in VMEM across chunks.

Grid ``(BH, V/BV, NT)``: every (batch·head, block of ``BV`` value columns)
pair is independent (``"parallel"``) and walks its ``NT`` chunks in order
(``"arbitrary"``), holding ``S [K, BV]`` in a float32 VMEM scratch. The value
columns of the delta rule are independent given the keys (``W`` and ``T``
depend on ``k, g, β`` only), so splitting ``V`` recomputes the chunk's solve
per value block and nothing else.

Per chunk of ``C`` tokens (notation of `wy`, `scan`, `output`; every
exponent a direct span sum ≤ 0, masked to −inf outside its span):

    scalar decays (GDN, SSD):                  per-channel decays (KDA):
    D_ij = Σ_{j<t≤i} g_t  (0/1-mask matmul)     P_x = scores.channel_scores (sub-blocks)
    P_x  = (X Kᵀ) ⊙ exp(D)   (x = q, k)
    A  = β ⊙ strictly_lower(P_k),   T = (I + A)⁻¹   (`solve.unit_lower_inverse`: log₂C MXU products)
    U  = T (β V),   W = T (β Γ K)                   (SSD: U = V, no W)
    Δ  = U − W S,   O = (Γ Q) S + P_q Δ,   S ← Γ_C S + K̃ᵀ Δ    (K̃_j = k_j exp(Σ_{t>j} g_t))

Layout (`recurrence`): heads-major, flattened, ``q, k [BH, Tp, Kp]``,
``v [BH, Tp, Vp]``, head sizes zero-padded to multiples of 128 lanes;
scalar decays come twice, as a column ``[BH, Tp, 1]`` and as rows
``[BH, NT, 1, C]`` (span sums over lanes stay exact), ``β`` as a column.
Packed batches use int32 ``first, seq, last [NT]`` by scalar prefetch (dense
batches get ``first = [c = 0]``, ``seq = 0``, ``last = [c = NT−1]``): the
state is reset to ``h0[seq·HV + head]`` at a sequence's first chunk and
written to ``final[seq·HV + head]`` at its last (the block index maps read
``seq``). Padding tokens are the identity step (``k = v = q = β = g = 0``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ...core.pallas import F32, dot, dot_nt, dot_tn, operand, output, square_iota, tpu_kernel_call
from .scores import channel_scores
from .solve import unit_lower_inverse
from .tpu_configs import TpuLinearAttentionConfig, tpu_vmem_limit


def dense_meta(chunks: int):
    """int32 ``(first, seq, last) [NT]`` of a dense row: one sequence over all chunks."""
    c = np.arange(chunks)
    return tuple(jnp.asarray(x, jnp.int32) for x in (c == 0, np.zeros(chunks), c == chunks - 1))


def scalar_spans(g_col, g_row, chunk: int):
    """Span sums of one chunk's scalar log decays, from ``g`` as a column
    ``[C, 1]`` and as a row ``[1, C]``: ``(D [C, C], G [C, 1], tail [C, 1],
    total [1, 1])`` with ``D_ij = Σ_{j<t≤i} g_t`` (a matmul with a 0/1 mask),
    ``G_i = Σ_{t≤i} g_t``, ``tail_j = Σ_{t>j} g_t`` (lane sums) and ``total = Σ_t g_t``."""
    rows, cols = square_iota(chunk)
    later = jnp.where(rows > cols, g_col, 0.0)  # [t, j]: g_t for t > j
    spans = dot((rows >= cols).astype(F32), later)
    prefix = jnp.sum(jnp.where(cols <= rows, g_row, 0.0), axis=1, keepdims=True)
    tail = jnp.sum(jnp.where(cols > rows, g_row, 0.0), axis=1, keepdims=True)
    return spans, prefix, tail, jnp.sum(g_row, axis=1, keepdims=True)


def _start_chunk(first, h0, state):
    @pl.when(first[pl.program_id(2)] != 0)
    def _():
        state[...] = h0[...].astype(F32)


def _finish_chunk(last, final, state, new):
    state[...] = new

    @pl.when(last[pl.program_id(2)] != 0)
    def _():
        final[...] = new


def _delta_rule(k_rows, kk_scores, beta, v, chunk: int):
    """``(U, T)`` of the delta rule: ``T = (I + β ⊙ strictly_lower(S_k))⁻¹``, ``U = T (β V)``."""
    rows, cols = square_iota(chunk)
    a = jnp.where(rows > cols, kk_scores, 0.0) * beta
    t = unit_lower_inverse(a, rows, cols, chunk)
    return dot(t, beta * v), t


def _scalar_kernel(*, first, seq, last, q, k, v, g, g_row, beta, h0, o, final, state, chunk):
    """One chunk of the scalar-decay recurrence (GDN with ``beta``, SSD without)."""
    del seq
    _start_chunk(first, h0, state)
    qc, kc, vc = q[...], k[...], v[...]
    spans, prefix, tail, total = scalar_spans(g[...], g_row[...], chunk)
    rows, cols = square_iota(chunk)
    decay = jnp.exp(jnp.where(rows >= cols, spans, -jnp.inf))
    s = state[...]
    qg = qc * jnp.exp(prefix)
    if beta is None:
        delta = vc
    else:
        b = beta[...]
        kk = dot_nt(kc, kc) * decay
        u, t = _delta_rule(kc, kk, b, vc, chunk)
        w = dot(t, b * jnp.exp(prefix) * kc)
        delta = u - dot(w, s)
    p = dot_nt(qc, kc) * decay
    o[...] = (dot(qg, s) + dot(p, delta)).astype(o.dtype)
    new = jnp.exp(total) * s + dot_tn(kc * jnp.exp(tail), delta)
    _finish_chunk(last, final, state, new)


def _channel_kernel(*, first, seq, last, q, k, v, g, beta, h0, o, final, state, chunk):
    """One chunk of the per-channel (KDA) recurrence."""
    del seq
    _start_chunk(first, h0, state)
    qc, kc, vc, gc, b = q[...], k[...], v[...], g[...], beta[...]
    rows, cols = square_iota(chunk)
    prefix = dot((rows >= cols).astype(F32), gc)  # Σ_{t≤i} g_t per channel
    tail = dot((cols > rows).astype(F32), gc)     # Σ_{t>j} g_t per channel
    gate = jnp.exp(prefix)
    pq, pk = channel_scores(qc, kc, gc, chunk)
    u, t = _delta_rule(kc, pk, b, vc, chunk)
    w = dot(t, b * gate * kc)
    s = state[...]
    delta = u - dot(w, s)
    o[...] = (dot(qc * gate, s) + dot(pq, delta)).astype(o.dtype)
    # Γ_C per channel as a column [K, 1]: Σ_t g_tk by a matmul with ones (lanes all equal).
    gamma = jnp.exp(dot_tn(gc, jnp.ones((chunk, 128), F32))[:, :1])
    new = gamma * s + dot_tn(kc * jnp.exp(tail), delta)
    _finish_chunk(last, final, state, new)


def recurrence_forward(q, k, v, g, beta, h0, meta, *, heads: int, per_channel: bool,
                       config: TpuLinearAttentionConfig):
    """The chunked recurrence on the kernels' layout (module docstring), float32.

    Args:
      q, k: ``[BH, Tp, Kp]`` (q scaled); v: ``[BH, Tp, Vp]``; ``Kp, Vp``
        multiples of 128, ``Tp`` a multiple of ``config.chunk``.
      g: ``[BH, Tp]`` scalar or ``[BH, Tp, Kp]`` per-channel (``per_channel``) log decays.
      beta: ``[BH, Tp]`` or ``None`` (no delta rule; scalar decays only).
      h0: ``[N·HV, Kp, Vp]`` initial states; meta: ``None`` (dense) or int32
        ``(first, seq, last) [NT]`` of a packed row (``BH = HV``).
      heads: ``HV``.
    Returns ``(o [BH, Tp, Vp], final [N·HV, Kp, Vp])``; the final state of a
    packed sequence with no chunk is left unwritten (the caller passes ``h0``).
    """
    bh, tp, kp = k.shape
    vp = v.shape[-1]
    chunk, bv = config.chunk, min(config.block_v, vp)
    for name, x in (("k", k), ("v", v)):
        if x.shape[-1] % 128:
            raise ValueError(f"{name}: expected a head size padded to a multiple of 128, got {x.shape[-1]}")
    if tp % chunk:
        raise ValueError(f"k: expected a padded length that is a multiple of {chunk}, got {tp}")
    if vp % bv:
        raise ValueError(f"config.block_v: expected a divisor of the padded value size {vp}, got {bv}")
    if per_channel and beta is None:
        raise ValueError("beta: the per-channel recurrence is a delta rule (beta required), got None")
    nt = tp // chunk
    first, seq, last = dense_meta(nt) if meta is None else meta
    tok = lambda width: pl.BlockSpec((None, chunk, width), lambda i, j, c, *_: (i, c, 0))
    cols = pl.BlockSpec((None, chunk, bv), lambda i, j, c, *_: (i, c, j))
    state_spec = pl.BlockSpec((None, kp, bv), lambda i, j, c, first, seq, last: (seq[c] * heads + i, 0, j))
    inputs = {"q": operand(q, tok(kp)), "k": operand(k, tok(kp)), "v": operand(v, cols),
              "beta": operand(None if beta is None else beta[..., None], tok(1)),
              "h0": operand(h0, state_spec)}
    if per_channel:
        inputs["g"] = operand(g, tok(kp))
        kernel = _channel_kernel
    else:
        inputs["g"] = operand(g[..., None], tok(1))
        inputs["g_row"] = operand(g.reshape(bh, nt, 1, chunk),
                                  pl.BlockSpec((None, None, 1, chunk), lambda i, j, c, *_: (i, c, 0, 0)))
        kernel = _scalar_kernel
    outs = tpu_kernel_call(
        lambda **refs: kernel(**refs, chunk=chunk),
        grid=(bh, vp // bv, nt),
        inputs=inputs,
        outputs={"o": output((bh, tp, vp), F32, cols), "final": output(h0.shape, F32, state_spec)},
        scratch={"state": pltpu.VMEM((kp, bv), F32)},
        scalar_prefetch={"first": first, "seq": seq, "last": last},
        dimension_semantics=("parallel", "parallel", "arbitrary"),
        vmem_limit_bytes=tpu_vmem_limit(kp, bv, chunk, per_channel),
        name="linear_attention_channel_forward" if per_channel else "linear_attention_scalar_forward",
    )
    return outs.o, outs.final
