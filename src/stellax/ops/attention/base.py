"""What the attention implementations share.

* the argument check of `dot_product_attention` (`check_attention`, also run
  by fp8 attention on stand-ins for its operands);
* the canonical form every implementation works on (`Canonical`,
  `canonicalize` for the forward ops, `backward_canonical` for the backward
  op) and `finalize` (back to the caller's batch dims);
* the cost models (FLOPs and bytes of the forward and backward ops);
* the backend table (`BACKENDS`): one row per backend, its `Kernels` (a
  forward ``kernel(canonical, config) -> (out, lse)`` and a backward on the
  saved ``(out, lse)``) and its configs; the forward and backward ops'
  implementations are generated from it (the forward's `core.vjp` rule is in
  `backward.py`, next to the backward op it calls).

Canonical operands: batch dims flattened to one ``B``, bias/mask as
``[B|1, N|1, T|1, S|1]``, the mask described by a `MaskSpec` plus per-token
positions and segment ids (sequence lengths folded into segment ids). fp8
attention adds per-row scales of the q/k/v codes and the output dtype.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ...core import Call, checks
from ...core.backends import Backend, BackendTable, Tuning
from ...core.pallas import nbytes
from ...core.precision import resolve_precision
from . import configs, mosaic_tpu, mosaic_tpu_backward, triton, triton_backward, xla_chunked
from .masks import PAD_KV_SEGMENT, PAD_Q_SEGMENT, MaskSpec, default_positions, mask_spec_of, visible_fraction
from .reference import attention_forward_reference

F32 = jnp.float32
BROADCAST = "[*batch|1, N|1, T|1, S|1]"


# -- the argument check ---------------------------------------------------------------
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


def _check_qkv(query, key, value):
    """q/k/v shapes and dtypes; returns ``(batch, (t, s, n))``."""
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
    return batch, (t, s, n)


def _check_broadcast(name, value, full):
    """Check ``value`` broadcasts as ``[*batch|1, N|1, T|1, S|1]`` (left-padded with 1s)."""
    rank = len(full)
    if value.ndim > rank or value.ndim < 2:
        raise ValueError(f"{name}: expected shape {BROADCAST} (rank {rank}, each dim its size or 1), "
                         f"got shape {tuple(value.shape)}")
    shape = (1,) * (rank - value.ndim) + tuple(value.shape)
    for d, (got, want) in enumerate(zip(shape, full)):
        if got not in (1, want):
            raise ValueError(f"{name}: expected shape {BROADCAST} = broadcastable to {tuple(full)}, got "
                             f"{tuple(value.shape)} (dim {d - (rank - value.ndim)} is {got})")


def _check_dense(bias, mask, full):
    if bias is not None:
        bias = checks.require_float("bias", bias)
        _check_broadcast("bias", bias, full)
    if mask is not None:
        mask = checks.as_array("mask", mask)
        if np.dtype(mask.dtype) != np.dtype(bool):
            raise TypeError(f"mask: expected a bool mask (True = attend; pass additive masks as bias), "
                            f"got {np.dtype(mask.dtype).name}")
        _check_broadcast("mask", mask, full)
    return bias, mask


def _check_mask_options(scale, is_causal, local_window_size, chunk_size, head_dim) -> dict:
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale: expected a float or None, got {type(scale).__name__}")
    if chunk_size is not None:
        if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
            raise TypeError(f"chunk_size: expected a positive int, got {type(chunk_size).__name__}")
        if chunk_size <= 0:
            raise ValueError(f"chunk_size: expected a positive int, got {chunk_size}")
        chunk_size = int(chunk_size)
    return {"scale": float(scale), "is_causal": _require_bool("is_causal", is_causal),
            "local_window_size": normalize_window(local_window_size), "chunk_size": chunk_size}


def _check_token_arrays(batch, t, s, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                        query_seq_lengths, key_value_seq_lengths):
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


def check_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                    local_window_size=None, chunk_size=None, q_segment_ids=None, kv_segment_ids=None,
                    query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None, sinks=None,
                    precision=None, return_residuals=False, q_positions=None, kv_positions=None) -> Call:
    """The checked `Call` of `dot_product_attention` (see there for the arguments)."""
    query = checks.require_float("query", query)
    key = checks.require_float("key", key)
    value = checks.require_float("value", value)
    batch, (t, s, n) = _check_qkv(query, key, value)
    bias, mask = _check_dense(bias, mask, batch + (n, t, s))
    options = _check_mask_options(scale, is_causal, local_window_size, chunk_size, query.shape[-1])
    _check_token_arrays(batch, t, s, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                        query_seq_lengths, key_value_seq_lengths)
    if logits_soft_cap is not None:
        logits_soft_cap = checks.require_positive_float("logits_soft_cap", logits_soft_cap)
    if sinks is not None:
        sinks = checks.require_float("sinks", sinks)
        checks.require_shape("sinks", sinks, (n,), "[N], one logit per query head")
    precision = resolve_precision(precision)
    return Call(
        {"query": query, "key": key, "value": value, "bias": bias, "mask": mask, "sinks": sinks,
         "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids,
         "query_seq_lengths": query_seq_lengths, "key_value_seq_lengths": key_value_seq_lengths,
         "q_positions": q_positions, "kv_positions": kv_positions},
        {**options, "logits_soft_cap": logits_soft_cap, "precision": precision,
         "return_residuals": _require_bool("return_residuals", return_residuals)},
    )


# -- the canonical form -------------------------------------------------------------------
_ARRAYS = ("q", "k", "v", "bias", "mask", "sinks", "q_pos", "kv_pos", "q_seg", "kv_seg", "row_scales")
_STATICS = ("spec", "scale", "logits_soft_cap", "precision", "out_dtype")


@dataclasses.dataclass(frozen=True, eq=False)
class Canonical:
    """Operands every implementation takes (a pytree: the arrays are its leaves).

    ``q [B, T, N, H]``, ``k [B, S, K, H]``, ``v [B, S, K, Hv]``, ``bias``/``mask``
    ``[B|1, N|1, T|1, S|1]`` or None, ``sinks [N]`` or None, positions
    ``q_pos [B|1, T]`` / ``kv_pos [B|1, S]`` and segments ``q_seg [B|1, T]`` /
    ``kv_seg [B|1, S]`` (None without segments) int32.

    fp8 attention: ``q``/``k``/``v`` may hold fp8 codes; ``row_scales`` is then
    ``(s_q [B, T, N], s_k [B, S, K], s_v [B, S, K])`` float32 (None for a float
    operand) and ``out_dtype`` the output dtype. Float attention: both None.
    """

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
    row_scales: tuple | None = None
    out_dtype: Any = None

    @property
    def arrays(self):
        """The golden's operands, in `attention_forward_reference`'s order."""
        return (self.q, self.k, self.v, self.bias, self.mask, self.sinks, self.q_pos, self.kv_pos,
                self.q_seg, self.kv_seg)

    @property
    def statics(self):
        return dict(spec=self.spec, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                    precision=self.precision)

    def dequantized(self, dtype=None) -> "Canonical":
        """fp8 attention: q/k/v decoded (codes × row scales; constants under
        differentiation) in ``dtype`` (default the output dtype). Float
        attention: ``self``."""
        if self.row_scales is None:
            return self
        dtype = self.out_dtype if dtype is None else dtype

        def decode(x, s):
            if s is None:
                return x.astype(dtype)
            x, s = jax.lax.stop_gradient(x), jax.lax.stop_gradient(s)
            return (x.astype(F32) * s[..., None]).astype(dtype)

        q, k, v = (decode(x, s) for x, s in zip((self.q, self.k, self.v), self.row_scales))
        return dataclasses.replace(self, q=q, k=k, v=v, row_scales=None, out_dtype=None)


jax.tree_util.register_dataclass(Canonical, data_fields=list(_ARRAYS), meta_fields=list(_STATICS))


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


def _segments(call: Call, b: int, t: int, s: int):
    """``(q_seg, kv_seg)`` with the sequence lengths folded in (padding rows/keys
    get segments no real token has), or ``(None, None)``."""
    q_seg = kv_seg = None
    if call.q_segment_ids is not None:
        q_seg = call.q_segment_ids.reshape(b, t).astype(jnp.int32)
        kv_seg = call.kv_segment_ids.reshape(b, s).astype(jnp.int32)
    if call.query_seq_lengths is None and call.key_value_seq_lengths is None:
        return q_seg, kv_seg
    if q_seg is None:
        q_seg, kv_seg = jnp.zeros((1, t), jnp.int32), jnp.zeros((1, s), jnp.int32)
    if call.query_seq_lengths is not None:
        lengths = call.query_seq_lengths.reshape(b, 1).astype(jnp.int32)
        q_seg = jnp.where(jnp.arange(t, dtype=jnp.int32)[None, :] < lengths, q_seg, PAD_Q_SEGMENT)
    if call.key_value_seq_lengths is not None:
        lengths = call.key_value_seq_lengths.reshape(b, 1).astype(jnp.int32)
        kv_seg = jnp.where(jnp.arange(s, dtype=jnp.int32)[None, :] < lengths, kv_seg, PAD_KV_SEGMENT)
    return q_seg, kv_seg


def _row_scales(call: Call, b: int, lengths_and_heads):
    """fp8 attention: the canonical ``(s_q, s_k, s_v)`` (``[B, L, heads]`` float32,
    None for a float operand); float attention: None."""
    if "q_scales" not in call.arrays:
        return None
    out = []
    for s, (length, heads) in zip((call.q_scales, call.k_scales, call.v_scales), lengths_and_heads):
        if s is not None:
            lead = s.shape[:-2]
            s = s.reshape((int(np.prod(lead)) if lead else 1,) + tuple(s.shape[-2:]))
            s = jnp.broadcast_to(s, (b, length, heads))
        out.append(s)
    return tuple(out)


def canonicalize(call: Call) -> Canonical:
    """The `Canonical` operands of a checked forward call (float or fp8 attention)."""
    query, key, value = call.query, call.key, call.value
    batch = tuple(query.shape[:-3])
    b = int(np.prod(batch)) if batch else 1
    t, n, h = query.shape[-3:]
    s, kh = key.shape[-3:-1]
    if call.q_positions is not None:
        q_pos = call.q_positions.reshape(b, t).astype(jnp.int32)
        kv_pos = call.kv_positions.reshape(b, s).astype(jnp.int32)
    else:
        q_pos, kv_pos = default_positions(t, s)
    q_seg, kv_seg = _segments(call, b, t, s)
    out_dtype = call.options.get("preferred_element_type")
    return Canonical(
        query.reshape(b, t, n, h), key.reshape(b, s, kh, h), value.reshape(b, s, kh, value.shape[-1]),
        _flatten_broadcast(call.bias, batch), _flatten_broadcast(call.mask, batch), call.sinks,
        q_pos, kv_pos, q_seg, kv_seg, mask_spec_of(call), call.scale, call.logits_soft_cap, call.precision,
        row_scales=_row_scales(call, b, ((t, n), (s, kh), (s, kh))),
        out_dtype=None if out_dtype is None else np.dtype(out_dtype),
    )


def backward_canonical(call: Call) -> Canonical:
    """The `Canonical` operands of a checked ``attention_backward`` call."""
    return Canonical(call.query, call.key, call.value, call.bias, call.mask, call.sinks, call.q_positions,
                     call.kv_positions, call.q_segment_ids, call.kv_segment_ids, call.spec, call.scale,
                     call.logits_soft_cap, call.precision)


def finalize(call: Call, out, lse):
    """Canonical ``(out, lse)`` → the caller's batch dims (and, for fp8
    attention, the output dtype); ``out`` alone unless ``return_residuals``."""
    batch = tuple(call.query.shape[:-3])
    t, n = call.query.shape[-3:-1]
    out = out.reshape(batch + (t, n, out.shape[-1]))
    out_dtype = call.options.get("preferred_element_type")
    if out_dtype is not None:
        out = out.astype(out_dtype)
    if call.return_residuals:
        return out, lse.reshape(batch + (n, t))
    return out


# -- cost models ------------------------------------------------------------------------
def _flops(q, k, v, spec: MaskSpec, per_pair: int) -> float:
    b = int(np.prod(q.shape[:-3])) if q.ndim > 3 else 1
    t, n = q.shape[-3:-1]
    s = k.shape[-3]
    return float(b * n * t * s * per_pair * visible_fraction(spec, t, s))


def forward_flops(call: Call) -> float:
    """``q·kᵀ`` and ``p·v`` over the visible pairs."""
    h, hv = call.query.shape[-1], call.value.shape[-1]
    return _flops(call.query, call.key, call.value, mask_spec_of(call), 2 * (h + hv))


def backward_flops(call: Call) -> float:
    """Recomputed ``q·kᵀ``, then ``dO·vᵀ``, ``pᵀ·dO``, ``ds·k`` and ``dsᵀ·q`` over the visible pairs."""
    h, hv = call.query.shape[-1], call.value.shape[-1]
    return _flops(call.query, call.key, call.value, call.spec, 2 * (3 * h + 2 * hv))


def forward_bytes(call: Call) -> float:
    """Read q/k/v/bias/mask, write the output."""
    read = sum(nbytes(call.arrays[k]) for k in ("query", "key", "value", "bias", "mask"))
    q, v = call.query, call.value
    return float(read + nbytes(q) / q.shape[-1] * v.shape[-1])


def backward_bytes(call: Call) -> float:
    """Read and write (gradient) q/k/v/bias; read out, d_out, lse and mask."""
    return float(sum(2 * nbytes(call.arrays[k]) for k in ("query", "key", "value", "bias")) +
                 sum(nbytes(call.arrays[k]) for k in ("out", "d_out", "lse", "mask")))


# -- the backend table ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Kernels:
    """One backend's attention kernels (the ``kernels`` of its `BACKENDS` row).

    Attributes:
      forward: ``forward(canonical, config) -> (out [B, T, N, Hv], lse [B, N, T])``.
      backward: ``backward(canonical, out, lse, d_out, d_lse, config) -> (dq, dk, dv, dbias, dsinks)``.
      flash: the backward is a kernel on the forward's softmax statistics (``p = exp(s − lse)``,
        ``delta = rowsum(dO·O) − dlse``, FlashAttention-2 style): the forward is differentiated by
        the ``attention_backward`` op (`core.vjp`), and context parallelism may call that backward
        with merged statistics. ``False``: the golden, differentiated by JAX autodiff, whose
        backward recomputes its own softmax.
    """

    forward: Callable[..., tuple]
    backward: Callable[..., tuple]
    flash: bool = True


def golden_forward(c: Canonical, config=None):
    """The float32 golden on canonical operands (fp8: dequantized): ``(out, lse)``."""
    c = c.dequantized(F32)
    return attention_forward_reference(*c.arrays, **c.statics)


def golden_backward(c: Canonical, out, lse, d_out, d_lse, config=None):
    """Golden gradients: the VJP of the float32 golden forward, ``(dq, dk, dv, dbias, dsinks)`` in
    the operands' dtypes (``out`` is not needed: the golden recomputes its softmax)."""

    def forward(q, k, v, bias, sinks):
        return attention_forward_reference(q, k, v, bias, c.mask, sinks, c.q_pos, c.kv_pos, c.q_seg,
                                           c.kv_seg, **c.statics)

    f32 = lambda x: None if x is None else x.astype(F32)
    _, vjp_fn = jax.vjp(forward, f32(c.q), f32(c.k), f32(c.v), f32(c.bias), f32(c.sinks))
    d_lse = d_lse if d_lse is not None else jnp.zeros(lse.shape, F32)
    grads = vjp_fn((d_out.astype(F32), d_lse.astype(F32)))
    return tuple(None if g is None else g.astype(x.dtype)
                 for g, x in zip(grads, (c.q, c.k, c.v, c.bias, c.sinks)))


#: The attention backends in dispatch order: the forward ops' (``attention``, ``attention_fp8``)
#: and the ``attention_backward`` op's implementations are generated from it.
BACKENDS = BackendTable("attention", [
    Backend("mosaic_tpu", Kernels(mosaic_tpu.forward, mosaic_tpu_backward.backward), "mosaic_tpu",
            Tuning(configs.SplashConfig, configs.splash_heuristic, configs.splash_space,
                   configs.splash_requirements),
            Tuning(configs.SplashBackwardConfig, configs.splash_backward_heuristic,
                   configs.splash_backward_space, configs.splash_requirements)),
    Backend("triton", Kernels(triton.forward, triton_backward.backward), "triton",
            Tuning(configs.FlashConfig, configs.flash_heuristic, configs.flash_space, configs.flash_requirements),
            Tuning(configs.FlashBackwardConfig, configs.flash_backward_heuristic, configs.flash_backward_space,
                   configs.flash_requirements)),
    Backend("xla_chunked", Kernels(xla_chunked.forward, xla_chunked.backward),
            tuning=Tuning(configs.ChunkedConfig, configs.chunked_heuristic, configs.chunked_space)),
    Backend("xla", Kernels(golden_forward, golden_backward, flash=False)),
])

#: fp8 attention's backends: the Mosaic TPU kernel does not read fp8 codes.
FP8_BACKENDS = ("triton", "xla_chunked", "xla")


def reference(call: Call, config=None):
    """The float32 golden of a forward call (fp8: of the dequantized operands)."""
    out, lse = golden_forward(canonicalize(call))
    return finalize(call, out, lse)
