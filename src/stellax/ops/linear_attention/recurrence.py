"""The chunked gated (delta-rule) recurrence GDN, KDA and SSD share: one entry
point, dispatching on the backend and on an explicit per-channel flag.

Every public op prepares its inputs (float32, l2-norm, gates, grouped heads,
scale; SSD maps ``C, B, dt·x, dt·A`` onto ``q, k, v, g``) and calls
`recurrence`:

* ``backend="xla"``: `xla.chunked_scan` (one ``lax.scan`` over chunks, the
  pipeline's stages per step; autodiff through a checkpointed scan);
* ``backend="triton"``: the tokens go to the kernels' heads-major layout
  (`layout.heads_major`) and through the Triton pipeline (`pipeline`) of
  scalar decays (``per_channel=False``: GDN, SSD) or per-channel decays
  (``per_channel=True``: KDA), behind a ``jax.custom_vjp`` whose backward is
  the registered op `backward.gated_recurrence_backward_op` /
  `backward.kda_recurrence_backward_op` (its own implementations and configs);
* ``backend="mosaic_tpu"``: the same layout with head sizes padded to 128
  lanes (`tpu_recurrence`), one fused Mosaic TPU kernel per chunk
  (`mosaic_tpu`), the same custom VJP with the backward ops' ``mosaic_tpu``
  implementation (`mosaic_tpu_backward`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from ...core import Call, Op, backward_implementation
from ...core.pallas import F32, HIGHEST, padded_dim
from . import pipeline, xla
from .backward import gated_recurrence_backward_op, kda_recurrence_backward_op
from .configs import TRITON_CHUNK, linear_attention_heuristic
from .layout import chunk_meta, heads_major, make_stream
from .mosaic_tpu import recurrence_forward as tpu_forward
from .tpu_configs import lanes, linear_attention_tpu_heuristic


def kernel_recurrence(forward, backward_op: Op, backend: str = "triton"):
    """A differentiable recurrence on the kernels' layout:
    ``run(q, k, v, g, beta, h0, meta, config, precision)`` is ``forward`` (a
    Triton pipeline, called with ``precision=``) and its VJP is ``backward_op`` —
    a registered op taking ``(q, k, v, g, beta, h0, do, dfinal, first, seq, last)``
    and the forward's ``precision``, run with its Triton implementation unless
    the caller chose another (`backward_implementation`)."""

    @functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
    def run(q, k, v, g, beta, h0, meta, static):
        return forward(q, k, v, g, beta, h0, meta, static[0], precision=static[1])

    def run_fwd(q, k, v, g, beta, h0, meta, static):
        return forward(q, k, v, g, beta, h0, meta, static[0], precision=static[1]), (q, k, v, g, beta, h0, meta)

    def run_bwd(static, residuals, cotangents):
        q, k, v, g, beta, h0, meta = residuals
        do, dfinal = cotangents
        first, seq, last = meta if meta is not None else (None, None, None)
        grads = backward_op(q, k, v, g, beta, h0, do, dfinal, first, seq, last, precision=static[1],
                            implementation=backward_implementation(backward_op, backend))
        return tuple(grads) + (None,)

    run.defvjp(run_fwd, run_bwd)
    return lambda q, k, v, g, beta, h0, meta, config, precision: run(q, k, v, g, beta, h0, meta, (config, precision))


#: The differentiable Triton recurrences of scalar (GDN, SSD) and per-channel (KDA) decays.
gdn_kernel_recurrence = kernel_recurrence(pipeline.gdn_forward, gated_recurrence_backward_op)
kda_kernel_recurrence = kernel_recurrence(pipeline.kda_forward, kda_recurrence_backward_op)


def _tpu_pipeline(per_channel: bool):
    """The Mosaic TPU forward (`mosaic_tpu.recurrence_forward`) on the heads-major
    layout ``[Bs, HV, Tp, ...]`` with ``meta`` per chunk of `TRITON_CHUNK` (the
    backward ops' layout; regrouped for chunks of 128)."""

    def forward(q, k, v, g, beta, h0, meta, config, *, precision):
        heads = v.shape[1]
        if meta is not None and config.chunk != TRITON_CHUNK:
            step = config.chunk // TRITON_CHUNK
            first, seq, last = meta
            meta = (first[::step], seq[::step], last[step - 1::step])
        flat = lambda x: None if x is None else x.reshape((-1,) + x.shape[2:])
        o, final = tpu_forward(flat(q), flat(k), flat(v), flat(g), flat(beta), flat(h0), meta, heads=heads,
                               per_channel=per_channel, config=config, precision=precision)
        return o.reshape(v.shape), final.reshape(h0.shape)
    return forward


#: The differentiable Mosaic TPU recurrences (backward: the same registered ops).
gdn_tpu_recurrence = kernel_recurrence(_tpu_pipeline(False), gated_recurrence_backward_op, "mosaic_tpu")
kda_tpu_recurrence = kernel_recurrence(_tpu_pipeline(True), kda_recurrence_backward_op, "mosaic_tpu")


def _fine_meta(stream):
    """`chunk_meta` of a stream of chunks of ``C`` (a multiple of `TRITON_CHUNK`)
    restated per chunk of `TRITON_CHUNK` (``None`` when dense)."""
    meta = chunk_meta(stream)
    if meta is None or stream.chunk == TRITON_CHUNK:
        return meta
    step = stream.chunk // TRITON_CHUNK
    first, seq, last = meta
    at = lambda x, i: jnp.zeros((x.shape[0], step), jnp.int32).at[:, i].set(x).reshape(-1)
    return at(first, 0), jnp.repeat(seq, step), at(last, step - 1)


def tpu_recurrence(tokens: dict, prepare, h0, cu_seqlens, *, per_channel: bool, config=None, precision=HIGHEST):
    """`recurrence` on the Mosaic TPU kernels: the heads-major layout with head
    sizes padded to 128 lanes, chunks of ``config.chunk``."""
    q, k, v, g, beta = prepare(tokens)
    B, T, HV, K = k.shape
    V = v.shape[-1]
    if config is None:
        config = linear_attention_tpu_heuristic(Call({"k": k, "v": v, "g": g}, {}))
    stream = make_stream(B, T, config.chunk, cu_seqlens)
    kp, vp = lanes(K), lanes(V)
    b = None if beta is None else heads_major(stream, beta)
    h0p = jnp.pad(h0.astype(F32), [(0, 0), (0, 0), (0, kp - K), (0, vp - V)])
    args = (heads_major(stream, q, kp), heads_major(stream, k, kp), heads_major(stream, v, vp))
    gh = heads_major(stream, g, kp) if per_channel else heads_major(stream, g)
    run = kda_tpu_recurrence if per_channel else gdn_tpu_recurrence
    o, final = run(*args, gh, b, h0p, _fine_meta(stream), config, precision)
    o = stream.unpack(jnp.moveaxis(o, 1, 2))[..., :V]
    final = final[:, :, :K, :V]
    if stream.varlen:
        final = jnp.where(stream.empty[:, None, None, None], h0.astype(F32), final)
    return o, final


def recurrence(backend: str, tokens: dict, prepare, h0, cu_seqlens, *, per_channel: bool, chunk_size: int,
               config=None, precision=HIGHEST):
    """The gated (delta-rule) recurrence, chunked.

    Args:
      backend: ``"xla"``, ``"triton"`` or ``"mosaic_tpu"`` (`tpu_recurrence`).
      tokens: the op's per-token inputs, ``name → [B, T, ...]`` (any dtype).
      prepare: ``prepare(tokens) → (q, k, v, g, beta)`` in float32 — ``q, k
        [..., HV, K]`` (q scaled, heads expanded), ``v [..., HV, V]``, log decays
        ``g [..., HV]`` (scalar) or ``[..., HV, K]`` (``per_channel``), ``beta
        [..., HV]`` or ``None`` — token by token, so it may run on whole arrays
        or on chunks (the XLA scan prepares each chunk inside its step, never
        materializing the prepared copies).
      h0: ``[N, HV, K, V]`` initial states.
      cu_seqlens: ``[N+1]`` offsets of packed sequences or ``None``.
      per_channel: the decays are per channel (KDA) rather than one per token and head.
      chunk_size: the XLA path's chunk (the Triton kernels always use `TRITON_CHUNK`).
      config: the Triton kernels' `LinearAttentionConfig` or the Mosaic TPU
        kernels' `TpuLinearAttentionConfig` (``None``: the heuristic's).
      precision: a resolved `jax.lax.Precision` for every float32 contraction,
        forward and backward (`stellax.core.precision`).
    Returns float32 ``(o [B, T, HV, V], final [N, HV, K, V])``.
    """
    if backend == "xla":
        return xla.chunked_scan(tokens, prepare, initial_state=h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                precision=precision)
    if backend == "mosaic_tpu":
        return tpu_recurrence(tokens, prepare, h0, cu_seqlens, per_channel=per_channel, config=config,
                              precision=precision)
    if backend != "triton":
        raise ValueError(f"backend: expected 'xla', 'triton' or 'mosaic_tpu', got {backend!r}")
    q, k, v, g, beta = prepare(tokens)
    B, T, HV, K = k.shape
    V = v.shape[-1]
    stream = make_stream(B, T, TRITON_CHUNK, cu_seqlens)
    kp, vp = padded_dim(K), padded_dim(V)
    b = None if beta is None else heads_major(stream, beta)
    h0p = jnp.pad(h0.astype(F32), [(0, 0), (0, 0), (0, kp - K), (0, vp - V)])
    args = (heads_major(stream, q, kp), heads_major(stream, k, kp), heads_major(stream, v, vp))
    if config is None:
        config = linear_attention_heuristic(Call({"k": args[1], "v": args[2]}, {}))
    if per_channel:  # padded channels decay by exp(0) = 1
        o, final = kda_kernel_recurrence(*args, heads_major(stream, g, kp), b, h0p, chunk_meta(stream), config,
                                         precision)
    else:
        o, final = gdn_kernel_recurrence(*args, heads_major(stream, g), b, h0p, chunk_meta(stream), config,
                                         precision)
    o = stream.unpack(jnp.moveaxis(o, 1, 2))[..., :V]
    final = final[:, :, :K, :V]
    if stream.varlen:
        final = jnp.where(stream.empty[:, None, None, None], h0.astype(F32), final)
    return o, final
