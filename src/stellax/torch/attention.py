"""Torch front end of `stellax.dot_product_attention`.

Layouts are those of the JAX twin: query ``[B, T, N, H]``, key ``[B, S, K, H]``,
value ``[B, S, K, Hv]`` (GQA when ``N % K == 0``, keys never repeated).
"""

from __future__ import annotations

import torch
from jax import Array

import stellax

from . import attention_fp8 as fp8
from .options import decode_window, encode_window, int32, opt_float, opt_int
from .quant import QTensor
from .registry import define_op


def _attention(query: Array, key: Array, value: Array, bias: Array | None, mask: Array | None,
               q_segment_ids: Array | None, kv_segment_ids: Array | None, query_seq_lengths: Array | None,
               key_value_seq_lengths: Array | None, sinks: Array | None, *, scale: float | None, is_causal: bool,
               local_window_size: list[int] | None, logits_soft_cap: float | None, implementation: str | None,
               chunk_size: int | None, precision: str | None) -> Array:
    return stellax.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        local_window_size=decode_window(local_window_size), q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap, sinks=sinks,
        implementation=implementation, chunk_size=chunk_size, precision=precision)


dot_product_attention_op = define_op("dot_product_attention", _attention)


def dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          bias: torch.Tensor | None = None, mask: torch.Tensor | None = None, *,
                          scale: float | None = None, is_causal: bool = False, local_window_size=None,
                          q_segment_ids: torch.Tensor | None = None, kv_segment_ids: torch.Tensor | None = None,
                          query_seq_lengths: torch.Tensor | None = None,
                          key_value_seq_lengths: torch.Tensor | None = None,
                          logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                          implementation: str | None = None,
                          preferred_element_type: torch.dtype | None = None, chunk_size: int | None = None,
                          precision: str | None = None) -> torch.Tensor:
    """`stellax.dot_product_attention` on torch tensors.

    Args:
      query: ``[B, T, N, H]``; key ``[B, S, K, H]``; value ``[B, S, K, Hv]``
        (``N % K == 0``: GQA/MQA without repeating K/V).
      bias: additive, broadcastable to ``[B, N, T, S]``; differentiable.
      mask: boolean, broadcastable to ``[B, N, T, S]`` (True = attend).
      scale: logit scale (default ``H ** -0.5``).
      is_causal: bottom-right aligned when ``T != S`` (query ``i`` sees keys
        ``<= i + S - T``), as in FlashAttention.
      local_window_size: ``int`` or ``(left, right)`` sliding window
        (``None`` for an unbounded side).
      q_segment_ids / kv_segment_ids: ``[B, T]`` / ``[B, S]`` integer ids;
        tokens attend only within their segment.
      query_seq_lengths / key_value_seq_lengths: ``[B]`` valid lengths.
      logits_soft_cap: ``cap * tanh(logits / cap)``.
      sinks: ``[N]`` per-head sink logits (differentiable).
      implementation: forwarded to stellax (``None`` = best available).
      preferred_element_type: fp8 attention only: the output dtype
        (bfloat16 by default, float16 or float32).
      chunk_size: chunked attention (Llama 4): queries see only keys in
        their own chunk of ``chunk_size`` positions.
      precision: ``None`` or a `jax.lax.Precision` name (``"highest"``, ...).

    FP8 attention: any of query/key/value may be a `QTensor` in
    ``fp8_e4m3``/``fp8_e5m2`` (from `quantize_for_attention` or
    ``quantize(x, "fp8_e4m3")``); the quantized operands are constants (no
    gradient), float operands, bias and sinks stay differentiable. See
    `stellax.torch.attention_fp8`.

    Returns:
      ``[B, T, N, Hv]`` in ``query.dtype`` (fp8: ``preferred_element_type``).
      Differentiable in query, key, value, bias and sinks. Fully masked rows
      give zeros.
    """
    window = encode_window(local_window_size)  # jax.nn: an int w means (w, w)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids/kv_segment_ids: give both or neither")
    if any(isinstance(x, QTensor) for x in (query, key, value)):
        return fp8.dot_product_attention_fp8(
            query, key, value, bias, mask, int32(q_segment_ids, "q_segment_ids"),
            int32(kv_segment_ids, "kv_segment_ids"), int32(query_seq_lengths, "query_seq_lengths"),
            int32(key_value_seq_lengths, "key_value_seq_lengths"), sinks, opt_float(scale), bool(is_causal), window,
            opt_float(logits_soft_cap), preferred_element_type, implementation)
    if preferred_element_type is not None:
        raise ValueError("preferred_element_type: only for fp8 attention (QTensor query/key/value); float "
                         f"attention returns the input dtype, got {preferred_element_type!r}")
    return dot_product_attention_op(
        query, key, value, bias, mask, int32(q_segment_ids, "q_segment_ids"),
        int32(kv_segment_ids, "kv_segment_ids"), int32(query_seq_lengths, "query_seq_lengths"),
        int32(key_value_seq_lengths, "key_value_seq_lengths"), sinks, opt_float(scale), bool(is_causal), window,
        opt_float(logits_soft_cap),
        implementation, opt_int(chunk_size), precision)


def _varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array, cu_seqlens_k: Array, sinks: Array | None, *,
            max_seqlen_q: int, max_seqlen_k: int, scale: float | None, is_causal: bool,
            local_window_size: list[int] | None, logits_soft_cap: float | None, implementation: str | None,
            chunk_size: int | None, precision: str | None) -> Array:
    return stellax.dot_product_attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, is_causal=is_causal,
        local_window_size=decode_window(local_window_size), logits_soft_cap=logits_soft_cap, sinks=sinks,
        implementation=implementation, chunk_size=chunk_size, precision=precision)


dot_product_attention_varlen_op = define_op("dot_product_attention_varlen", _varlen)


def dot_product_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                                 cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, *,
                                 scale: float | None = None, is_causal: bool = False, local_window_size=None,
                                 logits_soft_cap: float | None = None, sinks: torch.Tensor | None = None,
                                 implementation: str | None = None, chunk_size: int | None = None,
                                 precision: str | None = None) -> torch.Tensor:
    """FlashAttention's varlen form: packed ``q [total_q, N, H]``,
    ``k``/``v [total_kv, K, H]``, ``cu_seqlens_q``/``cu_seqlens_k [S + 1]``
    integers, ``max_seqlen_q``/``max_seqlen_k`` ints. Masks (``is_causal``,
    ``local_window_size``, ``chunk_size``) align per sequence; returns
    ``[total_q, N, Hv]`` in ``q.dtype``. Differentiable in q, k, v and sinks."""
    return dot_product_attention_varlen_op(
        q, k, v, int32(cu_seqlens_q, "cu_seqlens_q"), int32(cu_seqlens_k, "cu_seqlens_k"), sinks, int(max_seqlen_q),
        int(max_seqlen_k),
        opt_float(scale), bool(is_causal), encode_window(local_window_size), opt_float(logits_soft_cap),
        implementation, opt_int(chunk_size), precision)
