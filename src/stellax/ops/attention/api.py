"""Public attention API: `dot_product_attention` and its op.

Three registered ops, their implementations generated from one backend table
(`base.BACKENDS`, in dispatch order):

* ``attention``: the forward (`dot_product_attention`); implementations
  ``mosaic_tpu`` (Pallas Mosaic TPU, splash-class; `SplashConfig`),
  ``triton`` (Pallas Triton, GPU; `FlashConfig`), ``xla_chunked``
  (memory-linear online softmax, the CPU default; `ChunkedConfig`) and
  ``xla`` (the float32 golden; no config);
* ``attention_fp8`` (`fp8.py`): the same with fp8 `QArray` query/key/value
  (all but ``mosaic_tpu``);
* ``attention_backward`` (`backward.py`): the gradients of ``(out, lse)``
  w.r.t. ``(q, k, v, bias, sinks)`` on canonical operands, the backward of
  both forward ops' VJP (`backward.run_forward`, one `core.vjp` rule).

What the implementations share — the argument check, the canonical form,
the cost models and the backend table — is in `base.py`.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import examples
from .backward import attention_backward_op, run_forward
from .base import (BACKENDS, Canonical, canonicalize, check_attention, forward_bytes, forward_flops, normalize_window,
                   reference)
from .fp8 import attention_fp8_op, is_quantized

# Re-exported: `normalize_window` (context parallelism) and the canonical form.
__all__ = [
    "Canonical", "attention_backward_op", "attention_fp8_op", "attention_op", "canonicalize", "check_attention",
    "dot_product_attention", "normalize_window",
]

attention_op = BACKENDS.op(
    "attention", run_forward, check=check_attention, reference=reference, flops=forward_flops,
    bytes_accessed=forward_bytes, examples=examples.forward_examples, benchmarks=examples.benchmarks,
    peers=examples.peers(), differentiable=("query", "key", "value", "bias", "sinks"))


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale=None, is_causal=False,
                          local_window_size=None, chunk_size=None, q_segment_ids=None, kv_segment_ids=None,
                          query_seq_lengths=None, key_value_seq_lengths=None, logits_soft_cap=None, sinks=None,
                          precision=None, return_residuals=False, implementation=None, config=None,
                          preferred_element_type=None, return_residual=None):
    """Scaled dot-product attention with the full mask family (flash attention).

    Shapes: ``B...`` is any number (≥ 0) of leading batch dims, ``T``/``S`` the query/key lengths,
    ``N`` query heads, ``K`` key/value heads (``N % K == 0``: GQA/MQA by head groups, K/V never
    repeated), ``H`` the query/key head dim, ``Hv`` the value head dim (may differ from ``H``).

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
      precision: float32 contraction precision of every implementation, forward and
        backward: None ('highest' unless `jax.default_matmul_precision` is set),
        'default', 'high', 'highest' or a `jax.lax.Precision` (docs/precision.md).
      return_residuals: also return the log-sum-exp ``[B..., N, T]`` float32
        of the softmax normalizer (including the sink): ``-inf`` for a fully
        masked row. It is differentiable, so partial attentions can be merged
        (``out = Σ exp(lse_i - lse) out_i``) with correct gradients.
      implementation: ``None`` (the best available: ``mosaic_tpu`` on a TPU,
        ``triton`` on a GPU, then ``xla_chunked``, ending in ``xla``),
        ``"mosaic_tpu"``, ``"triton"``, ``"xla_chunked"``, ``"xla"`` or a
        sequence tried in order. fp8 attention has all but ``mosaic_tpu``.
      config: an explicit kernel config for the chosen implementation:
        `SplashConfig` (``mosaic_tpu``), `FlashConfig` (``triton``),
        `ChunkedConfig` (``xla_chunked``; ``xla`` takes none). The backward
        picks its own (`SplashBackwardConfig`, `FlashBackwardConfig`,
        `ChunkedConfig`) by heuristic or tuned cache.
      preferred_element_type: fp8 attention only: the output dtype
        (bfloat16 by default; float16 or float32).
      return_residual: `jax.nn.dot_product_attention`'s flag, for drop-in use:
        returns ``(out, lse)`` with the log-sum-exp in jax.nn's layout
        ``[B..., T, N]`` (``return_residuals`` gives ``[B..., N, T]``); pass
        one of the two.

    As in `jax.nn.dot_product_attention`, ``query_seq_lengths`` /
    ``key_value_seq_lengths`` may also be Python lists or tuples of ints.

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
    options = dict(scale=scale, is_causal=is_causal, local_window_size=local_window_size, chunk_size=chunk_size,
                   q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, query_seq_lengths=query_seq_lengths,
                   key_value_seq_lengths=key_value_seq_lengths, logits_soft_cap=logits_soft_cap, sinks=sinks,
                   precision=precision, implementation=implementation, config=config)
    return _dispatch(query, key, value, bias, mask, return_residuals, return_residual, preferred_element_type, options)


def _dispatch(query, key, value, bias, mask, return_residuals, return_residual, preferred_element_type, options):
    """`dot_product_attention` on its gathered keyword ``options``: jax.nn's residual layout, then
    fp8 attention, an empty batch or the float op."""
    if return_residual is not None:
        return _jax_nn_residual(query, key, value, bias, mask, return_residuals, return_residual,
                                preferred_element_type=preferred_element_type, **options)
    options = dict(options, query_seq_lengths=_lengths("query_seq_lengths", options["query_seq_lengths"]),
                   key_value_seq_lengths=_lengths("key_value_seq_lengths", options["key_value_seq_lengths"]))
    if is_quantized(query, key, value):
        return attention_fp8_op(query, key, value, bias, mask, return_residuals=return_residuals,
                                preferred_element_type=preferred_element_type, **options)
    if preferred_element_type is not None:
        raise ValueError("preferred_element_type: only for fp8 attention (QArray query/key/value); float "
                         f"attention returns the input dtype, got {preferred_element_type!r}")
    empty = _empty_batch_result(query, key, value, return_residuals)
    if empty is not None:
        return empty
    return attention_op(query, key, value, bias, mask, return_residuals=return_residuals, **options)


def _empty_batch_result(query, key, value, return_residuals):
    """The result of a call with no query rows (a batch dim or ``T`` of 0): an
    empty ``[B..., T, N, Hv]`` output (and ``[B..., N, T]`` lse), after the
    shape checks of any call (run on one-row stand-ins). ``None`` otherwise."""
    if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in (query, key, value)) or query.ndim < 3:
        return None
    batch, t = tuple(query.shape[:-3]), query.shape[-3]
    if t != 0 and 0 not in batch:
        return None
    if tuple(key.shape[:-3]) != batch:
        raise ValueError(f"key: expected batch dims {batch} (those of query), got shape {tuple(key.shape)}")
    ones = tuple(max(int(d), 1) for d in batch)
    stand_in = lambda a, rows: jnp.zeros(ones + (rows,) + tuple(a.shape[-2:]), a.dtype)
    attention_op.check(stand_in(query, 1), stand_in(key, max(int(key.shape[-3]), 1)) if key.shape[-3] else key,
                       stand_in(value, max(int(value.shape[-3]), 1)) if value.shape[-3] else value)
    out = jnp.zeros((*query.shape[:-1], value.shape[-1]), query.dtype)
    if return_residuals:
        return out, jnp.zeros((*batch, query.shape[-2], t), jnp.float32)
    return out


def _jax_nn_residual(query, key, value, bias, mask, return_residuals, return_residual, **kwargs):
    """`dot_product_attention` called with jax.nn's ``return_residual``: the
    log-sum-exp comes back in jax.nn's ``[B..., T, N]`` layout."""
    if return_residuals is not False:
        raise ValueError(f"return_residual / return_residuals: pass one of the two (jax.nn's return_residual gives "
                         f"the lse as [B..., T, N], return_residuals as [B..., N, T]); got "
                         f"return_residual={return_residual!r}, return_residuals={return_residuals!r}")
    if not isinstance(return_residual, bool):
        raise TypeError(f"return_residual: expected a bool, got {type(return_residual).__name__}")
    if not return_residual:
        return dot_product_attention(query, key, value, bias, mask, **kwargs)
    out, lse = dot_product_attention(query, key, value, bias, mask, return_residuals=True, **kwargs)
    return out, jnp.swapaxes(lse, -1, -2)


def _lengths(name, lengths):
    """Python lists / tuples of ints become int32 arrays (as jax.nn accepts them)."""
    if not isinstance(lengths, (list, tuple)):
        return lengths
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in lengths):
        raise TypeError(f"{name}: expected an int array or a list of ints, got {lengths!r}")
    return jnp.asarray(lengths, jnp.int32)
