"""The `paged_attention` op: new query tokens (decode, speculative
multi-token decode) against a paged, optionally quantized KV cache."""

from __future__ import annotations

from ...core import Call, checks
from ...core.pallas import nbytes
from . import examples, mosaic_tpu
from . import triton as triton_kernels
from . import xla as xla_kernels
from .base import (
    check_pools, check_sinks, check_windows, common_options, int_array, live_tokens, pool_bytes_per_token, serving_op,
    value_dim,
)
from .cache import pool_entries
from .configs import PagedConfig, paged_heuristic, paged_requirements, paged_space
from .reference import paged_attention_reference


def check_paged(q, k_pages, v_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
                local_window_size=None, sinks=None, precision=None) -> Call:
    """Checked `paged_attention_op` arguments (see `paged_attention`); pools become named
    arrays and options (`cache.pool_entries`)."""
    q = checks.require_float("q", q)
    checks.require_ndim("q", q, (3, 4))
    b, n, h = q.shape[0], q.shape[-2], q.shape[-1]
    check_pools(q.dtype, h, n, k_pages, v_pages)
    checks.require_int("block_tables", block_tables)
    checks.require_ndim("block_tables", block_tables, 2)
    checks.require_shape("block_tables", block_tables, (b, None), "[batch, max_pages_per_seq]")
    int_array("lengths", lengths, (b,))
    sinks = check_sinks(sinks, n)
    check_windows(k_pages, v_pages, b, "one per batch row")
    k_arrays, k_opts = pool_entries("k", k_pages)
    v_arrays, v_opts = pool_entries("v", v_pages)
    arrays = {"q": q, **k_arrays, **v_arrays, "block_tables": block_tables, "lengths": lengths, "sinks": sinks}
    return Call(arrays, {**common_options(scale, logits_soft_cap, local_window_size, h, precision), **k_opts, **v_opts})


def _paged_flops(call: Call) -> float:
    q = call.q
    nq = 1 if q.ndim == 3 else q.shape[1]
    n, h = q.shape[-2], q.shape[-1]
    return 2.0 * nq * n * (h + value_dim(call, h)) * live_tokens(call, call.lengths, call.block_tables)


def _paged_bytes(call: Call) -> float:
    tokens = live_tokens(call, call.lengths, call.block_tables)
    kv = tokens * (pool_bytes_per_token(call, "k") + pool_bytes_per_token(call, "v"))
    return kv + 2 * nbytes(call.q) + nbytes(call.block_tables) + nbytes(call.lengths)


paged_attention_op = serving_op(
    "paged_attention", check=check_paged, reference=paged_attention_reference, triton=triton_kernels.run_paged,
    xla=xla_kernels.run_paged, config_type=PagedConfig, heuristic=paged_heuristic, space=paged_space,
    requirements=paged_requirements, flops=_paged_flops, bytes_accessed=_paged_bytes,
    examples=examples.paged_examples, benchmarks=examples.paged_benchmarks,
    mosaic_tpu=mosaic_tpu.PAGED_IMPLEMENTATION)


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, logits_soft_cap=None,
                    local_window_size=None, sinks=None, precision=None, implementation=None, config=None):
    """Attention of new query tokens against a paged KV cache (decode, and
    speculative multi-token decode).

    Args:
      q: ``[B, N, H]`` (one new token per sequence) or ``[B, Q, N, H]`` (``Q``
        new tokens, the last ``Q`` positions of the sequence: bottom-right
        causal, query ``i`` at position ``L - Q + i``).
      k_pages, v_pages: ``[num_pages, page_size, K, H]`` (``v_pages`` may have
        its own head dim), dense in ``q.dtype`` or `QuantizedPages`
        (int8/fp8/int4/int2, dequantized inside the kernels); or a combined
        ``kv_pages [num_pages, page_size, 2, K, H]`` as ``k_pages`` with
        ``v_pages=None``. ``N`` must be a multiple of ``K`` (GQA).
      block_tables: ``[B, max_pages]`` int32: page of each sequence's ``i``-th
        ``page_size`` tokens. Only the first ``ceil(L / page_size)`` entries
        are read.
      lengths: ``[B]`` int32: tokens in each sequence's cache, the new ones
        included. ``0`` gives zeros.
      scale: logit scale (default ``1/sqrt(H)``).
      logits_soft_cap: ``cap · tanh(s / cap)`` on the scaled logits.
      local_window_size: ``left`` (or ``(left, 0)``): query at position ``qp``
        sees keys ``qp - left <= p <= qp`` (as `dot_product_attention`).
      sinks: ``[N]`` per-head sink logits (in the softmax denominator only).
      precision: float32 contraction precision (None: 'highest' unless
        `jax.default_matmul_precision` is set); see docs/precision.md.
      implementation: ``None`` (best available), ``"triton"`` or ``"xla"``.
      config: a `PagedConfig` for the Triton kernels.

    Returns ``[B, (Q,) N, Hv]`` in ``q.dtype``. Out-of-range metadata is
    clamped under jit; use `stellax.paged.validate` to get errors.
    """
    return paged_attention_op(q, k_pages, v_pages, block_tables, lengths, scale=scale,
                              logits_soft_cap=logits_soft_cap, local_window_size=local_window_size, sinks=sinks,
                              precision=precision, implementation=implementation, config=config)
