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

import jax
import numpy as np
import torch
from jax import Array

import stellax
from stellax import QArray
from stellax.ops.attention import quantize_for_attention as _jax_quantize_for_attention

from . import bridge
from .options import decode_window, dtype_name
from .quant import QTensor
from .registry import _cached, define_op

_NAMES = ("query", "key", "value")


def _fp8_attention(query: QArray | Array, key: QArray | Array, value: QArray | Array, bias: Array | None,
                   mask: Array | None, q_segment_ids: Array | None, kv_segment_ids: Array | None,
                   query_seq_lengths: Array | None, key_value_seq_lengths: Array | None, sinks: Array | None, *,
                   scale: float | None, is_causal: bool, local_window_size: list[int] | None,
                   logits_soft_cap: float | None, preferred_element_type: str | None,
                   implementation: str | None) -> Array:
    return stellax.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        local_window_size=decode_window(local_window_size), q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap, sinks=sinks,
        preferred_element_type=preferred_element_type, implementation=implementation)


#: The quantized operands are constants: their float32 scales get no gradient.
dot_product_attention_fp8_op = define_op(
    "dot_product_attention_fp8", _fp8_attention,
    no_grad=tuple(f"{n}_{part}" for n in _NAMES for part in ("scales", "tensor_scale")))


def check_operand(name: str, x) -> None:
    """An fp8 attention operand: a float tensor or an fp8 `QTensor` without
    zero points, tensor scale or rotation."""
    if isinstance(x, QTensor):
        if x.zero_points is not None or x.tensor_scale is not None or x.rotation is not None:
            raise ValueError(f"{name}: fp8 attention takes QTensors in fp8_e4m3/fp8_e5m2 without zero points, "
                             f"tensor scale or rotation, got format {x.format}")
    elif not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or a QTensor, got {type(x).__name__}")


def dot_product_attention_fp8(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, query_seq_lengths,
                              key_value_seq_lengths, sinks, scale, is_causal, local_window_size, logits_soft_cap,
                              preferred_element_type, implementation) -> torch.Tensor:
    """`stellax.torch.dot_product_attention` with at least one `QTensor`
    operand (arguments already encoded: int32 ids, ``[left, right]`` window)."""
    for name, x in zip(_NAMES, (query, key, value)):
        check_operand(name, x)
    return dot_product_attention_fp8_op(
        query, key, value, bias, mask, q_segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths,
        sinks, scale, is_causal, local_window_size, logits_soft_cap,
        dtype_name("preferred_element_type", preferred_element_type), implementation)


def _quantize_for_attention(x: Array, *, format: str, scales: str) -> tuple[Array, Array]:
    q = _jax_quantize_for_attention(x, format, scales=scales)
    return q.values, q.scales


quantize_for_attention_op = define_op("quantize_for_attention", _quantize_for_attention, differentiable=False)


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
        q = jax.eval_shape(lambda a: _jax_quantize_for_attention(a, format, scales=scales),
                           jax.ShapeDtypeStruct(tuple(x.shape), bridge.jax_dtype(x.dtype)))
        return q.format, tuple(q.shape), tuple(q.block_shape), int(q.axis)
    fmt, shape, block_shape, axis = _cached(key, aux)
    return QTensor(values, sc, None, None, fmt, shape, block_shape, axis, None)
