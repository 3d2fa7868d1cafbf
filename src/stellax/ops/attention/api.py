"""Public attention API: `dot_product_attention`, its checks and its ops.

Two registered ops:

* ``attention``: the forward (`dot_product_attention`); implementations
  ``triton`` (Pallas Triton, GPU), ``xla_chunked`` (memory-linear online
  softmax, the CPU default) and ``xla`` (the float32 golden).
* ``attention_backward``: the gradients of ``(out, lse)`` w.r.t.
  ``(q, k, v, bias, sinks)`` on canonical operands, used by the forward
  implementations' ``jax.custom_vjp``.

Every implementation works on *canonical* operands (`Canonical`): batch dims
flattened to one ``B``, bias/mask as ``[B|1, N|1, T|1, S|1]``, the mask
described by a `MaskSpec` plus per-token positions and segment ids (sequence
lengths folded into segment ids).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, Op, backward_implementation, checks, register
from . import examples as examples_mod
from .masks import PAD_KV_SEGMENT, PAD_Q_SEGMENT, MaskSpec, default_positions, visible_fraction
from .reference import attention_forward_reference
from .registry import backward_implementations, forward_implementations


# -- argument checks -----------------------------------------------------------------
def _require_bool(name, value):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")
    return bool(value)


def _require_nonneg_int(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected an int >= 0, got {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError(f"{name}: expected an int >= 0 (a window cannot be negative), got {value}")
    return int(value)


def normalize_window(local_window_size):
    """``None | int | (left, right)`` → ``None | (left|None, right|None)``."""
    if local_window_size is None:
        return None
    if isinstance(local_window_size, (tuple, list)):
        if len(local_window_size) != 2:
            raise ValueError(f"local_window_size: expected an int or a (left, right) pair, "
                             f"got {tuple(local_window_size)!r}")
        left, right = local_window_size
        left = None if left is None else _require_nonneg_int("local_window_size[0] (left)", left)
        right = None if right is None else _require_nonneg_int("local_window_size[1] (right)", right)
        return (left, right)
    w = _require_nonneg_int("local_window_size", local_window_size)
    return (w, w)


def _broadcast_operand_shape(name, value, full, batch_shape, what):
    """Check ``value`` broadcasts as ``[*batch|1, N|1, T|1, S|1]`` (left-padded with 1s)."""
    rank = len(full)
    if value.ndim > rank or value.ndim < 2:
        raise ValueError(f"{name}: expected shape {what} (rank {rank}, each dim its size or 1), "
                         f"got shape {tuple(value.shape)}")
    shape = (1,) * (rank - value.ndim) + tuple(value.shape)
    for d, (got, want) in enumerate(zip(shape, full)):
        if got not in (1, want):
            raise ValueError(f"{name}: expected shape {what} = broadcastable to {tuple(full)}, got "
                             f"{tuple(value.shape)} (dim {d - (rank - value.ndim)} is {got})")


def check_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    local_window_size=None, chunk_size=None, q_segment_ids=None, kv_segment_ids=None,
                    query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None, sinks=None,
                    precision=None, return_residuals=False, q_positions=None, kv_positions=None) -> Call:
    query = checks.require_float("query", query)
    key = checks.require_float("key", key)
    value = checks.require_float("value", value)
    if query.ndim < 3:
        raise ValueError(f"query: expected rank >= 3 ([..., T, N, H]), got shape {tuple(query.shape)}")
    batch = tuple(query.shape[:-3])
    t, n, h = query.shape[-3:]
    checks.require_ndim("key", key, query.ndim)
    checks.require_ndim("value", value, query.ndim)
    s, kh, hk = key.shape[-3:]
    if tuple(key.shape[:-3]) != batch:
        raise ValueError(f"key: expected batch dims {batch} (those of query), got shape {tuple(key.shape)}")
    if hk != h:
        raise ValueError(f"key: expected head dim {h} (query's head dim), got {hk} (shape {tuple(key.shape)})")
    if tuple(value.shape[:-1]) != tuple(key.shape[:-1]):
        raise ValueError(f"value: expected shape {tuple(key.shape[:-1]) + ('Hv',)} (key's [..., S, K]), "
                         f"got {tuple(value.shape)}")
    if kh == 0 or n % kh != 0:
        raise ValueError(f"key: the number of query heads ({n}) must be a multiple of the number of "
                         f"key/value heads ({kh})")
    if min(t, s, h, value.shape[-1]) == 0 or (batch and min(batch) == 0):
        raise ValueError(f"query/key/value: empty dimensions are not supported (query {tuple(query.shape)}, "
                         f"key {tuple(key.shape)}, value {tuple(value.shape)})")
    checks.require_same_dtype("key", key, "query", query)
    checks.require_same_dtype("value", value, "query", query)
    full = batch + (n, t, s)
    what = "[*batch|1, N|1, T|1, S|1]"
    if bias is not None:
        bias = checks.require_float("bias", bias)
        _broadcast_operand_shape("bias", bias, full, batch, what)
    if mask is not None:
        mask = checks.as_array("mask", mask)
        if np.dtype(mask.dtype) != np.dtype(bool):
            raise TypeError(f"mask: expected a bool mask (True = attend; pass additive masks as bias), "
                            f"got {np.dtype(mask.dtype).name}")
        _broadcast_operand_shape("mask", mask, full, batch, what)
    if scale is None:
        scale = 1.0 / math.sqrt(h)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    scale = float(scale)
    is_causal = _require_bool("is_causal", is_causal)
    window = normalize_window(local_window_size)
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
            raise TypeError(f"chunk_size: expected a positive int, got {type(chunk_size).__name__}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
        chunk_size = int(chunk_size)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids/kv_segment_ids: pass both or neither "
                         f"(got q_segment_ids={'set' if q_segment_ids is not None else None}, "
                         f"kv_segment_ids={'set' if kv_segment_ids is not None else None})")
    for name, arr, length in (("q_segment_ids", q_segment_ids, t), ("kv_segment_ids", kv_segment_ids, s),
                              ("q_positions", q_positions, t), ("kv_positions", kv_positions, s)):
        if arr is not None:
            checks.require_int(name, arr)
            checks.require_shape(name, arr, batch + (length,), f"[*batch, {'T' if length == t else 'S'}]")
    if (q_positions is None) != (kv_positions is None):
        raise ValueError("q_positions/kv_positions: pass both or neither")
    for name, arr in (("query_seq_lengths", query_seq_lengths), ("key_value_seq_lengths", key_value_seq_lengths)):
        if arr is not None:
            checks.require_int(name, arr)
            checks.require_shape(name, arr, batch, "[*batch]")
    if logits_soft_cap is not None:
        logits_soft_cap = checks.require_positive_float("logits_soft_cap", logits_soft_cap)
    if sinks is not None:
        sinks = checks.require_float("sinks", sinks)
        checks.require_shape("sinks", sinks, (n,), "[N], one logit per query head")
    return_residuals = _require_bool("return_residuals", return_residuals)
    return Call(
        {"query": query, "key": key, "value": value, "bias": bias, "mask": mask, "sinks": sinks,
         "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids,
         "query_seq_lengths": query_seq_lengths, "key_value_seq_lengths": key_value_seq_lengths,
         "q_positions": q_positions, "kv_positions": kv_positions},
        {"scale": scale, "is_causal": is_causal, "local_window_size": window, "chunk_size": chunk_size,
         "logits_soft_cap": logits_soft_cap, "precision": precision, "return_residuals": return_residuals},
    )


def mask_spec_of(call: Call) -> MaskSpec:
    """The `MaskSpec` of a checked forward call. ``chunk_size`` implies
    causal attention inside each chunk (Llama-4)."""
    window = call.local_window_size
    segments = any(call.arrays[n] is not None for n in
                   ("q_segment_ids", "query_seq_lengths", "key_value_seq_lengths"))
    return MaskSpec(
        causal=call.is_causal or call.chunk_size is not None,
        window_left=None if window is None else window[0],
        window_right=None if window is None else window[1],
        chunk_size=call.chunk_size,
        segments=segments,
    )


# -- canonical operands ------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Canonical:
    """Operands every implementation takes (see the module docstring)."""

    q: Any
    k: Any
    v: Any
    bias: Any
    mask: Any
    sinks: Any
    q_pos: Any
    kv_pos: Any
    q_seg: Any
    kv_seg: Any
    spec: MaskSpec
    scale: float
    logits_soft_cap: float | None
    precision: Any

    @property
    def arrays(self):
        return (self.q, self.k, self.v, self.bias, self.mask, self.sinks, self.q_pos, self.kv_pos,
                self.q_seg, self.kv_seg)

    @property
    def statics(self):
        return dict(spec=self.spec, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                    precision=self.precision)


def _flatten_broadcast(x, batch):
    """``[*batch|1 (left-padded), N|1, T|1, S|1]`` → ``[B|1, N|1, T|1, S|1]``."""
    if x is None:
        return None
    rank = len(batch) + 3
    x = x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))
    lead = tuple(x.shape[:len(batch)])
    if all(d == 1 for d in lead):
        return x.reshape((1,) + tuple(x.shape[len(batch):]))
    x = jnp.broadcast_to(x, tuple(batch) + tuple(x.shape[len(batch):]))
    return x.reshape((int(np.prod(batch)),) + tuple(x.shape[len(batch):]))


def canonicalize(call: Call) -> Canonical:
    query, key, value = call.query, call.key, call.value
    batch = tuple(query.shape[:-3])
    b = int(np.prod(batch)) if batch else 1
    t, n, h = query.shape[-3:]
    s, kh = key.shape[-3:-1]
    q = query.reshape(b, t, n, h)
    k = key.reshape(b, s, kh, h)
    v = value.reshape(b, s, kh, value.shape[-1])
    if call.q_positions is not None:
        q_pos = call.q_positions.reshape(b, t).astype(jnp.int32)
        kv_pos = call.kv_positions.reshape(b, s).astype(jnp.int32)
    else:
        q_pos, kv_pos = default_positions(t, s)
    q_seg = kv_seg = None
    if call.q_segment_ids is not None:
        q_seg = call.q_segment_ids.reshape(b, t).astype(jnp.int32)
        kv_seg = call.kv_segment_ids.reshape(b, s).astype(jnp.int32)
    if call.query_seq_lengths is not None or call.key_value_seq_lengths is not None:
        if q_seg is None:
            q_seg = jnp.zeros((1, t), jnp.int32)
            kv_seg = jnp.zeros((1, s), jnp.int32)
        if call.query_seq_lengths is not None:
            lengths = call.query_seq_lengths.reshape(b, 1).astype(jnp.int32)
            q_seg = jnp.where(jnp.arange(t, dtype=jnp.int32)[None, :] < lengths, q_seg, PAD_Q_SEGMENT)
        if call.key_value_seq_lengths is not None:
            lengths = call.key_value_seq_lengths.reshape(b, 1).astype(jnp.int32)
            kv_seg = jnp.where(jnp.arange(s, dtype=jnp.int32)[None, :] < lengths, kv_seg, PAD_KV_SEGMENT)
    return Canonical(
        q, k, v, _flatten_broadcast(call.bias, batch), _flatten_broadcast(call.mask, batch), call.sinks,
        q_pos, kv_pos, q_seg, kv_seg, mask_spec_of(call), call.scale, call.logits_soft_cap, call.precision,
    )


def finalize(call: Call, out, lse):
    batch = tuple(call.query.shape[:-3])
    t, n = call.query.shape[-3:-1]
    out = out.reshape(batch + (t, n, out.shape[-1]))
    if call.return_residuals:
        return out, lse.reshape(batch + (n, t))
    return out


# -- the backward op ---------------------------------------------------------------
def check_attention_backward(query, key, value, bias, mask, sinks, out, lse, d_out, d_lse, q_positions,
                             kv_positions, q_segment_ids=None, kv_segment_ids=None, *, spec: MaskSpec,
                             scale: float, logits_soft_cap=None, precision=None) -> Call:
    """Checks canonical operands (rank-4 q/k/v, see `Canonical`)."""
    for name, x in (("query", query), ("key", key), ("value", value), ("out", out), ("d_out", d_out)):
        checks.require_float(name, x)
        checks.require_ndim(name, x, 4)
    b, t, n, h = query.shape
    s, kh = key.shape[1:3]
    hv = value.shape[-1]
    checks.require_shape("key", key, (b, s, kh, h))
    checks.require_shape("value", value, (b, s, kh, hv))
    checks.require_shape("out", out, (b, t, n, hv))
    checks.require_shape("d_out", d_out, (b, t, n, hv))
    checks.require_shape("lse", lse, (b, n, t))
    if d_lse is not None:
        checks.require_shape("d_lse", d_lse, (b, n, t))
    if n % kh:
        raise ValueError(f"key: the number of query heads ({n}) must be a multiple of key/value heads ({kh})")
    if not isinstance(spec, MaskSpec):
        raise TypeError(f"spec: expected a MaskSpec, got {type(spec).__name__}")
    checks.require_int("q_positions", q_positions)
    checks.require_int("kv_positions", kv_positions)
    if sinks is not None:
        checks.require_shape("sinks", sinks, (n,))
    return Call(
        {"query": query, "key": key, "value": value, "bias": bias, "mask": mask, "sinks": sinks, "out": out,
         "lse": lse, "d_out": d_out, "d_lse": d_lse, "q_positions": q_positions, "kv_positions": kv_positions,
         "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids},
        {"spec": spec, "scale": float(scale), "logits_soft_cap": logits_soft_cap, "precision": precision},
    )


def backward_canonical(call: Call) -> Canonical:
    return Canonical(call.query, call.key, call.value, call.bias, call.mask, call.sinks, call.q_positions,
                     call.kv_positions, call.q_segment_ids, call.kv_segment_ids, call.spec, call.scale,
                     call.logits_soft_cap, call.precision)


def attention_backward_reference(call: Call):
    """Golden gradients: the VJP of the float32 golden forward.
    Returns ``(dq, dk, dv, dbias, dsinks)`` in the operands' dtypes."""
    c = backward_canonical(call)

    def forward(q, k, v, bias, sinks):
        return attention_forward_reference(q, k, v, bias, c.mask, sinks, c.q_pos, c.kv_pos, c.q_seg,
                                           c.kv_seg, **c.statics)

    f32 = lambda x: None if x is None else x.astype(jnp.float32)
    _, vjp = jax.vjp(forward, f32(c.q), f32(c.k), f32(c.v), f32(c.bias), f32(c.sinks))
    d_lse = call.d_lse if call.d_lse is not None else jnp.zeros(call.lse.shape, jnp.float32)
    grads = vjp((call.d_out.astype(jnp.float32), d_lse.astype(jnp.float32)))
    return tuple(None if g is None else g.astype(x.dtype)
                 for g, x in zip(grads, (c.q, c.k, c.v, c.bias, c.sinks)))


def _bwd_runner(name):
    def run(call: Call, config):
        if name == "xla":
            return attention_backward_reference(call)
        from . import registry
        return registry.BACKWARD_KERNELS[name](backward_canonical(call), call.out, call.lse, call.d_out,
                                                call.d_lse, config)
    return run


def _attention_flops(call: Call, *, backward: bool = False) -> float:
    q, k, v = call.query, call.key, call.value
    b = int(np.prod(q.shape[:-3])) if q.ndim > 3 else 1
    t, n, h = q.shape[-3:]
    s, hv = k.shape[-3], v.shape[-1]
    density = visible_fraction(mask_spec_of(call) if not backward else call.spec, t, s)
    per_pair = 2 * (h + hv) if not backward else 2 * (3 * h + 2 * hv)
    return float(b * n * t * s * per_pair * density)


def _nbytes(x) -> float:
    return 0.0 if x is None else float(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def _attention_bytes(call: Call) -> float:
    total = sum(_nbytes(call.arrays[k]) for k in ("query", "key", "value", "bias", "mask"))
    q, v = call.query, call.value
    return total + _nbytes(q) / q.shape[-1] * v.shape[-1]


def _backward_bytes(call: Call) -> float:
    return sum(2 * _nbytes(call.arrays[k]) for k in ("query", "key", "value", "bias")) + \
        sum(_nbytes(call.arrays[k]) for k in ("out", "d_out", "lse", "mask"))


attention_backward_op = register(Op(
    "attention_backward",
    family="attention",
    check=check_attention_backward,
    reference=attention_backward_reference,
    implementations=backward_implementations(_bwd_runner),
    flops=lambda call: _attention_flops(call, backward=True),
    bytes_accessed=_backward_bytes,
    examples=examples_mod.backward_examples,
))


# -- the forward op ----------------------------------------------------------------
def attention_with_vjp(name: str, config, c: Canonical):
    """Run forward implementation ``name`` with a ``jax.custom_vjp`` whose
    backward is the ``attention_backward`` op (matching implementation).
    Returns ``(out, lse)``; both are differentiable."""
    from . import registry
    forward_kernel = registry.FORWARD_KERNELS[name]
    statics = c.statics

    # Integer/bool operands are arguments (not closed over: they may be tracers);
    # their cotangents are None.
    def run_forward(q, k, v, bias, sinks, mask, q_pos, kv_pos, q_seg, kv_seg):
        cc = dataclasses.replace(c, q=q, k=k, v=v, bias=bias, sinks=sinks, mask=mask, q_pos=q_pos,
                                 kv_pos=kv_pos, q_seg=q_seg, kv_seg=kv_seg)
        return forward_kernel(cc, config)

    @jax.custom_vjp
    def attend(*operands):
        return run_forward(*operands)

    def fwd(*operands):
        out, lse = run_forward(*operands)
        return (out, lse), (operands, out, lse)

    def bwd(res, cotangents):
        (q, k, v, bias, sinks, mask, q_pos, kv_pos, q_seg, kv_seg), out, lse = res
        d_out, d_lse = cotangents
        dq, dk, dv, dbias, dsinks = attention_backward_op(
            q, k, v, bias, mask, sinks, out, lse, d_out.astype(out.dtype), d_lse, q_pos, kv_pos, q_seg,
            kv_seg, **statics, implementation=backward_implementation(attention_backward_op, name))
        return dq, dk, dv, dbias, dsinks, None, None, None, None, None

    attend.defvjp(fwd, bwd)
    return attend(c.q, c.k, c.v, c.bias, c.sinks, c.mask, c.q_pos, c.kv_pos, c.q_seg, c.kv_seg)


def _forward_runner(name):
    def run(call: Call, config):
        c = canonicalize(call)
        if name == "xla":
            out, lse = attention_forward_reference(*c.arrays, **c.statics)
        else:
            out, lse = attention_with_vjp(name, config, c)
        return finalize(call, out, lse)
    return run


def _reference(call: Call):
    c = canonicalize(call)
    out, lse = attention_forward_reference(*c.arrays, **c.statics)
    return finalize(call, out, lse)


attention_op = register(Op(
    "attention",
    family="attention",
    check=check_attention,
    reference=_reference,
    implementations=forward_implementations(_forward_runner),
    flops=_attention_flops,
    bytes_accessed=_attention_bytes,
    examples=examples_mod.forward_examples,
    benchmarks=examples_mod.benchmarks,
    peers=examples_mod.peers(),
    differentiable=("query", "key", "value", "bias", "sinks"),
))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          local_window_size=None, chunk_size=None, q_segment_ids=None, kv_segment_ids=None,
                          query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None, sinks=None,
                          precision=None, return_residuals=False, implementation=None, config=None,
                          preferred_element_type=None):
    """Scaled dot-product attention with the full mask family (flash attention).

    Shapes: ``B...`` is any number (≥ 0) of leading batch dims, ``T``/``S``
    the query/key lengths, ``N`` query heads, ``K`` key/value heads
    (``N % K == 0``: GQA/MQA by head groups, K/V never repeated), ``H`` the
    query/key head dim and ``Hv`` the value head dim (may differ from ``H``).

    Args:
      query: ``[B..., T, N, H]`` float32/bfloat16/float16.
      key: ``[B..., S, K, H]``, same dtype as ``query``.
      value: ``[B..., S, K, Hv]``, same dtype as ``query``.
      bias: additive float logits bias broadcastable as ``[B...|1, N|1, T|1, S|1]``
        (added after the soft cap; may hold ``-inf``).
      mask: boolean, same broadcasting as ``bias``; ``True`` = attend.
      scale: logits scale; default ``1/sqrt(H)``.
      is_causal: causal mask, **bottom-right aligned** when ``T != S``: query
        ``i`` sees keys ``j <= i + S - T`` (FlashAttention's convention; for
        ``T == S`` it is the usual lower triangle, as in
        `jax.nn.dot_product_attention`, whose causal mask is top-left aligned
        for ``T != S``).
      local_window_size: ``w`` (= ``(w, w)``) or ``(left, right)``: query at
        position ``p`` sees keys in ``[p - left, p + right]``; ``None`` for
        either side means unbounded. Same alignment as ``is_causal``.
      chunk_size: Llama-4 chunked attention: a query sees only keys of its own
        chunk of ``chunk_size`` positions, causally (implies ``is_causal``).
      q_segment_ids / kv_segment_ids: ``[B..., T]`` / ``[B..., S]`` ints:
        packed documents; a token attends only within its segment.
      query_seq_lengths / key_value_seq_lengths: ``[B...]`` ints: rows past the
        query length output zeros; keys past the kv length are masked.
      logits_soft_cap: ``cap · tanh(logits / cap)`` (Gemma 2 / Grok).
      sinks: ``[N]`` float: a per-head logit that joins the softmax
        denominator only (gpt-oss / StreamingLLM attention sinks).
      precision: matmul precision for the XLA paths (the golden uses HIGHEST).
      return_residuals: also return the log-sum-exp ``[B..., N, T]`` float32
        of the softmax normalizer (including the sink): ``-inf`` for a fully
        masked row. It is differentiable, so partial attentions can be merged
        (``out = Σ exp(lse_i - lse) out_i``) with correct gradients.
      implementation: ``None`` (the best available: ``triton`` on a GPU, then
        ``xla_chunked``, ending in ``xla``), ``"triton"``, ``"xla_chunked"``,
        ``"xla"`` or a sequence tried in order.
      config: an explicit kernel config for the chosen implementation.
      preferred_element_type: fp8 attention only: the output dtype
        (bfloat16 by default; float16 or float32).

    FP8 attention: any of ``query``/``key``/``value`` may be a `QArray` in
    ``fp8_e4m3``/``fp8_e5m2`` with per-tensor, per-(batch,)head or
    per-token-and-head scales (see `stellax.ops.attention.fp8`); this runs
    the ``attention_fp8`` op (the quantized operands are constants under
    differentiation).

    All masks combine by AND. A fully masked row returns zeros and zero
    gradients, never NaN.

    Returns:
      ``out [B..., T, N, Hv]`` in the input dtype, or ``(out, lse)`` with
      ``return_residuals``.
    """
    from . import fp8
    if fp8.is_quantized(query, key, value):
        return fp8.attention_fp8_op(
            query, key, value, bias, mask, scale=scale, is_causal=is_causal, local_window_size=local_window_size,
            chunk_size=chunk_size, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
            query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
            logits_soft_cap=logits_soft_cap, sinks=sinks, precision=precision, return_residuals=return_residuals,
            preferred_element_type=preferred_element_type, implementation=implementation, config=config)
    if preferred_element_type is not None:
        raise ValueError("preferred_element_type: only for fp8 attention (QArray query/key/value); float "
                         f"attention returns the input dtype, got {preferred_element_type!r}")
    return attention_op(query, key, value, bias, mask, scale=scale, is_causal=is_causal,
                        local_window_size=local_window_size, chunk_size=chunk_size, q_segment_ids=q_segment_ids,
                        kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
                        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap,
                        sinks=sinks, precision=precision, return_residuals=return_residuals,
                        implementation=implementation, config=config)
