"""The chunked gated (delta-rule) recurrence GDN, KDA and SSD share: one entry
point, `recurrence`, run by a row of `base.BACKENDS`.

Every public op prepares its inputs (float32, l2-norm, gates, grouped heads,
scale; SSD maps ``C, B, dt·x, dt·A`` onto ``q, k, v, g``) and calls
`recurrence` with its backend's row:

* the XLA row (no kernel ``forward``): `xla.chunked_scan` (one ``lax.scan``
  over chunks, the pipeline's stages per step; autodiff through a
  checkpointed scan);
* a kernel row (Triton: `pipeline`; Mosaic TPU: `mosaic_tpu`): the tokens go
  to the kernels' heads-major layout (`layout.heads_major`, head sizes padded
  by the row's ``head_size``, chunks of its ``chunk``) and through the row's
  ``forward``, differentiated by the `core.vjp` rule `KernelRecurrence`, whose
  backward is the registered op `backward.gated_recurrence_backward_op`
  (scalar decays: GDN, SSD) or `backward.kda_recurrence_backward_op`
  (per-channel decays: KDA) with the same backend's implementation
  (`core.backward_implementation`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ...core import Call, backward_implementation, vjp
from ...core.backends import Backend
from ...core.pallas import F32, HIGHEST
from . import xla
from .backward import RECURRENCE_BACKWARD
from .configs import TRITON_CHUNK
from .layout import chunk_meta, heads_major, make_stream


@dataclasses.dataclass(frozen=True)
class KernelRecurrence:
    """A kernel row's recurrence on the heads-major layout, as a `core.vjp` rule:
    operands ``(q, k, v, g, beta, h0, meta)`` (``meta``: ``None`` or int32
    ``(first, seq, last)`` per chunk of `TRITON_CHUNK`), outputs float32
    ``(o, final)``; the backward is the recurrence's backward op (scalar or
    ``per_channel`` decays) at the forward's ``precision``. A row whose kernels write ``o`` in
    a dtype (``kernels.typed_output``) writes it in ``out_dtype``; its cotangent goes to the
    backward op in float32. Grouped ``q, k`` (``kernels.grouped``: ``H < HV`` heads) go to the
    backward op expanded; their cotangents are summed over each key head's value heads in float32
    and rounded once to the operands' dtype (for bfloat16 operands one rounding more than when the
    expanded copies were the operands)."""

    row: Backend
    config: Any
    per_channel: bool
    precision: Any
    out_dtype: Any = F32

    def forward(self, q, k, v, g, beta, h0, meta):
        extra = {"out_dtype": self.out_dtype} if self.row.kernels.typed_output else {}
        out = self.row.kernels.forward(q, k, v, g, beta, h0, meta, self.config, per_channel=self.per_channel,
                                       precision=self.precision, **extra)
        return out, (q, k, v, g, beta, h0, meta)

    def backward(self, residuals, cotangents):
        q, k, v, g, beta, h0, meta = residuals
        group = v.shape[1] // k.shape[1]  # grouped q, k (`Kernels.grouped`): the backward op takes them expanded
        if group > 1:
            q, k = jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1)
        do, dfinal = cotangents
        do = do.astype(F32)
        first, seq, last = meta if meta is not None else (None, None, None)
        op = RECURRENCE_BACKWARD[self.per_channel]
        grads = list(op(q, k, v, g, beta, h0, do, dfinal, first, seq, last, precision=self.precision,
                        implementation=backward_implementation(op, self.row.name)))
        if group > 1:  # each key head's cotangent: the sum over its value heads (float32, rounded once)
            grads[:2] = [d.astype(F32).reshape(d.shape[:1] + (-1, group) + d.shape[2:]).sum(axis=2).astype(d.dtype)
                         for d in grads[:2]]
        return tuple(grads) + (None,)


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


def _kernel_recurrence(row: Backend, tokens: dict, prepare, h0, cu_seqlens, *, per_channel: bool, config,
                       precision, inputs, out_dtype):
    """`recurrence` on a kernel row (module docstring)."""
    kernels = row.kernels
    q, k, v, g, beta = prepare(tokens, expand=kernels.grouped is None)
    dtype = F32 if kernels.operand_dtype is None else kernels.operand_dtype(inputs)
    B, T, H, K = k.shape
    HV, V = v.shape[2:]
    if config is None:  # the heuristic reads shapes, dtypes and the precision
        typed = lambda x: jax.ShapeDtypeStruct(x.shape, dtype)
        config = row.tuning.heuristic(Call({"k": typed(k), "v": typed(v), "g": g}, {"precision": precision}))
    if H != HV and not kernels.grouped(config, HV // H):  # key heads the kernels cannot share: expanded
        q, k = jnp.repeat(q, HV // H, axis=2), jnp.repeat(k, HV // H, axis=2)
    stream = make_stream(B, T, kernels.chunk(config), cu_seqlens)
    kp, vp = kernels.head_size(K), kernels.head_size(V)
    b = None if beta is None else heads_major(stream, beta)
    h0p = jnp.pad(h0.astype(F32), [(0, 0), (0, 0), (0, kp - K), (0, vp - V)])
    args = (heads_major(stream, q, kp, dtype), heads_major(stream, k, kp, dtype), heads_major(stream, v, vp, dtype))
    gh = heads_major(stream, g, kp) if per_channel else heads_major(stream, g)  # padded channels: exp(0) = 1
    rule = KernelRecurrence(row, config, per_channel, precision, jnp.dtype(out_dtype))
    o, final = vjp.apply(rule, *args, gh, b, h0p, _fine_meta(stream))
    o = stream.unpack(jnp.moveaxis(o, 1, 2))[..., :V]
    final = final[:, :, :K, :V]
    if stream.varlen:
        final = jnp.where(stream.empty[:, None, None, None], h0.astype(F32), final)
    return o, final


def recurrence(row: Backend, tokens: dict, prepare, h0, cu_seqlens, *, per_channel: bool, chunk_size: int,
               config=None, precision=HIGHEST, inputs=F32, out_dtype=F32):
    """The gated (delta-rule) recurrence, chunked.

    Args:
      row: the backend's row of `base.BACKENDS` (module docstring).
      tokens: the op's per-token inputs, ``name → [B, T, ...]`` (any dtype).
      prepare: ``prepare(tokens, expand=True) → (q, k, v, g, beta)`` in float32 — ``q, k
        [..., HV, K]`` (q scaled, heads expanded; ``expand=False``: their own ``H`` heads, for a
        kernel row that shares them, ``kernels.grouped``), ``v [..., HV, V]``, log decays
        ``g [..., HV]`` (scalar) or ``[..., HV, K]`` (``per_channel``), ``beta
        [..., HV]`` or ``None`` — token by token, so it may run on whole arrays
        or on chunks (the XLA scan prepares each chunk inside its step, never
        materializing the prepared copies).
      h0: ``[N, HV, K, V]`` initial states.
      cu_seqlens: ``[N+1]`` offsets of packed sequences or ``None``.
      per_channel: the decays are per channel (KDA) rather than one per token and head.
      chunk_size: the XLA path's chunk (the Triton kernels always use `TRITON_CHUNK`).
      config: the row's config (`LinearAttentionConfig` for the Triton kernels,
        `TpuLinearAttentionConfig` for the Mosaic TPU kernels; ``None``: the heuristic's).
      precision: a resolved `jax.lax.Precision` for every float32 contraction,
        forward and backward (`stellax.core.precision`).
      inputs: the dtype of the op's inputs that ``q, k, v`` are made of: a kernel row
        takes ``q, k, v`` in its ``operand_dtype`` of it (the Mosaic TPU kernels:
        bfloat16 for bfloat16 inputs, whose products run `mxu.BF16_PRODUCTS`).
      out_dtype: the dtype the caller casts ``o`` to right after (a kernel row that writes
        ``o`` itself, ``kernels.typed_output``, writes it in this dtype: one rounding, as the cast's).
    Returns ``(o [B, T, HV, V], final [N, HV, K, V])``, ``final`` float32, ``o`` float32 or ``out_dtype``.
    """
    if row.kernels.forward is None:
        return xla.chunked_scan(tokens, prepare, initial_state=h0, cu_seqlens=cu_seqlens, chunk_size=chunk_size,
                                precision=precision)
    return _kernel_recurrence(row, tokens, prepare, h0, cu_seqlens, per_channel=per_channel, config=config,
                              precision=precision, inputs=inputs, out_dtype=out_dtype)
