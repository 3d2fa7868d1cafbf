"""Torch front end of FP8 attention: `dot_product_attention` with `QTensor`
query / key / value in ``fp8_e4m3`` / ``fp8_e5m2`` (per-tensor, per-head or
per-token-and-head scales; see `stellax.ops.attention.fp8`), and
`quantize_for_attention` to make them.

`stellax.torch.dot_product_attention` dispatches here when any of its
query/key/value is a `QTensor`. Gradients are those JAX defines: the
quantized operands are constants (codes and scales get no gradient); float
operands mixed with quantized ones, ``bias`` and ``sinks`` get the gradients
of attention over the dequantized operands.
"""

from __future__ import annotations

import json

import jax
import numpy as np
import torch

from . import bridge
from .quant import QTensor, _cached, _qarray
from .registry import define_op

_NAMES = ("query", "key", "value")


def _meta(q: QTensor) -> str:
    return json.dumps({"format": q.format, "shape": list(q.shape), "block_shape": list(q.block_shape),
                       "axis": int(q.axis)})


def _operand(x, values, scales, meta):
    if meta is None:
        return x
    m = json.loads(meta)
    return _qarray(values, scales, None, None, m["format"], m["shape"], m["block_shape"], m["axis"], None)


def _fp8_attention(query, query_values, query_scales, key, key_values, key_scales, value, value_values, value_scales,
                   bias, mask, q_segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths, sinks, *,
                   query_meta, key_meta, value_meta, scale, is_causal, local_window_size, logits_soft_cap,
                   preferred_element_type, implementation):
    import stellax
    window = None
    if local_window_size is not None:
        left, right = local_window_size
        window = (None if left < 0 else left, None if right < 0 else right)
    return stellax.dot_product_attention(
        _operand(query, query_values, query_scales, query_meta), _operand(key, key_values, key_scales, key_meta),
        _operand(value, value_values, value_scales, value_meta), bias, mask, scale=scale, is_causal=is_causal,
        local_window_size=window, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
        query_seq_lengths=query_seq_lengths, key_value_seq_lengths=key_value_seq_lengths,
        logits_soft_cap=logits_soft_cap, sinks=sinks, preferred_element_type=preferred_element_type,
        implementation=implementation)


def _fake(query, qv, qs, key, kv, ks, value, vv, vs, *rest, query_meta, value_meta, preferred_element_type, **_):
    q_shape = json.loads(query_meta)["shape"] if query_meta is not None else query.shape
    v_shape = json.loads(value_meta)["shape"] if value_meta is not None else value.shape
    like = next(t for t in (query, qv) if t is not None)
    dtype = torch.bfloat16 if preferred_element_type is None else getattr(torch, preferred_element_type)
    return like.new_empty((*q_shape[:-1], v_shape[-1]), dtype=dtype)


dot_product_attention_fp8_op = define_op(
    "dot_product_attention_fp8", _fp8_attention,
    tensors=("query?", "query_values?!", "query_scales?!", "key?", "key_values?!", "key_scales?!", "value?",
             "value_values?!", "value_scales?!", "bias?", "mask?!", "q_segment_ids?!", "kv_segment_ids?!",
             "query_seq_lengths?!", "key_value_seq_lengths?!", "sinks?"),
    options={"query_meta": "str?", "key_meta": "str?", "value_meta": "str?", "scale": "float?", "is_causal": "bool",
             "local_window_size": "int[]?", "logits_soft_cap": "float?", "preferred_element_type": "str?",
             "implementation": "str?"},
    fake=_fake)


def operand_args(name: str, x) -> list:
    """A float tensor or an fp8 `QTensor` → ``[float, values, scales]`` and its meta option."""
    if isinstance(x, QTensor):
        if x.zero_points is not None or x.tensor_scale is not None or x.rotation is not None:
            raise ValueError(f"{name}: fp8 attention takes QTensors in fp8_e4m3/fp8_e5m2 without zero points, "
                             f"tensor scale or rotation, got format {x.format}")
        return [None, x.values, x.scales], _meta(x)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or a QTensor, got {type(x).__name__}")
    return [x, None, None], None


def _quantize_for_attention(x, *, format, scales):
    from stellax.ops.attention import quantize_for_attention as qfa
    q = qfa(x, format, scales=scales)
    return q.values, q.scales


quantize_for_attention_op = define_op("quantize_for_attention", _quantize_for_attention, tensors=("x!",),
                                      options={"format": "str", "scales": "str"}, outputs=2, differentiable=False)


def quantize_for_attention(x: torch.Tensor, format: str = "fp8_e4m3", *, scales: str = "token") -> QTensor:
    """Quantize an attention operand ``[B..., L, heads, head_dim]``
    (float32/bfloat16/float16) to an fp8 `QTensor` for `dot_product_attention`
    (`stellax.ops.attention.quantize_for_attention`): ``format``
    ``"fp8_e4m3"``/``"fp8_e5m2"``; ``scales`` ``"tensor"``, ``"head"`` (one per
    (batch, head)) or ``"token"`` (per token and head). The result is data:
    no gradient flows back to ``x`` (the scales are float32 functions of
    ``x`` as in JAX, but fp8 attention treats its quantized operands as
    constants, so ``x`` is detached)."""
    values, sc = quantize_for_attention_op(x.detach(), str(format), str(scales))
    key = ("quantize_for_attention", "aux", tuple(x.shape), x.dtype, format, scales)

    def aux():
        from stellax.ops.attention import quantize_for_attention as qfa
        q = jax.eval_shape(lambda a: qfa(a, format, scales=scales),
                           jax.ShapeDtypeStruct(tuple(x.shape), bridge.jax_dtype(x.dtype)))
        return q.format, tuple(q.shape), tuple(q.block_shape), int(q.axis)
    fmt, shape, block_shape, axis = _cached(key, aux)
    return QTensor(values, sc, None, None, fmt, shape, block_shape, axis, None)


def dtype_option(dtype) -> str | None:
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"preferred_element_type: expected a torch.dtype or None, got {dtype!r}")
    return np.dtype(bridge.jax_dtype(dtype)).name
