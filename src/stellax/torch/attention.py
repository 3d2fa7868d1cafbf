"""Torch front end of `stellax.dot_product_attention`.

Layouts are those of the JAX twin: query ``[B, T, N, H]``, key ``[B, S, K, H]``,
value ``[B, S, K, Hv]`` (GQA when ``N % K == 0``, keys never repeated).
"""

from __future__ import annotations

import torch

import stellax

from .registry import define_op


def _attention(query, key, value, bias, mask, q_segment_ids, kv_segment_ids, query_seq_lengths,
               key_value_seq_lengths, sinks, *, scale, is_causal, local_window_size, logits_soft_cap,
               implementation, chunk_size=None, precision=None):
    window = None
    if local_window_size is not None:
        left, right = local_window_size
        window = (None if left < 0 else left, None if right < 0 else right)
    return stellax.dot_product_attention(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal, local_window_size=window,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap, sinks=sinks,
        implementation=implementation, chunk_size=chunk_size, precision=precision)


def _fake(query, key, value, *rest, **_):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


dot_product_attention_op = define_op(
    "dot_product_attention", _attention,
    tensors=("query", "key", "value", "bias?", "mask?!", "q_segment_ids?!", "kv_segment_ids?!",
             "query_seq_lengths?!", "key_value_seq_lengths?!", "sinks?"),
    options={"scale": "float?", "is_causal": "bool", "local_window_size": "int[]?", "logits_soft_cap": "float?",
             "implementation": "str?", "chunk_size": "int?", "precision": "str?"},
    fake=_fake)


def _int32(t):
    return None if t is None else t.to(torch.int32)


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
    window = None
    if local_window_size is not None:
        if isinstance(local_window_size, int):
            window = [int(local_window_size), int(local_window_size)]  # jax.nn: an int w means (w, w)
        else:
            left, right = local_window_size
            window = [-1 if left is None else int(left), -1 if right is None else int(right)]
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids/kv_segment_ids: give both or neither")
    from .quant import QTensor
    if any(isinstance(x, QTensor) for x in (query, key, value)):
        from . import attention_fp8 as fp8
        operands, metas = [], []
        for name, x in zip(("query", "key", "value"), (query, key, value)):
            args, meta = fp8.operand_args(name, x)
            operands += args
            metas.append(meta)
        return fp8.dot_product_attention_fp8_op(
            *operands, bias, mask, _int32(q_segment_ids), _int32(kv_segment_ids), _int32(query_seq_lengths),
            _int32(key_value_seq_lengths), sinks, *metas, None if scale is None else float(scale), bool(is_causal),
            window, None if logits_soft_cap is None else float(logits_soft_cap),
            fp8.dtype_option(preferred_element_type), implementation)
    if preferred_element_type is not None:
        raise ValueError("preferred_element_type: only for fp8 attention (QTensor query/key/value); float "
                         f"attention returns the input dtype, got {preferred_element_type!r}")
    return dot_product_attention_op(
        query, key, value, bias, mask, _int32(q_segment_ids), _int32(kv_segment_ids),
        _int32(query_seq_lengths), _int32(key_value_seq_lengths), sinks,
        None if scale is None else float(scale), bool(is_causal), window,
        None if logits_soft_cap is None else float(logits_soft_cap), implementation,
        None if chunk_size is None else int(chunk_size), precision)


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, sinks, *, max_seqlen_q, max_seqlen_k, scale, is_causal,
            local_window_size, logits_soft_cap, implementation, chunk_size=None, precision=None):
    window = None
    if local_window_size is not None:
        left, right = local_window_size
        window = (None if left < 0 else left, None if right < 0 else right)
    return stellax.dot_product_attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale=scale, is_causal=is_causal,
        local_window_size=window, logits_soft_cap=logits_soft_cap, sinks=sinks, implementation=implementation,
        chunk_size=chunk_size, precision=precision)


dot_product_attention_varlen_op = define_op(
    "dot_product_attention_varlen", _varlen,
    tensors=("q", "k", "v", "cu_seqlens_q!", "cu_seqlens_k!", "sinks?"),
    options={"max_seqlen_q": "int", "max_seqlen_k": "int", "scale": "float?", "is_causal": "bool",
             "local_window_size": "int[]?", "logits_soft_cap": "float?", "implementation": "str?",
             "chunk_size": "int?", "precision": "str?"},
    fake=lambda q, k, v, *r, **_: q.new_empty((*q.shape[:-1], v.shape[-1])))


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
    window = None
    if local_window_size is not None:
        if isinstance(local_window_size, int):
            window = [int(local_window_size), int(local_window_size)]
        else:
            left, right = local_window_size
            window = [-1 if left is None else int(left), -1 if right is None else int(right)]
    return dot_product_attention_varlen_op(
        q, k, v, _int32(cu_seqlens_q), _int32(cu_seqlens_k), sinks, int(max_seqlen_q), int(max_seqlen_k),
        None if scale is None else float(scale), bool(is_causal), window,
        None if logits_soft_cap is None else float(logits_soft_cap), implementation,
        None if chunk_size is None else int(chunk_size), precision)
